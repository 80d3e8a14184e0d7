"""Shared fixtures: the real test data beside the repo, and a small tokenizer trained on it.

The data lives in ../shared/data (see its README.md); it is never copied into the repo. Tests that need it
skip with the reason when it is absent, unless NANOFORGE_REQUIRE_SHARED=1 (CI sets it) makes that a failure.
NANOFORGE_HIDE_SHARED=1 makes every test see the suite as a fresh clone does, as if ../shared/data were absent
(it wins over NANOFORGE_REQUIRE_SHARED: those tests skip). Every lookup goes through `shared_data_dir()`.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

_REAL_SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shared_hidden() -> bool:
    """NANOFORGE_HIDE_SHARED=1: behave exactly as a fresh clone without ../shared does."""
    return os.environ.get("NANOFORGE_HIDE_SHARED") == "1"


def shared_data_dir() -> Path | None:
    """../shared/data, or None when it is absent or hidden (NANOFORGE_HIDE_SHARED=1). The one lookup every test
    uses: a test with its own fallback takes that on None; one that needs the data calls _missing_shared_data."""
    if shared_hidden() or not _REAL_SHARED_DATA.is_dir():
        return None
    return _REAL_SHARED_DATA


# Where the shared data is looked for; when hidden, a path that never exists, so that even a plain
# `SHARED_DATA.is_dir()` or `(SHARED_DATA / ...).is_file()` sees it absent. Prefer shared_data_dir().
SHARED_DATA = (_REAL_SHARED_DATA.with_name("data-hidden-by-NANOFORGE_HIDE_SHARED") if shared_hidden()
               else _REAL_SHARED_DATA)
_SESSION_CACHE: str | None = None


def pytest_configure(config):
    """Tests write only to temporary folders: the measured-CPU-peak cache (and matplotlib's font cache) of
    every run, in this process and the subprocesses it starts, go to one temporary folder for the session."""
    global _SESSION_CACHE
    import tempfile
    _SESSION_CACHE = tempfile.mkdtemp(prefix="nanoforge-test-cache-")
    os.environ["NANOFORGE_CACHE_DIR"] = os.path.join(_SESSION_CACHE, "nanoforge")
    os.environ["MPLCONFIGDIR"] = os.path.join(_SESSION_CACHE, "matplotlib")


def pytest_unconfigure(config):
    import shutil
    if _SESSION_CACHE:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def _missing_shared_data(what: str = "this test") -> None:
    """Skip (or fail under NANOFORGE_REQUIRE_SHARED=1) because ../shared/data is not there."""
    if shared_hidden():
        pytest.skip(f"{what} needs the shared test data at {_REAL_SHARED_DATA}; NANOFORGE_HIDE_SHARED=1 hides it")
    reason = (f"{what} needs the shared test data at {_REAL_SHARED_DATA} (a checkout of the project's shared/ "
              "folder beside the repo); it is absent")
    if os.environ.get("NANOFORGE_REQUIRE_SHARED") == "1":
        pytest.fail(reason + " and NANOFORGE_REQUIRE_SHARED=1 is set")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to ../shared/data; skips the test when it is absent or hidden (fails when NANOFORGE_REQUIRE_SHARED=1
    and it is absent)."""
    found = shared_data_dir()
    if found is None:
        _missing_shared_data()
    return found


@pytest.fixture(scope="session")
def minimind_code() -> Path:
    """MiniMind's own code (../shared/anchors/minimind), to run side by side; skips like `shared_data`."""
    anchors = _REAL_SHARED_DATA.parent / "anchors" / "minimind"
    if shared_data_dir() is None or not (anchors / "model" / "model_minimind.py").is_file():
        _missing_shared_data("this test (MiniMind's code in ../shared/anchors/minimind)")
    return anchors


# A few lines of our own, so tokenizer-dependent tests still run on a machine without ../shared.
_FALLBACK_TEXTS = [
    "Once upon a time there was a little robot who liked to count the stars at night.",
    "The quick brown fox jumps over the lazy dog, and the dog does not mind at all.",
    "春天来了，小河里的冰化了，岸边的柳树也发芽了。",
    "我们明天一起去图书馆看书吧，那里很安静。",
    "Numbers like 3.14159 and 2024 appear in text too; so do symbols: #, %, & and emoji 🙂.",
    # more distinct words, so that a 512-token vocabulary is reachable whatever the split pattern
    "Yesterday, seventeen curious zebras quietly walked beyond the marketplace, whispering jokes.",
    "窗外下着小雨，妈妈正在厨房里做晚饭，弟弟在客厅写作业。",
]


def _write_fallback_corpus(directory: Path) -> list[Path]:
    pretrain = directory / "fallback_pretrain.jsonl"
    with open(pretrain, "w", encoding="utf-8") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"{_FALLBACK_TEXTS[i % len(_FALLBACK_TEXTS)]} ({i})"},
                               ensure_ascii=False) + "\n")
    sft = directory / "fallback_sft.jsonl"
    with open(sft, "w", encoding="utf-8") as f:
        for i in range(50):
            conversation = [{"role": "user", "content": _FALLBACK_TEXTS[i % 5]},
                            {"role": "assistant", "content": _FALLBACK_TEXTS[(i + 1) % 5]}]
            f.write(json.dumps({"conversations": conversation}, ensure_ascii=False) + "\n")
    return [pretrain, sft]


