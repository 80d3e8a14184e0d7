"""One process per run directory (and per prepare --out): a second one stops at once naming the holder and
changes nothing; a SIGKILLed holder leaves no lock behind. Real processes."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoforge.core import dirlock
from nanoforge.core.errors import NanoforgeError

ROOT = Path(__file__).resolve().parents[2]
HOLD = ("import sys, time; from nanoforge.core import dirlock; dirlock.acquire(sys.argv[1], 'x'); "
        "print('held', flush=True); time.sleep(600)")


def nf(*args, **kw):
    return subprocess.run([sys.executable, "-m", "nanoforge", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, **kw)


def start_holder(lock_path):
    """Another real process that holds `lock_path` until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("lock_corpus")
    words = "one two three four five six seven eight nine ten eleven twelve".split()
    with open(d / "pre.jsonl", "w") as f:
        for i in range(120):
            f.write(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(30))}) + "\n")
    return d


def test_second_training_process_on_one_run_directory_stops_and_changes_nothing(corpus, tmp_path):
    run = tmp_path / "run"
    line = ["pretrain", "--preset", "tiny", "--vocab-size", 300, "--data", corpus / "pre.jsonl", "--out", run,
            "--seq-len", 32, "--log-every", 1, "--eval-every", 0, "--save-every", 5, "--tensorboard", "false",
            "--precision", "fp32"]
    first = subprocess.Popen([sys.executable, "-m", "nanoforge", *map(str, [*line, "--max-steps", 100000])],
                             stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for text in first.stderr:  # wait until it trains
            if text.startswith("step") and "loss" in text:
                break
        while not list((run / "checkpoints").glob("step_*")):
            time.sleep(0.2)
        for extra in ([], ["--resume"]):  # a double Enter, and a requeued job's `--resume`, while it still runs
            second = nf(*line, "--max-steps", 100000, *extra)
            assert second.returncode == 1
            assert f"run directory {run} is in use by another process (pid {first.pid} " in second.stderr
            assert "pretrain" in second.stderr and "Traceback" not in second.stderr
        first.send_signal(signal.SIGSTOP)  # freeze it: nothing it does may be mistaken for the second's writes
        frozen = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
        assert nf(*line, "--max-steps", 100000, "--resume").returncode == 1
        assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == frozen
        first.send_signal(signal.SIGKILL)  # no chance to clean up: the kernel drops the lock
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    resumed_at = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    done = nf(*line, "--max-steps", resumed_at + 2, "--resume")
    assert done.returncode == 0, done.stderr
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == resumed_at + 2


def test_prepare_into_an_out_another_prepare_holds_stops_and_writes_nothing(corpus, tmp_path, tiny_tokenizer_dir):
    out = tmp_path / "data" / "pre"
    out.parent.mkdir(parents=True)
    holder = start_holder(out.parent / ".pre.lock")  # where prepare locks --out DIR: DIR's parent, .NAME.lock
    try:
        r = nf("prepare", "--kind", "pretrain", "--data", corpus / "pre.jsonl", "--tokenizer", tiny_tokenizer_dir,
               "--out", out)
        assert r.returncode == 1
        assert f"{out} (being prepared) is in use by another process (pid {holder.pid} " in r.stderr
        assert not out.exists() and sorted(p.name for p in out.parent.iterdir()) == [".pre.lock"]
    finally:
        holder.kill()
        holder.wait()
    r = nf("prepare", "--kind", "pretrain", "--data", corpus / "pre.jsonl", "--tokenizer", tiny_tokenizer_dir,
           "--out", out)
    assert r.returncode == 0, r.stderr
    assert (out / "manifest.json").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["pre"], "the lock file goes with its prepare"


def test_lock_is_exclusive_and_released_with_its_holder(tmp_path):
    path = tmp_path / ".lock"
    lock = dirlock.acquire(path, "run directory R")
    with pytest.raises(NanoforgeError, match=rf"run directory R is in use by another process \(pid {os.getpid()} "):
        dirlock.acquire(path, "run directory R")  # a second descriptor conflicts even in the same process
    lock.release()
    dirlock.acquire(path, "run directory R").release()
    holder = start_holder(path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with dirlock.acquire(path, "run directory R"):
        assert json.loads(path.read_text())["pid"] == os.getpid()
