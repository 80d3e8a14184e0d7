"""Run reports: the numbers come from metrics.jsonl, the plots are real PNGs, and nothing crashes without
validation records or without matplotlib."""
import json
import shutil
import struct
import sys
from pathlib import Path

import pytest

from nanoforge.data.shards import prepare_dataset
from nanoforge.errors import NanoforgeError
from nanoforge.report import NO_MATPLOTLIB, write_report
from nanoforge.train.stages import pretrain

FAST = {"tensorboard": False, "precision": "fp32", "device": "cpu", "max_steps": 12, "log_every": 2,
        "warmup_steps": 2, "save_every": 0}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_tokenizer):
    from conftest import SHARED_DATA, _write_fallback_corpus
    work = tmp_path_factory.mktemp("report_data")
    if SHARED_DATA.is_dir():
        files = [SHARED_DATA / "tiny" / "pretrain_tiny.jsonl"]
    else:
        files = _write_fallback_corpus(work)[:1]
    out = work / "pre"
    prepare_dataset("pretrain", files, tiny_tokenizer, out, val_fraction=0.1, workers=1, log=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def run_with_val(prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "with_val"
    pretrain([str(prepared)], out, preset="tiny", overrides={**FAST, "eval_every": 4, "eval_batches": 2}, quiet=True)
    return out


@pytest.fixture(scope="module")
def run_without_val(prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "no_val"
    pretrain([str(prepared)], out, preset="tiny", overrides={**FAST, "eval_every": 0}, quiet=True)
    return out


def records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking the signature: a truncated or non-PNG file fails."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND", f"{path} is truncated"
    return struct.unpack(">II", data[16:24])


def test_report_holds_the_logged_numbers_and_valid_pngs(run_with_val, tmp_path):
    pytest.importorskip("matplotlib")
    out = write_report([run_with_val], tmp_path / "r" / "report.md", title="my runs")
    text = out.read_text()
    train = [r for r in records(run_with_val) if "loss" in r]
    val = [r for r in records(run_with_val) if "val_loss" in r]
    assert len(val) == 3  # steps 4, 8, 12
    best = min(val, key=lambda r: r["val_loss"])
    assert text.startswith("# my runs")
    assert f"{train[0]['loss']:.4f} (step {train[0]['step']}) -> {train[-1]['loss']:.4f} (step 12)" in text
    assert f"{val[0]['val_loss']:.4f} (step 4) -> {val[-1]['val_loss']:.4f} (step 12)" in text
    assert f"best {best['val_loss']:.4f} (step {best['step']})" in text
    assert f"{val[0]['val_bpb']:.4f} -> {val[-1]['val_bpb']:.4f}" in text
    assert "| precision | fp32 on cpu |" in text
    assert "| stage | pretrain |" in text
    png = tmp_path / "r" / "report_with_val.png"
    assert f"]({png.name})" in text
    width, height = png_size(png)
    assert width >= 400 and height >= 200


def test_report_without_validation_records(run_without_val, tmp_path):
    out = write_report([run_without_val], tmp_path / "report.md")
    text = out.read_text()
    assert not [r for r in records(run_without_val) if "val_loss" in r]
    assert "none logged" in text
    last = [r for r in records(run_without_val) if "loss" in r][-1]
    assert f"{last['loss']:.4f} (step 12)" in text
    if has_matplotlib():
        png_size(tmp_path / "report_no_val.png")


def test_report_without_matplotlib_writes_a_note_instead(run_with_val, tmp_path, monkeypatch):
    # None in sys.modules makes `import matplotlib...` raise ImportError, as on a machine without it
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    out = write_report([run_with_val], tmp_path / "report.md")
    text = out.read_text()
    assert NO_MATPLOTLIB in text
    assert "validation loss" in text and "![" not in text
    assert not list(tmp_path.glob("*.png"))


def test_two_runs_samples_and_odd_lines(run_with_val, run_without_val, tmp_path):
    """Events and a line cut short by a kill are skipped; runs with the same name get distinct plots; sample
    replies with pipes and newlines stay inside their table cells."""
    copy = tmp_path / "a" / "with_val"
    shutil.copytree(run_with_val, copy)
    with open(copy / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 12, "event": "rollback", "to_step": 8}) + "\n")
        f.write('{"step": 13, "loss": 1.0, "l')
    samples = [{"question": "What does a|b do?", "reply": "It ors.\nTwice.", "finish_reason": "stop",
                "expected": "Bitwise or.", "held_out": True}]
    out = write_report([copy, run_with_val], tmp_path / "both.md", samples=samples, preamble="**hello**")
    text = out.read_text()
    assert "**hello**" in text
    assert "(step 13)" not in text
    assert "events: rollback" in text
    assert text.count("## with_val") == 2
    assert "| What does a\\|b do? | It ors. Twice. | stop | Bitwise or. | yes |" in text
    if has_matplotlib():
        assert len(list(tmp_path.glob("both_*.png"))) == 2


def test_a_directory_without_metrics_is_an_error_naming_it(tmp_path):
    with pytest.raises(NanoforgeError, match="no metrics.jsonl"):
        write_report([tmp_path], tmp_path / "report.md")
    with pytest.raises(NanoforgeError, match="no run directories"):
        write_report([], tmp_path / "report.md")
