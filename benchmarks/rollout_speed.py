"""Rollout speed: all P x G replies of an RL step generated at once (one batched KV-cache decode, as
nanoforge/rl/rollout.py does) against generating them one sequence at a time.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rollout_speed.py [--preset demo] [--rollouts 2x6,8x8]
                                                                    [--prompt-len 32] [--new-tokens 64]

Random weights (speed does not depend on what they say), temperature 0.8 as the RL stage samples, no stop
token, so every reply is exactly --new-tokens long. Median of --repeats runs after a warm-up, reported as
generated tokens per second.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from nanoforge.core.config import build_config  # noqa: E402
from nanoforge.infer.generate import SamplingConfig, generate  # noqa: E402
from nanoforge.model.gpt import GPT  # noqa: E402


def seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--rollouts", default="2x6,8x8", help="P x G shapes, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    mcfg, _ = build_config(args.preset)
    torch.manual_seed(0)
    model = GPT(mcfg).eval()
    cfg = SamplingConfig(temperature=0.8, max_new_tokens=args.new_tokens, seed=0)
    print(f"preset {args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), prompts of "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens each, {torch.get_num_threads()} threads")
    print("| P x G | replies | batched tokens/s | one at a time tokens/s | speed-up |")
    print("|---|---|---|---|---|")
    for shape in args.rollouts.split(","):
        P, G = (int(x) for x in shape.split("x"))
        prompts = [torch.randint(0, mcfg.vocab_size, (args.prompt_len,)).tolist() for _ in range(P)]
        rows = [p for p in prompts for _ in range(G)]
        tokens = len(rows) * args.new_tokens
        batched = seconds(lambda: generate(model, rows, cfg), args.repeats)  # noqa: B023 (timed at once)
        single = seconds(lambda: [generate(model, [r], cfg) for r in rows], args.repeats)  # noqa: B023
        print(f"| {P} x {G} | {len(rows)} | {tokens / batched:,.0f} | {tokens / single:,.0f} | "
              f"{single / batched:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
