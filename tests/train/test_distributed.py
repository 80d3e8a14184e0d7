"""Training under torchrun: real processes (gloo, CPU) through the same `nanoforge pretrain` command.

2 processes x batch B must train exactly like 1 process x batch 2B (the global batch is the same, the loss is
normalised by the global token count), checkpoints written by 2 processes must resume on 1 and on 2, and
only rank 0 writes files. The same for FSDP2 (--fsdp true).
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import prepare_tiny
from nanoforge.weights import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--preset", "tiny", "--precision", "fp32", "--device", "cpu", "--max-steps", "4", "--log-every", "1",
          "--eval-every", "2", "--save-every", "2", "--keep-last", "5", "--tensorboard", "false", "--seq-len", "32",
          "--grad-accum", "2", "--eval-batches", "1000", "--quiet"]  # validation: the whole split, any batch size
B = 2  # per-process batch; the single-process reference runs 2 * B


@pytest.fixture(scope="module")
def pretrain_dir(tmp_path_factory, tiny_tokenizer):
    return prepare_tiny(tmp_path_factory.mktemp("dist_prep") / "pre", tiny_tokenizer, val_fraction=0.02)


def run(args, nproc=1, timeout=120):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                 "--standalone", "-m", "nanoforge"] if nproc > 1 else [sys.executable, "-m", "nanoforge"])
    proc = subprocess.run(launcher + ["pretrain", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def curve(run_dir, key="loss"):
    return [(r["step"], r[key]) for r in records(run_dir) if key in r]


def assert_close(a, b, rel=1e-5):
    assert [s for s, _ in a] == [s for s, _ in b], (a, b)
    for (step, x), (_, y) in zip(a, b):
        assert abs(x - y) <= rel * max(abs(x), abs(y)), f"step {step}: {x} vs {y}"


def cut_back_to(run_dir, src, step):
    """A copy of run `src` as if it had stopped after checkpoint `step`."""
    shutil.copytree(src, run_dir)
    for path in ckpt.list_checkpoints(run_dir):
        if int(path.name.split("_")[1]) > step:
            shutil.rmtree(path)


@pytest.fixture(scope="module")
def runs(pretrain_dir, tmp_path_factory):
    """The uninterrupted runs the tests compare against: 1 process x 2B, 2 processes x B."""
    out = tmp_path_factory.mktemp("dist_runs")
    run(["--data", str(pretrain_dir), "--out", str(out / "single"), "--batch-size", str(2 * B), *COMMON])
    run(["--data", str(pretrain_dir), "--out", str(out / "ddp"), "--batch-size", str(B), *COMMON], nproc=2)
    return out


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(runs):
    assert len(curve(runs / "ddp")) == 4
    assert_close(curve(runs / "ddp"), curve(runs / "single"))
    assert_close(curve(runs / "ddp", "val_loss"), curve(runs / "single", "val_loss"))
    a = load_file(str(ckpt.latest_checkpoint(runs / "ddp") / "model.safetensors"))
    b = load_file(str(ckpt.latest_checkpoint(runs / "single") / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max() <= 1e-4, k


@pytest.mark.slow
def test_only_rank_zero_writes(runs):
    recs = records(runs / "ddp")
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4]  # no line twice
    assert [r["step"] for r in recs if "val_loss" in r] == [2, 4]
    names = sorted(p.name for p in (runs / "ddp").iterdir())
    assert names == sorted(p.name for p in (runs / "single").iterdir())
    assert [p.name for p in ckpt.list_checkpoints(runs / "ddp")] == ["step_000002", "step_000004"]
    assert not list((runs / "ddp" / "checkpoints").glob(".tmp-*"))
    state = json.loads((ckpt.latest_checkpoint(runs / "ddp") / "state.json").read_text())
    assert state["run_state"]["tokens_seen"] == 4 * 2 * B * 2 * 32  # global: steps x ranks x B x accum x T


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_two_process_checkpoint_resumes_on_one_and_two(runs, tmp_path, nproc):
    resumed = tmp_path / "resumed"
    cut_back_to(resumed, runs / "ddp", 2)
    run(["--out", str(resumed), "--resume", "--batch-size", str(2 * B // nproc), *COMMON[2:]], nproc=nproc)
    assert_close(curve(resumed), curve(runs / "ddp"))
    assert_close(curve(resumed, "val_loss"), curve(runs / "ddp", "val_loss"))


@pytest.mark.slow
def test_fsdp_matches_and_resumes_on_any_world_size(runs, pretrain_dir, tmp_path):
    fsdp = tmp_path / "fsdp"
    run(["--data", str(pretrain_dir), "--out", str(fsdp), "--batch-size", str(B), "--fsdp", "true", *COMMON],
        nproc=2)
    assert_close(curve(fsdp), curve(runs / "single"))
    # full (gathered) weights, the same keys and shapes as a single-process checkpoint
    a = load_file(str(ckpt.latest_checkpoint(fsdp) / "model.safetensors"))
    b = load_file(str(ckpt.latest_checkpoint(runs / "single") / "model.safetensors"))
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    # an FSDP checkpoint resumes in a single process, and a DDP checkpoint resumes under FSDP
    single = tmp_path / "fsdp_to_single"
    cut_back_to(single, fsdp, 2)
    run(["--out", str(single), "--resume", "--batch-size", str(2 * B), "--fsdp", "false", *COMMON[2:]])
    assert_close(curve(single), curve(runs / "single"))
    to_fsdp = tmp_path / "ddp_to_fsdp"
    cut_back_to(to_fsdp, runs / "ddp", 2)
    run(["--out", str(to_fsdp), "--resume", "--batch-size", str(B), "--fsdp", "true", *COMMON[2:]], nproc=2)
    assert_close(curve(to_fsdp), curve(runs / "single"))


@pytest.mark.slow
def test_compiled_ddp_matches_eager_ddp(runs, pretrain_dir, tmp_path):
    """--compile under torchrun: the compiled DDP model trains like the eager one (accumulation included), and
    validation on the uncompiled twin agrees."""
    compiled = tmp_path / "compiled"
    run(["--data", str(pretrain_dir), "--out", str(compiled), "--batch-size", str(B), "--compile", "true",
         *COMMON], nproc=2, timeout=600)
    assert_close(curve(compiled), curve(runs / "ddp"), rel=1e-4)
    assert_close(curve(compiled, "val_loss"), curve(runs / "ddp", "val_loss"), rel=1e-4)


def test_collective_timeout_comes_from_the_environment(monkeypatch):
    """A collective waits for a dead peer this long (default 10 minutes), then fails; a bad value is an error
    that names the variable."""
    from nanoforge.core.errors import NanoforgeError
    from nanoforge.train.distributed import _timeout_minutes
    monkeypatch.delenv("NANOFORGE_DIST_TIMEOUT_MIN", raising=False)
    assert _timeout_minutes() == 10.0
    monkeypatch.setenv("NANOFORGE_DIST_TIMEOUT_MIN", "45")
    assert _timeout_minutes() == 45.0
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("NANOFORGE_DIST_TIMEOUT_MIN", bad)
        with pytest.raises(NanoforgeError, match="NANOFORGE_DIST_TIMEOUT_MIN"):
            _timeout_minutes()


PEERS = """import os, sys, time, torch
from nanoforge.train import distributed
rank = int(os.environ["RANK"])
with distributed.main_first():
    if rank == 0:
        time.sleep(8)  # preparing data: longer than the collectives' timeout
print("prepared", flush=True)
if rank == 1:
    time.sleep(120)  # a peer that stops answering
start = time.monotonic()
try:
    distributed.all_reduce_sum(torch.ones(1))
except Exception as e:
    print(f"failed after {time.monotonic() - start:.0f} s: {e}"[:200], flush=True)
    os._exit(3)
"""


@pytest.mark.slow
def test_a_silent_peer_fails_the_collective_after_the_timeout_but_not_main_first(tmp_path):
    """NANOFORGE_DIST_TIMEOUT_MIN=0.05 (3 s): a collective whose peer stops answering fails within it, while the
    others' wait for rank 0 in main_first (8 s) is not bounded by it. Real processes, gloo."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "NANOFORGE_DIST_TIMEOUT_MIN": "0.05",
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "LOCAL_RANK"):
        env.pop(key, None)
    procs = [subprocess.Popen([sys.executable, "-c", PEERS], cwd=ROOT, env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        procs[1].kill()
    assert procs[0].returncode == 3 and "prepared" in out, out + err[-3000:]
    assert procs[1].communicate()[0] == "prepared\n"
    assert int(out.split("failed after ")[1].split(" s")[0]) < 30, out