def tree_state(root: Path) -> dict:
    """Every path under root: a file's content hash and mtime, a link's target, a directory: equal before and
    after a command that must leave nothing behind and change nothing there."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for p in (Path(dirpath, name) for name in dirnames + filenames):
            found[p] = (os.readlink(p) if p.is_symlink() else "dir" if p.is_dir() else
                        (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns))
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now (tests never take a fixed one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_corpus(directory: Path) -> list[Path]:
    """[pretraining JSONL, SFT JSONL]: ../shared/data/tiny's files, or (absent or hidden) the small fallback corpus
    written into directory."""
    shared = shared_data_dir()
    if shared is not None:
        return [shared / "tiny" / "pretrain_tiny.jsonl", shared / "tiny" / "sft_tiny.jsonl"]
    return _write_fallback_corpus(directory)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """Directory of a vocab-512 byte-level BPE tokenizer trained on ../shared/data/tiny/*.jsonl (or, without
    the shared data, on a small corpus written here)."""
    from nanoforge.data.sources import train_tokenizer

    work = tmp_path_factory.mktemp("tiny_tokenizer")
    shared = shared_data_dir()
    if shared is not None:
        files = sorted((shared / "tiny").glob("*.jsonl"))
    elif os.environ.get("NANOFORGE_REQUIRE_SHARED") == "1" and not shared_hidden():
        _missing_shared_data("tiny_tokenizer")
    else:
        files = _write_fallback_corpus(work)
    train_tokenizer(files, vocab_size=512, out_dir=work / "tokenizer")
    return work / "tokenizer"


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    """The tiny tokenizer (nanoforge.chat.tokenizer.Tokenizer); its files are in the `tiny_tokenizer_dir` fixture."""
    from nanoforge.chat.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tool_run_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny run SFT'd on calculator conversations (tests/tool_run.py); built once per session."""
    from tool_run import make_tool_run

    return make_tool_run(tmp_path_factory, tiny_tokenizer)


@pytest.fixture(scope="module")
def one_thread():
    """Decode on one thread (modules take it with `pytestmark = pytest.mark.usefixtures("one_thread")`): these
    models are so small that each op is microseconds, and with two threads on a machine busy with other work every
    op waits for the descheduled second thread (measured: the same 40-token generate took 0.05 s on one thread and
    0.3-8 s on two while another process ran)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_random_run(out: Path, tokenizer, max_seq_len: int) -> Path:
    """A random tiny model saved as a run (its config, the tokenizer and one checkpoint): an --init."""
    import dataclasses

    import torch

    from nanoforge.core.config import build_config
    from nanoforge.model.gpt import GPT
    from nanoforge.weights import checkpoint as ckpt

    mcfg, _ = build_config("tiny", None, {"vocab_size": tokenizer.vocab_size, "max_seq_len": max_seq_len})
    torch.manual_seed(0)
    tokenizer.save(out / "tokenizer")
    ckpt.save_checkpoint(out, 0, GPT(mcfg).state_dict_for_save(), {},
                         {"config": {"model": dataclasses.asdict(mcfg), "train": {"seq_len": 128}}})
    return out


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, tiny_tokenizer) -> Path:
    """A random tiny model of 1024 positions saved as a run (save_random_run): the RL stages' --init."""
    return save_random_run(tmp_path_factory.mktemp("rl_base") / "base", tiny_tokenizer, max_seq_len=1024)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    """The RL stages' prompts (write_sum_prompts), once per module."""
    return write_sum_prompts(tmp_path_factory.mktemp("prompts"))


def write_sum_prompts(directory: Path) -> Path:
    """prompts.jsonl of 12 sums ("3+4=", answer "7") for the RL stages, and beside it myreward.py with the
    user's own rewards: the reply's length in characters (chars), or a tenth of it (tenth_chars), so that a
    random model's replies differ in reward."""
    path = directory / "prompts.jsonl"
    with open(path, "w") as f:
        for a in range(12):
            f.write(json.dumps({"conversations": [{"role": "user", "content": f"{a}+{a + 1}="}],
                                "answer": str(2 * a + 1)}) + "\n")
    (directory / "myreward.py").write_text("def chars(completion, record):\n    return len(completion)\n\n\n"
                                           "def tenth_chars(completion, record):\n    return len(completion) / 10\n")
    return path


def metrics_of(run) -> list[dict]:
    """RUN/metrics.jsonl's records."""
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def arithmetic_reward_curve(work: Path, algo: str, *flags: str) -> list[float]:
    """The reward_mean of each RL step of `benchmarks/grpo_arithmetic.py --algo ALGO` at a small size (sums of
    digits below 8, SFT 200 steps, RL 40 steps), run as a user runs it (a subprocess) in `work`."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "benchmarks" / "grpo_arithmetic.py"), "--algo", algo, "--add-max", "8",
           "--mul-max", "0", "--sft-steps", "200", "--steps", "40", "--work", str(work / "arith"), *flags]
    r = subprocess.run(cmd, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [x["reward_mean"] for x in metrics_of(work / "arith" / f"rl-{algo}") if "reward_mean" in x]


def prepare_tiny(out: Path, tokenizer, kind: str = "pretrain", val_fraction: float = 0.1) -> Path:
    """tiny_corpus's pretraining (or SFT) file, written beside `out` where it is not shared, prepared into `out`."""
    from nanoforge.data.prepare import prepare_dataset

    files = tiny_corpus(out.parent)
    prepare_dataset(kind, files[:1] if kind == "pretrain" else files[1:2], tokenizer, out, val_fraction=val_fraction,
                    workers=1, log=lambda *a: None)
    return out


def run_with_peak_rss(cmd: list, limit: int, timeout: float, **popen) -> tuple[subprocess.CompletedProcess, int]:
    """Run `cmd`, sampling its resident memory from /proc; kill it once it passes `limit` bytes, so a test fails
    fast instead of exhausting the machine (asserted here). (the finished process, its peak RSS in bytes)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)
    state: dict = {}
    watchdog = threading.Thread(target=_watch_rss, args=(proc.pid, limit, state), daemon=True)
    watchdog.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        state["done"] = True
        proc.kill()
    assert not state.get("killed"), f"peak RSS passed {limit >> 20} MB (the watchdog killed it)"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), state.get("peak", 0)


def _watch_rss(pid: int, limit: int, state: dict) -> None:
    while not state.get("done"):
        try:
            with open(f"/proc/{pid}/status") as f:
                rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            return
        state["peak"] = max(state.get("peak", 0), rss)
        if rss > limit:
            state["killed"] = True
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.02)
