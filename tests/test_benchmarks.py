"""The benchmark scripts, as a user runs them (a subprocess each: a test never imports a benchmark,
tests/test_layout.py): what the comparisons share (benchmarks/measure.py's doctests: loss curves read at a time
or at a target, the held-out draw), that the held-out draw is the records nanoforge prepare puts in val, and
vs_minimind.py's errors without a traceback."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def test_what_the_benchmarks_share_does_what_its_examples_say():
    r = subprocess.run([sys.executable, "-m", "doctest", "-v", str(ROOT / "benchmarks" / "measure.py")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT / "benchmarks")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert "0 failed" in r.stdout and " passed" in r.stdout and "\n0 passed" not in r.stdout, r.stdout[-500:]


def test_prepare_holds_out_the_records_the_comparisons_leave_out(tmp_path, tiny_tokenizer):
    """vs_minimind.py trains MiniMind on the records its held-out draw (benchmarks/measure.py is_heldout: record i
    when floor((i + 1) F) > floor(i F)) leaves out, and scores both tools on nanoforge's val split: the two must
    be the same records, or MiniMind would train on what it is scored on."""
    from nanoforge.data.prepare import prepare_dataset
    from nanoforge.data.shards import TokenShards

    texts = [f"record {i} " + "word " * (i % 7 + 1) for i in range(300)]
    src = tmp_path / "all.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    fraction = 13 / len(texts)
    prepare_dataset("pretrain", [src], tiny_tokenizer, tmp_path / "prep", val_fraction=fraction, workers=1,
                    log=lambda _: None)
    held = [t for i, t in enumerate(texts) if math.floor((i + 1) * fraction) > math.floor(i * fraction)]
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
