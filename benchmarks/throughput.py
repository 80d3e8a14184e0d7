"""Training throughput of the real loop against a naive fp32 loop: tokens/s, MFU, peak memory.

    .venv/bin/python benchmarks/throughput.py [--preset mini] [--batch-size 4] [--seq-len 512] [--steps 10]

Each configuration runs in its own process, so the peak resident memory (ru_maxrss) is that configuration's
alone. Tokens/s is the median over the timed steps (the first `--warmup` steps are dropped). MFU uses the
PaLM convention, 6 * N + 12 * n_layers * d_model * seq_len FLOPs per trained token (N = parameters outside the
embedding; the tied output projection is counted in the 6N term by the model), divided by the best measured
n x n matmul rate of this machine in the same precision (on CUDA: the datasheet peak, see train/metrics.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from nanoforge.recipes.bench import RandomTokens, naive_loop  # one naive loop, shared with `nanoforge bench`

ROOT = Path(__file__).resolve().parents[1]


class RandomPairs(RandomTokens):
    """Synthetic DPO batches: `batch` pairs = 2 * batch rows, the second half of each row supervised."""

    def next_batch(self):
        import torch
        b = super().next_batch()
        ids = torch.cat([b["input_ids"], b["input_ids"]])  # (2B, T)
        labels = torch.cat([b["labels"], b["labels"]]).clone()
        labels[:, : self.seq // 2] = -100
        return {"input_ids": ids, "labels": labels, "ref_logps": torch.zeros(2 * self.batch)}


def run_ours(preset: str, precision: str, batch: int, seq: int, steps: int, warmup: int, stage: str = "pretrain") -> dict:
    """Our loop on the `stage`'s model and objective: pretrain (plain LM loss), lora (rank 16 on all seven
    projections), dpo (`batch` pairs per step), distill (a teacher of the same preset)."""
    import functools
    import torch
    from nanoforge.core.config import build_config
    from nanoforge.model.gpt import GPT
    from nanoforge.core.device import resolve_device
    from nanoforge.train.loop import Stage, train
    from nanoforge.train.metrics import peak_flops
    from nanoforge.train.objectives import causal_lm_loss, dpo_loss, make_distill_loss

    mcfg, tcfg = build_config(preset, None, {"precision": precision, "batch_size": batch, "seq_len": seq,
                                             "max_steps": warmup + steps, "log_every": 1, "eval_every": 0,
                                             "save_every": 0, "tensorboard": False, "warmup_steps": 1})
    torch.manual_seed(0)
    model = GPT(mcfg)
    source, loss, count = RandomTokens(mcfg.vocab_size, batch, seq), causal_lm_loss, None
    if stage == "lora":
        from nanoforge.model.lora import LoraConfig, LoraModel
        model = LoraModel(model, LoraConfig(rank=16))
    elif stage == "dpo":
        from nanoforge.data.dpo import count_pairs
        source, loss, count = RandomPairs(mcfg.vocab_size, batch, seq), functools.partial(dpo_loss, beta=0.1), count_pairs
    elif stage == "distill":
        teacher = GPT(mcfg).eval().requires_grad_(False)
        loss = make_distill_loss(teacher, 1.5, 0.5)
    with tempfile.TemporaryDirectory() as run_dir:
        train(Stage("bench", source, loss, count_fn=count), model, mcfg, tcfg, run_dir, quiet=True)
        recs = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    tps = statistics.median(r["tokens_per_s"] for r in recs[warmup:])
    peak = peak_flops(resolve_device("auto"), precision)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"tokens_per_s": tps, "mfu": model.flops_per_token(seq) * tps / peak, "peak_flops": peak,
            "params": model.num_params(), "trainable": trainable}


def run_naive(preset: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """What a first training script looks like (nanoforge.recipes.bench.naive_loop): fp32, mean loss, default AdamW."""
    import torch
    from nanoforge.core.config import build_config
    from nanoforge.model.gpt import GPT

    mcfg, _ = build_config(preset)
    torch.manual_seed(0)
    times = []
    naive_loop(GPT(mcfg), RandomTokens(mcfg.vocab_size, batch, seq), warmup + steps, torch.device("cpu"),
               on_step=lambda *t: times.append(sum(t)))
    return {"tokens_per_s": batch * seq / statistics.median(times[warmup:])}


def child(args) -> None:
    import resource
    if args.kind == "naive":
        out = run_naive(args.preset, args.batch_size, args.seq_len, args.steps, args.warmup)
    else:
        out = run_ours(args.preset, args.kind, args.batch_size, args.seq_len, args.steps, args.warmup, args.stage)
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kinds", default="fp32,bf16,naive", help="comma list of fp32, bf16, fp16, naive")
    p.add_argument("--stage", default="pretrain", choices=["pretrain", "lora", "dpo", "distill"],
                   help="objective and trainable set (moe: use --preset mini-moe)")
    p.add_argument("--kind", help=argparse.SUPPRESS)  # set in the child processes
    args = p.parse_args()
    if args.kind:
        return child(args)
    import torch
    print(f"# {args.stage}, {args.preset}, batch {args.batch_size} x {args.seq_len}, median of {args.steps} steps after "
          f"{args.warmup} warm-up, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| loop | precision | tokens/s | MFU | peak RSS | trainable params |")
    print("|---|---|---:|---:|---:|---:|")
    for kind in args.kinds.split(","):
        cmd = [sys.executable, __file__, "--kind", kind, "--preset", args.preset, "--batch-size",
               str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--stage", args.stage]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = next((l for l in res.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"| {kind} | failed: {res.stderr.strip().splitlines()[-1:]} |")
            continue
        r = json.loads(line[7:])
        loop, precision = ("naive (fp32, mean loss, default AdamW)", "fp32") if kind == "naive" else \
            (f"nanoforge {args.stage}", kind)
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        trainable = f"{r['trainable'] / 1e6:.2f}M" if "trainable" in r else "-"
        print(f"| {loop} | {precision} | {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_rss_gb']:.2f} GB | {trainable} |",
              flush=True)


if __name__ == "__main__":
    main()
