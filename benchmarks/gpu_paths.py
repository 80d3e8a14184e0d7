"""Every CUDA-only path of the training and inference code, run once for real on a GPU (a few minutes).

The test suite runs on CPU; on a GPU the loop takes other branches: pinned-memory copies, the sync-free
non-finite guard read only at logging steps, the CUDA RNG in checkpoints, the CUDA `--micro-batch auto` probe,
fp16 with its gradient scaler, TF32, `torch.compile` with CUDA graphs off, SDPA kernels with GQA and masks,
NCCL under torchrun, the bf16 KV cache. Each check below is a real `nanoforge` command on the tiny preset,
then a look at what it wrote. benchmarks/gpu.sh runs this first; `--device cpu` runs the same script on
the CPU (tests/test_bench.py does, so it cannot rot).

    .venv/bin/python benchmarks/gpu_paths.py                 # on the GPU machine
    .venv/bin/python benchmarks/gpu_paths.py --device cpu    # the same checks on the CPU
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("NANOFORGE_DATA", "data")) / "tiny"  # see data_dir.py
TINY = ["--preset", "tiny", "--seq-len", "64", "--tensorboard", "false", "--log-every", "5", "--eval-every", "10",
        "--quiet"]


def nanoforge(args: list[str], work: Path, launcher: list[str] | None = None, stdin: str | None = None,
              timeout: int = 600, inject_nonfinite: str = "") -> subprocess.CompletedProcess:
    cmd = (launcher or [sys.executable, "-m"]) + ["nanoforge", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "NANOFORGE_INJECT_NONFINITE": inject_nonfinite}
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, input=stdin, timeout=timeout)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records(run) if "loss" in r]


def run_state(run: Path) -> dict:
    last = sorted((run / "checkpoints").glob("step_*"))[-1]
    return json.loads((last / "state.json").read_text())["run_state"]


def corpus(work: Path) -> tuple[Path, Path]:
    """Pretraining text and SFT conversations: the shared tiny fixtures, or a few written here."""
    if SHARED.is_dir():
        return SHARED / "pretrain_tiny.jsonl", SHARED / "sft_tiny.jsonl"
    pre, sft = work / "pre.jsonl", work / "sft.jsonl"
    lines = [f"The {w} sat by the river number {i} and watched the water go by." for i in range(400)
             for w in ("cat", "dog")]
    pre.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    sft.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                                         {"role": "assistant", "content": f"It is {2 * i}."}]})
                           + "\n" for i in range(300)))
    return pre, sft


class Paths:
    """The checks, each a real `nanoforge` command on the tiny preset, then a look at what it wrote in `work`."""

    def __init__(self, work: Path, device: str):
        self.work, self.device, self.dev = work, device, ["--device", device]
        self.pre_text, self.sft_text = corpus(work)

    def ok(self, args: list[str], **kw) -> subprocess.CompletedProcess:
        proc = nanoforge(args, self.work, **kw)
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}")
        return proc

    def prepare(self) -> str:
        self.ok(["tokenizer", "train", "--data", str(self.pre_text), str(self.sft_text), "--vocab-size", "512",
                 "--out", "tok"])
        for kind, text, out in (("pretrain", self.pre_text, "pre"), ("sft", self.sft_text, "sft")):
            self.ok(["prepare", "--kind", kind, "--data", str(text), "--tokenizer", "tok", "--out", out,
                     "--val-fraction", "0.1"])
        return ""

    def bf16_guard(self) -> str:
        # loss@4..6 non-finite: three skips in a row roll back to step 3's checkpoint; on CUDA with fused AdamW
        # the skip happens on the device and the host reads the counters only at logging/saving steps
        self.ok(["pretrain", "--data", "pre", "--out", "bf16", *TINY, *self.dev, "--precision", "bf16",
                 "--max-steps", "20", "--save-every", "3"], inject_nonfinite="loss@4,loss@5,loss@6")
        st = run_state(self.work / "bf16")
        assert st["rollbacks"] == 1 and st["skipped_steps"] == 3, st
        peak = max(r.get("peak_mem_gb", 0) for r in records(self.work / "bf16"))
        assert peak > 0, "no peak memory logged"
        return f"rollbacks {st['rollbacks']}, skipped {st['skipped_steps']}, peak {peak:.3f} GB"

    def resume(self) -> str:
        for out, steps in (("straight", "20"), ("halves", "10")):
            self.ok(["pretrain", "--data", "pre", "--out", out, *TINY, *self.dev, "--max-steps", steps,
                     "--save-every", "10", "--dropout", "0.1"])
        self.ok(["pretrain", "--out", "halves", "--resume", "--max-steps", "20", "--quiet"])
        a, b = losses(self.work / "straight"), losses(self.work / "halves")
        worst = max(abs(x - y) / abs(x) for (_, x), (_, y) in zip(a, b))
        assert [s for s, _ in a] == [s for s, _ in b] and worst < 1e-3, (a, b)
        return f"resumed losses within {worst:.1e} (relative) of the straight run"

    def fp16(self) -> str:
        self.ok(["pretrain", "--data", "pre", "--out", "fp16", *TINY, *self.dev, "--precision", "fp16",
                 "--max-steps", "10"])
        last = losses(self.work / "fp16")[-1][1]
        assert last == last and last < 20, last
        return f"final loss {last:.3f}"

    def micro_auto(self) -> str:
        proc = self.ok(["pretrain", "--data", "pre", "--out", "auto", *TINY[:-1], *self.dev, "--batch-size", "64",
                        "--micro-batch", "auto", "--max-steps", "3"])
        said = next((line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "micro-batch" in line),
                    "")
        assert "global batch 64" in said, proc.stdout[-500:] + proc.stderr[-500:]
        return said[:160]

    def compiled(self) -> str:
        self.ok(["pretrain", "--data", "pre", "--out", "compiled", *TINY, *self.dev, "--compile", "true",
                 "--max-steps", "10"])
        return f"final loss {losses(self.work / 'compiled')[-1][1]:.3f}"

    def sft_packed(self) -> str:
        self.ok(["sft", "--init", "bf16", "--data", "sft", "--out", "sftrun", "--seq-len", "128", *self.dev,
                 "--max-steps", "10", "--eval-every", "10", "--tensorboard", "false", "--quiet"])
        val = [r["val_loss"] for r in records(self.work / "sftrun") if "val_loss" in r]
        assert val and val[-1] == val[-1], val
        return f"val loss {val[-1]:.3f} (packed rows: block-diagonal mask with GQA)"

    def decode(self) -> str:
        proc = self.ok(["generate", "sftrun", "--prompt", "The cat", "--max-new-tokens", "16", "--seed", "0",
                        *self.dev])
        chat = self.ok(["chat", "sftrun", "--max-new-tokens", "16", "--seed", "0", *self.dev], stdin="hi\n")
        assert proc.stdout.startswith("The cat"), proc.stdout
        return f"generate: {proc.stdout.strip()[:50]!r}; chat: {chat.stdout.strip()[:30]!r}"

    def torchrun(self) -> str:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m"]
        self.ok(["pretrain", "--data", "pre", "--out", "ddp", *TINY, *self.dev, "--max-steps", "5"],
                launcher=launcher)
        backend = "NCCL" if self.device.startswith("cuda") else "gloo"
        return f"{backend}, 1 process, final loss {losses(self.work / 'ddp')[-1][1]:.3f}"


CHECKS = [("prepare tiny data", "prepare"), ("bf16 pretrain, non-finite guard and rollback", "bf16_guard"),
          ("exact resume (CUDA RNG in the checkpoint)", "resume"), ("fp16 with the gradient scaler", "fp16"),
          ("--micro-batch auto probe", "micro_auto"), ("--compile", "compiled"), ("SFT on packed rows", "sft_packed"),
          ("generate and chat (KV cache)", "decode"), ("torchrun (DDP)", "torchrun")]


def check(name: str, fn) -> bool:
    """Run one check; a failing path must not hide the others."""
    t0 = time.perf_counter()
    try:
        detail, ok = fn() or "", True
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    print(f"{'PASS' if ok else 'FAIL'}  {name}  ({time.perf_counter() - t0:.1f} s)  {detail}"[:400], flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--work", type=Path, help="keep the runs here (default: a temporary directory, removed after)")
    ap.add_argument("--skip-compile", action="store_true", help="leave out the --compile check (slow on a CPU)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="nanoforge-gpu-paths-"))
    work.mkdir(parents=True, exist_ok=True)
    paths = Paths(work, args.device)
    results = [check(name, getattr(paths, method)) for name, method in CHECKS
               if not (method == "compiled" and args.skip_compile)]
    passed = sum(results)
    if args.work is None and passed == len(results):
        shutil.rmtree(work, ignore_errors=True)
        where = "(runs removed)"
    else:
        where = f"runs in {work}"
    print(f"\n{passed}/{len(results)} paths passed on {args.device}; {where}")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
