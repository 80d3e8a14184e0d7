"""benchmarks/vs_minimind.py's logic that decides its numbers: where nanoforge's validation curve crosses
MiniMind's loss, which records it holds out (they must be the ones nanoforge prepare puts in val), and its
errors without a traceback."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("vs_minimind", ROOT / "benchmarks" / "vs_minimind.py")
vs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vs)


def test_crossing_time_interpolates_between_the_points_around_the_target():
    curve = [(10.0, 8.0), (20.0, 6.0), (30.0, 5.0)]
    assert vs.crossing_time(curve, 7.0) == pytest.approx(15.0)
    assert vs.crossing_time(curve, 5.5) == pytest.approx(25.0)
    assert vs.crossing_time(curve, 5.0) == pytest.approx(30.0)


def test_crossing_time_first_point_already_there_and_never():
    assert vs.crossing_time([(10.0, 4.0), (20.0, 3.0)], 5.0) == 10.0
    assert vs.crossing_time([(10.0, 8.0), (20.0, 6.0)], 5.9) is None
    assert vs.crossing_time([], 5.0) is None


def test_crossing_time_takes_the_first_crossing_of_a_noisy_curve():
    # down through the target, back up, down again: the first crossing counts
    curve = [(0.0, 9.0), (10.0, 7.0), (20.0, 8.0), (30.0, 6.0)]
    assert vs.crossing_time(curve, 7.5) == pytest.approx(7.5)


def test_heldout_records_are_nanoforge_prepares_val_split(tmp_path, tiny_tokenizer):
    """The script trains MiniMind on the records is_heldout leaves out and scores on nanoforge's val split:
    both must be the same records, or MiniMind would train on what it is scored on."""
    from nanoforge.data.prepare import prepare_dataset
    from nanoforge.data.shards import TokenShards

    texts = [f"record {i} " + "word " * (i % 7 + 1) for i in range(300)]
    src = tmp_path / "all.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    fraction = 13 / len(texts)
    prepare_dataset("pretrain", [src], tiny_tokenizer, tmp_path / "prep", val_fraction=fraction, workers=1,
                    log=lambda _: None)
    held = [t for i, t in enumerate(texts) if vs.is_heldout(i, fraction)]
    assert len(held) == 13
    val = TokenShards(tmp_path / "prep", "val")
    expected = np.concatenate([tiny_tokenizer.encode(t) + [tiny_tokenizer.eos_id] for t in held])
    assert val.num_docs == 13
    assert np.array_equal(val.read(0, val.num_tokens), expected)


def test_missing_checkout_and_python_are_clear_errors(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_minimind.py"), "--minimind",
                        str(tmp_path / "nope"), "--minimind-python", str(tmp_path / "python"),
                        "--data", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--minimind" in r.stderr and "no MiniMind checkout" in r.stderr
    assert "--minimind-python" in r.stderr and "no executable" in r.stderr
    assert "Traceback" not in r.stderr


def test_loss_at_is_the_last_validation_by_then():
    curve = [(10.0, 8.0), (20.0, 6.0), (30.0, 5.0)]
    assert vs.loss_at(curve, 9.0) is None
    assert vs.loss_at(curve, 10.0) == 8.0
    assert vs.loss_at(curve, 29.9) == 6.0
    assert vs.loss_at(curve, 100.0) == 5.0
