"""Rollout speed with replies of mixed length: the engine (continuous batching: a reply that ends leaves the batch,
a group's prompt is read once) against a static batch (every row decodes until the longest reply is done, as
nanoforge's rollouts did before the engine).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rollout_speed.py [--preset demo] [--rollouts 2x6,8x8]
                                          [--prompt-len 32] [--min-tokens 16] [--max-tokens 256] [--repeats 3]

Random weights (speed does not depend on what they say), temperature 0.8 as the RL stage samples. Each reply's
length is drawn from [--min-tokens, --max-tokens] (seeded): a reply that stops there. The static batch is the
same engine with every row run to the longest length, its extra tokens thrown away, which is the work the old
static batch did. (Each reply is a request of its own here, to give it its own length: a group's prompt is
read G times, which at --prompt-len 32 is a small share of the work.) Reported: useful (kept) tokens per second, median of --repeats runs after a warm-up, and the
share of decode row-steps that produce a kept token."""
import argparse
import random
import statistics
import time

import torch

from nanoforge.core.config import build_config
from nanoforge.core.device import cpu_info
from nanoforge.infer.options import SamplingConfig
from nanoforge.infer.engine import Engine, Request
from nanoforge.model.gpt import GPT


def run(model, prompts: list[list[int]], lengths: list[int], group: int, static: bool) -> tuple[float, int, int]:
    """(seconds, kept tokens, row-steps) of one rollout: each prompt sampled `group` times."""
    longest = max(lengths)
    rows = [p for p in prompts for _ in range(group)]
    requests = [Request(p, SamplingConfig(temperature=0.8, max_new_tokens=longest if static else n, seed=i))
                for i, (p, n) in enumerate(zip(rows, lengths))]
    engine = Engine(model, max_batch=len(rows))
    start = time.perf_counter()
    seqs = [engine.submit(r)[0] for r in requests]
    row_steps = 0
    while engine.busy:
        row_steps += len(engine.step())
    seconds = time.perf_counter() - start
    kept = sum(min(n, len(seq.new_ids)) for n, seq in zip(lengths, seqs))  # the context may cut a reply short
    return seconds, kept, row_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--rollouts", default="2x6,8x8", help="P x G shapes, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    mcfg, _ = build_config(args.preset)
    torch.manual_seed(0)
    model = GPT(mcfg).eval()
    print(f"{cpu_info()[0]}; preset {args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters), prompts of {args.prompt_len} tokens, replies of {args.min_tokens}-{args.max_tokens} "
          f"tokens, {torch.get_num_threads()} threads, median of {args.repeats}")
    print("| P x G | replies | engine kept tok/s | static kept tok/s | speed-up | kept share: engine | static |")
    print("|---|---|---|---|---|---|---|")
    rng = random.Random(0)
    for shape in args.rollouts.split(","):
        P, G = (int(x) for x in shape.split("x"))
        prompts = [[rng.randrange(mcfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(P)]
        lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(P * G)]
        figures = {}
        for static in (False, True):
            run(model, prompts, lengths, G, static)  # warm-up
            runs = [run(model, prompts, lengths, G, static) for _ in range(args.repeats)]
            seconds = statistics.median(r[0] for r in runs)
            figures[static] = (runs[0][1] / seconds, runs[0][1] / runs[0][2])
        (engine, engine_share), (static, static_share) = figures[False], figures[True]
        print(f"| {P} x {G} | {P * G} | {engine:,.0f} | {static:,.0f} | {engine / static:.2f}x | "
              f"{engine_share:.0%} | {static_share:.0%} |", flush=True)


if __name__ == "__main__":
    main()
