"""`nanoforge bench` and benchmarks/gpu.sh as a user runs them: real processes, the real loop, real numbers.
Timings on a shared CPU are noise, so nothing here asserts a speed; only that every figure is there, positive
and consistent."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoforge.core.device import cpu_info, precision_note

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    r = subprocess.run([sys.executable, "-m", "nanoforge", "bench", "--preset", "tiny", "--device", "cpu",
                        "--precision", "bf16", "--batch-size", "2", "--micro-batch", "1", "--seq-len", "32", "--steps", "3", "--warmup",
                        "1", "--compare-naive", "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout, json.loads(out.read_text())


def test_bench_table_has_every_field(bench_run):
    text, _ = bench_run
    for field in ("tokens/s", "MFU", "peak memory", "step time", "data", "forward+backward", "optimizer",
                  "nanoforge", "naive fp32", "ours / naive", "6N + 12 L h s", "measured CPU matmul peak"):
        assert field in text, field
    assert "micro-batch 1 x 32 x grad-accum 2" in text  # --micro-batch splits the global batch of 2
    assert re.search(r"\| tokens/s \| [\d,]+ \| [\d,]+ \| [\d.]+x \|", text), text
    # the precision it used and why: the CPU's model and whether it computes bf16 natively (a warning if not)
    assert precision_note("bf16", torch.device("cpu")) in text.splitlines()
    assert f"this CPU ({cpu_info()[0]}) has " in text
    split = re.search(r"Split of one more step .*: matmuls ([\d,]+) ms \((\d+)%\) at ([\d,]+) GFLOP/s, (\d+)% of the "
                      r"peak, attention ([\d,]+) ms \((\d+)%\), the rest ([\d,]+) ms \((\d+)%\)\.", text)
    assert split, text
    assert 98 <= sum(int(split.group(i)) for i in (2, 6, 8)) <= 102  # the three shares are of one total


def test_bench_json_numbers_are_positive_and_the_split_adds_up(bench_run):
    _, res = bench_run
    assert res["config"]["train"]["batch_size"] == 2 and res["steps"] == 3
    assert (res["ours"]["batch_size"], res["ours"]["grad_accum"]) == (1, 2)
    assert res["ours"]["tokens_per_step"] == 2 * 32 and res["naive"]["tokens_per_step"] == 32  # naive: no accumulation
    for kind in ("ours", "naive"):
        r = res[kind]
        for key in ("tokens_per_s", "mfu", "peak_flops", "peak_memory_gb", "step_ms", "flops_per_token"):
            assert r[key] > 0, (kind, key)
        assert r["tokens_per_s"] == pytest.approx(1000 * r["tokens_per_step"] / r["step_ms"])
        # Each phase is part of every step, so its median cannot exceed the median step (x_k <= y_k for every
        # step k gives median(x) <= median(y)), however loaded the machine is; ms against s would break it.
        # How close the parts' sum comes to the whole is a timing, which tests do not assert.
        for phase in ("data_ms", "fwd_bwd_ms", "optim_ms"):
            assert 0 <= r[phase] <= r["step_ms"] * (1 + 1e-9), (kind, phase, r[phase], r["step_ms"])
        assert r["fwd_bwd_ms"] > 0 and r["optim_ms"] > 0, kind
    # the profiled step's split: every kind of work is there (a tiny model's matmuls, SDPA, and the rest)
    for key in ("matmul_ms", "attention_ms", "rest_ms", "matmul_flops_per_s"):
        assert res["ours"][key] > 0, key
    assert res["ours"]["precision"] == "bf16" and res["naive"]["precision"] == "fp32"
    assert "measured CPU matmul peak" in res["ours"]["peak_source"]


def test_bench_rejects_bad_arguments():
    r = subprocess.run([sys.executable, "-m", "nanoforge", "bench", "--preset", "tiny", "--steps", "0"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "argument --steps: 0 must be >= 1" in r.stderr


def test_gpu_script_smoke_mode(tmp_path):
    """benchmarks/gpu.sh --smoke runs the same script path on the CPU with the tiny preset, so it cannot rot."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--smoke"], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| tiny-bf16-eager | 4 x 64 |" in r.stdout
    assert re.search(r"projected one epoch, tiny at [\d,]+ tokens/s: pretrain 1.2 GB .* SFT 1.6 GB .* = [\d.]+ min",
                     r.stdout), r.stdout
    res = json.loads((tmp_path / "tiny-bf16-eager.json").read_text())
    assert res["ours"]["tokens_per_s"] > 0 and res["ours"]["mfu"] > 0


@pytest.mark.slow
def test_gpu_paths_script_runs_every_check_on_the_cpu(tmp_path):
    """benchmarks/gpu_paths.py (the CUDA paths, for a GPU machine) runs its checks on the CPU too: the
    non-finite rollback, exact resume, fp16, the micro-batch probe, packed SFT, decoding, torchrun."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_paths.py"), "--device", "cpu",
                        "--skip-compile", "--work", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "8/8 paths passed on cpu" in r.stdout
    assert "rollbacks 1, skipped 3" in r.stdout and "resumed losses within 0.0e+00" in r.stdout
