"""torchrun as a cluster uses it, in real processes (gloo, CPU): an elastic restart after a worker is lost
(SIGKILL, no checkpoint, no cleanup) continues with `--resume auto` to the same weights, bit for bit, as an
uninterrupted run; and two launchers joined by c10d rendezvous (two "nodes", one process each) train exactly
like one process with the same global batch."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from nanoforge.data.prepare import prepare_dataset
from nanoforge.weights import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["pretrain", "--preset", "tiny", "--precision", "fp32", "--device", "cpu", "--max-steps", "6",
          "--log-every", "1", "--eval-every", "0", "--save-every", "2", "--keep-last", "5", "--tensorboard",
          "false", "--seq-len", "32", "--grad-accum", "2"]
B = 2  # per-process batch


def env(**extra):
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        e.pop(key, None)
    return e


def torchrun(*launcher_args):
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args, "-m", "nanoforge"]


def check(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    return proc


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish_together(procs, timeout=300):
    """Wait for the launchers; when one fails, stop the others (a failed node leaves the rest waiting at
    torchrun's exit barrier for 5 minutes) so the failure is reported with everyone's output."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.communicate() for p in procs]


def weights(run_dir):
    return load_file(str(ckpt.latest_checkpoint(run_dir) / "model.safetensors"))


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and bool((wa[k] == wb[k]).all()), f"{k} differs"


def logged_steps(run_dir):
    return [json.loads(l)["step"] for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in l]


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_tokenizer):
    from conftest import tiny_corpus
    work = tmp_path_factory.mktemp("elastic_prep")
    prepare_dataset("pretrain", tiny_corpus(work)[:1], tiny_tokenizer, work / "pre", val_fraction=0.0,
                    workers=1, log=lambda *a: None)
    return work / "pre"


@pytest.fixture(scope="module")
def plain(data, tmp_path_factory):
    """The uninterrupted run a restarted one must end equal to."""
    out = tmp_path_factory.mktemp("elastic_plain") / "plain"
    check(subprocess.run(torchrun("--standalone", "--nproc-per-node", "2") + [*COMMON, "--data", str(data),
                         "--batch-size", str(B), "--out", str(out)], cwd=ROOT, env=env(), capture_output=True,
                         text=True, timeout=300))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [["--nproc-per-node", "2", "--max-restarts", "3"],  # static rendezvous
                                      ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]])
def test_a_lost_worker_restarts_and_ends_bit_exact(data, plain, tmp_path, launcher):
    """Both launchers keep one rendezvous store for all attempts (no TORCH_DISABLE_SHARE_RDZV_TCP_STORE): the
    restarted group must not read the dead attempt's keys in it."""
    elastic = tmp_path / "elastic"
    line = [*COMMON, "--data", str(data), "--batch-size", str(B), "--resume", "auto", "--out", str(elastic)]
    proc = check(subprocess.run(torchrun(*launcher) + line, cwd=ROOT, env=env(NANOFORGE_INJECT_KILL="1@3"),
                                capture_output=True, text=True, timeout=300))
    assert "exitcode: -9" in proc.stderr, proc.stderr[-3000:]  # torchrun saw rank 1 die of SIGKILL
    assert "--resume auto: continuing" in proc.stdout and "step_000002" in proc.stdout
    assert logged_steps(elastic) == [1, 2, 3, 4, 5, 6], "step 3 redone from the step-2 checkpoint, logged once"
    assert_same_weights(elastic, plain)


def assert_close(a, b, rel=1e-5):
    assert [s for s, _ in a] == [s for s, _ in b], (a, b)
    for (step, x), (_, y) in zip(a, b):
        assert abs(x - y) <= rel * max(abs(x), abs(y)), f"step {step}: {x} vs {y}"


def curve(run_dir):
    return [(r["step"], r["loss"]) for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


def two_nodes(line, restarts="3", **extra_env):
    """Two torchrun launchers, as two machines would start them (the same line; c10d rendezvous at one
    endpoint), one process each, sharing the run directory: their procs and (stdout, stderr)s."""
    launcher = torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        f"127.0.0.1:{free_port()}", "--rdzv-id", "nanoforge-test", "--max-restarts", restarts)
    procs = [subprocess.Popen(launcher + line, cwd=ROOT, env=env(**extra_env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    return procs, finish_together(procs)


@pytest.mark.slow
def test_two_nodes_by_c10d_rendezvous_match_one_process_through_a_restart(data, tmp_path):
    """The README's line for several machines, a worker lost on one of them: equal to one process with the same
    global batch."""
    single = tmp_path / "single"
    check(subprocess.run([sys.executable, "-m", "nanoforge", *COMMON, "--data", str(data), "--batch-size",
                          str(2 * B), "--out", str(single)], cwd=ROOT, env=env(), capture_output=True, text=True,
                         timeout=300))
    nodes = tmp_path / "nodes"
    line = [*COMMON, "--data", str(data), "--batch-size", str(B), "--out", str(nodes), "--resume", "auto"]
    procs, outs = two_nodes(line, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", NANOFORGE_INJECT_KILL="1@3")
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-3000:] + err[-8000:]
    assert "x 2 processes (DDP)" in outs[0][1] + outs[1][1], "one job of two processes, not two jobs"
    assert "exitcode: -9" in outs[0][1] + outs[1][1] and "continuing" in outs[0][0] + outs[1][0]
    assert logged_steps(nodes) == [1, 2, 3, 4, 5, 6]
    assert_close(curve(nodes), curve(single))
    a, b = weights(nodes), weights(single)
    for k in a:
        assert (a[k] - b[k]).abs().max() <= 1e-4, k


@pytest.mark.slow
def test_two_nodes_sharing_the_launchers_store_are_refused_at_the_start(data, tmp_path):
    """Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun keeps one store for every attempt, and a node
    restarted for another's failure keeps its attempt count: such a job would hang at its first restart, so
    it fails at once (each of torchrun's attempts in seconds), naming the line that works, writing nothing."""
    start = time.monotonic()
    line = [*COMMON, "--data", str(data), "--batch-size", str(B), "--out", str(tmp_path / "run")]
    procs, outs = two_nodes(line, restarts="1")
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert time.monotonic() - start < 90
    for _, err in outs:
        assert "error: torchrun may restart this job on 2 nodes (--max-restarts 1) with one store" in err, err[-3000:]
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --rdzv-backend c10d" in err
    assert not (tmp_path / "run").exists()


def test_leaving_the_group_exits_with_the_status_and_flushed_output(tmp_path):
    """A rank ends by leaving the process group and exiting at once (distributed.leave), so gloo's threads never
    meet a finalizing interpreter: the status is the command's, buffered output reaches the pipe, and nothing
    after it runs."""
    script = ("import datetime, torch.distributed as dist\n"
              "from nanoforge.train.distributed import leave\n"
              f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'rdzv'}', rank=0, world_size=1,\n"
              "                        timeout=datetime.timedelta(seconds=60))\n"
              "dist.barrier()\n"
              "print('buffered line')\n"
              "leave(3)\n"
              "print('after leave')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stdout == "buffered line\n"
    no_group = subprocess.run([sys.executable, "-c", "from nanoforge.train.distributed import leave\n"
                               "print(leave(5))"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert no_group.stdout == "5\n", "without a group leave() only returns the status"
