"""Where the time of one training step goes on a CPU: the loop's pieces (autocast forward, causal_lm_loss,
backward, clip, the optimizer step, zero_grad) on the mini model, timed in process CPU time (which time spent
waiting for a shared machine does not count), then one step under torch.profiler sorted by self CPU time.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_step_profile.py [--precision bf16] [--no-profile]
        [--config configs/speedrun-shakespeare.toml]   # another model and batch than the mini preset's

The loop sets device.keep_freed_memory on a CPU; so does this script (as the loop would), unless --malloc-default.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanoforge.core.config import build_config
from nanoforge.core.device import keep_freed_memory
from nanoforge.model.gpt import GPT
from nanoforge.recipes.bench import loop_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--config", help="a TOML config (its model, batch and optimizer) instead of the mini preset")
    ap.add_argument("--batch-size", type=int, help="default: the config's, or 4 for the mini preset")
    ap.add_argument("--seq-len", type=int, help="default: the config's, or 512 for the mini preset")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--malloc-default", action="store_true", help="leave glibc's malloc settings alone")
    args = ap.parse_args()
    if not args.malloc_default:
        keep_freed_memory()
    overrides = {"batch_size": args.batch_size or (None if args.config else 4),
                 "seq_len": args.seq_len or (None if args.config else 512), "precision": args.precision}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    mcfg, tcfg = build_config(None if args.config else "mini", args.config, {**overrides, "device": "cpu"})
    torch.manual_seed(0)
    model = GPT(mcfg).train()
    step = loop_step(model, mcfg, tcfg, torch.device("cpu"))

    for _ in range(2):
        step()
    wall, cpu = [], []
    for _ in range(args.steps):
        t, c = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    print(f"step wall s {[round(x, 3) for x in wall]}, CPU s {[round(x, 3) for x in cpu]}, "
          f"median CPU s {sorted(cpu)[len(cpu) // 2]:.3f}, {torch.get_num_threads()} threads")
    if not args.no_profile:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))


if __name__ == "__main__":
    main()
