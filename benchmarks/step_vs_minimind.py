"""One training step of nanoforge against one of MiniMind's, at the same shape, batch, precision and threads, one
after the other, each in a fresh process; and where each step's time goes (matmul / attention / the rest, and the
top ops under torch.profiler).

    .venv/bin/python benchmarks/step_vs_minimind.py --minimind ../shared/anchors/minimind \\
        --minimind-python ../venvs/minimind/bin/python --model minimind-3 --repeat 3

Sides, alternated `--repeat` times:
- `loop`:     nanoforge's real training loop (`nanoforge bench`: its medians over --steps after --warmup);
- `ours`:     nanoforge's model and step as the loop runs it (autocast at --precision, causal_lm_loss, backward,
              clip 1.0, the fused AdamW of train/optim.py), timed by hand like the MiniMind side;
- `minimind`: MiniMind's own `MiniMindForCausalLM` (imported from --minimind, unmodified, in its own venv) with
              the step of its trainer/train_pretrain.py: loss + aux_loss, backward, clip 1.0, torch.optim.AdamW's
              default, zero_grad. fp32 and MiniMind-3 only: MiniMind's autocast is CUDA-only.
Prints the medians and the ratios, and writes --json. The MiniMind side runs in its own interpreter, so this file
imports nanoforge only on the nanoforge sides.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# our preset for each model; MiniMind's own config only for MiniMind-3 (the older 26M, our `mini`, is not a config of
# MiniMind's current model code: that has QK-norm and 4 KV heads at any width)
SHAPES = {"minimind-3": dict(preset="minimind-3", hidden_size=768), "mini": dict(preset="mini")}
def time_steps(step, steps: int, warmup: int, profile_one: bool) -> dict:
    """Median wall time of `steps` calls after `warmup`, and (optionally) one more under the profiler."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    out = {"step_s": statistics.median(times), "steps_s": times}
    if profile_one:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        from nanoforge.train.metrics import op_split  # on PYTHONPATH in both venvs: it needs only torch
        out.update(op_split(prof))
        top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        out["top_ops"] = [(e.key, round(e.self_cpu_time_total / 1000, 1), e.count) for e in top]
    return out


def side_minimind(args) -> dict:
    """MiniMind's model and its train_pretrain.py step (fp32, default AdamW), on random tokens."""
    sys.path.insert(0, str(Path(args.minimind).resolve()))
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=SHAPES[args.model]["hidden_size"], num_hidden_layers=8,
                                               use_moe=False)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def step():
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen)
        res = model(ids, labels=ids)
        (res.loss + res.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    # MiniMind's labels shift inside the model: seq_len - 1 predicted tokens per row
    out = time_steps(step, args.steps, args.warmup, args.profile)
    return {**out, "tokens_per_step": args.batch_size * (args.seq_len - 1),
            "params": sum(p.numel() for p in model.parameters())}


def side_ours(args) -> dict:
    """nanoforge's model and step, as train/loop.py runs it (without its logging, guards and data path)."""
    from nanoforge.core.config import build_config
    from nanoforge.core.device import keep_freed_memory
    from nanoforge.model.gpt import GPT
    from nanoforge.recipes.bench import loop_step

    keep_freed_memory()  # as the loop does on a CPU
    mcfg, tcfg = build_config(SHAPES[args.model]["preset"], None, {"batch_size": args.batch_size, "device": "cpu",
                                                                  "seq_len": args.seq_len, "precision": args.precision})
    torch.manual_seed(0)
    model = GPT(mcfg).train()
    out = time_steps(loop_step(model, mcfg, tcfg, torch.device("cpu")), args.steps, args.warmup, args.profile)
    return {**out, "tokens_per_step": args.batch_size * args.seq_len, "params": model.num_params()}


def side_loop(args) -> dict:
    """`nanoforge bench`: the real loop (data, logging, guards included); its medians."""
    from nanoforge.recipes.bench import run_bench

    overrides = {"batch_size": args.batch_size, "seq_len": args.seq_len, "precision": args.precision}
    res = run_bench(SHAPES[args.model]["preset"], None, overrides, steps=args.steps, warmup=args.warmup,
                    log=lambda *a: None)["ours"]
    return {"step_s": res["step_ms"] / 1000, "tokens_per_step": res["tokens_per_step"], "params": res["params"]}


def run_side(args, side: str) -> dict:
    python = args.minimind_python if side == "minimind" else sys.executable
    cmd = [python, __file__, "--side", side, "--model", args.model, "--precision", args.precision,
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--minimind", args.minimind] + (["--profile"] if args.profile else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.exit(f"the {side} side failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    res["tokens_per_s"] = res["tokens_per_step"] / res["step_s"]
    return res


def report(runs: dict[str, list[dict]], args) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"\n{args.model}, {args.precision}, batch {args.batch_size} x {args.seq_len}, {args.threads} threads, "
          f"torch {torch.__version__}, CPU: {cpu}; medians of {args.repeat}")
    summary = {"cpu": cpu, "model": args.model, "precision": args.precision, "threads": args.threads,
               "batch": [args.batch_size, args.seq_len], "torch": torch.__version__, "sides": {}}
    for side, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        row = {"tokens_per_s": tps, "all": [round(r["tokens_per_s"], 1) for r in rs], "params": rs[0]["params"]}
        for key in ("matmul_ms", "attention_ms", "rest_ms"):
            if key in rs[0]:
                row[key] = statistics.median(r[key] for r in rs)
        row["top_ops"] = rs[-1].get("top_ops")
        summary["sides"][side] = row
        split = "" if "matmul_ms" not in row else (f"  matmul {row['matmul_ms']:.0f} ms, attention "
                                                   f"{row['attention_ms']:.0f} ms, rest {row['rest_ms']:.0f} ms")
        print(f"  {side:9s} {tps:8.1f} tok/s  {row['all']}{split}")
    if "minimind" in runs:
        base = summary["sides"]["minimind"]["tokens_per_s"]
        for side in runs:
            if side != "minimind":
                print(f"  {side} / minimind: {summary['sides'][side]['tokens_per_s'] / base:.2f}x")
    if args.profile:
        for side, row in summary["sides"].items():
            if row.get("top_ops"):
                print(f"  {side} top ops (self ms, calls): " + "; ".join(f"{k} {t} ({c})" for k, t, c in row["top_ops"]))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="minimind-3")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sides", default="minimind,ours,loop", help="comma-separated: minimind, ours, loop")
    ap.add_argument("--profile", action="store_true", help="one more step under torch.profiler: the split and top ops")
    ap.add_argument("--minimind", default=str(ROOT.parent / "shared/anchors/minimind"))
    ap.add_argument("--minimind-python", default=str(ROOT.parent / "venvs/minimind/bin/python"))
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", args.threads)))
        fn = {"minimind": side_minimind, "ours": side_ours, "loop": side_loop}[args.side]
        print(json.dumps(fn(args)))
        return
    comparable = args.precision == "fp32" and "hidden_size" in SHAPES[args.model]
    sides = [s for s in args.sides.split(",") if s != "minimind" or comparable]
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for i in range(args.repeat):
        for side in sides:
            runs[side].append(run_side(args, side))
            print(f"run {i + 1} {side}: {runs[side][-1]['tokens_per_s']:.1f} tok/s", flush=True)
    summary = report(runs, args)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
