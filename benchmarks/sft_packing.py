"""SFT packing against padding every row to a fixed length (MiniMind's way): padding share and supervised
tokens per second through the real training loop, measured in one run.

    .venv/bin/python benchmarks/sft_packing.py [--steps 6] [--precision bf16]

Data: $NANOFORGE_DATA/minimind/sft_zh_alpaca_gpt4_demo.jsonl + sft_zh_medical_1k.jsonl (benchmarks/data_dir.py), a 6,400-token tokenizer
trained on those files, the mini preset (26M) at batch 4. "Padded to L" puts one conversation per row, cut at
L tokens, padded to L, with plain causal attention (MiniMind's SFT dataset pads to max_length, 512 in its
sft_mini_512 recipe and 768 by default in its older scripts). "Packed" is nanoforge's SFTBatches: whole
conversations packed into 512-token rows with block-diagonal attention.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
from data_dir import data_path  # benchmarks/data_dir.py: NANOFORGE_DATA

ROOT = Path(__file__).resolve().parents[1]
FILES = ["sft_zh_alpaca_gpt4_demo.jsonl", "sft_zh_medical_1k.jsonl"]


class PaddedRows:
    """One conversation per row, truncated to L and right-padded: the baseline."""

    def __init__(self, shards, batch_size: int, length: int, seed: int = 0, pad_id: int = 0):
        self.shards, self.B, self.L, self.pad_id = shards, batch_size, length, pad_id
        self.offsets = shards.doc_offsets()
        self.order = torch.randperm(shards.num_docs, generator=torch.Generator().manual_seed(seed)).tolist()
        self.i = 0

    def real_fraction(self) -> float:
        lens = np.minimum(np.diff(self.offsets) - 1, self.L)
        return float(lens.mean() / self.L)

    def next_batch(self):
        ids = np.full((self.B, self.L), self.pad_id, dtype=np.int64)
        labels = np.full((self.B, self.L), -100, dtype=np.int64)
        for r in range(self.B):
            d = self.order[self.i % len(self.order)]
            self.i += 1
            start, n = int(self.offsets[d]), int(self.offsets[d + 1] - self.offsets[d])
            n = min(n, self.L + 1)
            tok = self.shards.read(start, n).astype(np.int64)
            mask = self.shards.read_mask(start, n).astype(bool)
            ids[r, :n - 1] = tok[:-1]
            labels[r, :n - 1] = np.where(mask[1:], tok[1:], -100)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, s):
        self.i = s["i"]


def measure(source, seq_len: int, steps: int, warmup: int, precision: str) -> dict:
    from nanoforge.core.config import build_config
    from nanoforge.model.gpt import GPT
    from nanoforge.train.loop import Stage, train
    from nanoforge.train.objectives import causal_lm_loss

    mcfg, tcfg = build_config("mini", None, {"precision": precision, "batch_size": source_batch(source),
                                             "seq_len": seq_len, "max_seq_len": 768, "max_steps": warmup + steps,
                                             "log_every": 1, "eval_every": 0, "save_every": 0,
                                             "tensorboard": False, "warmup_steps": 1})
    torch.manual_seed(0)
    model = GPT(mcfg)
    with tempfile.TemporaryDirectory() as run_dir:
        train(Stage("bench", source, causal_lm_loss), model, mcfg, tcfg, run_dir, quiet=True)
        recs = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()][warmup:]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs),
            "supervised_per_s": statistics.median(r["supervised_tokens_per_s"] for r in recs)}


def source_batch(source) -> int:
    return getattr(source, "batch_size", getattr(source, "B", 4))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--precision", default="bf16")
    args = p.parse_args()

    from nanoforge.data.batches import SFTBatches
    from nanoforge.data.prepare import prepare_dataset
    from nanoforge.data.shards import TokenShards
    from nanoforge.data.sources import train_tokenizer

    files = [data_path(f"minimind/{f}") for f in FILES]
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer(files, vocab_size=6400, out_dir=Path(tmp) / "tok")
        prepare_dataset("sft", files, tok, Path(tmp) / "sft", val_fraction=0.0, log=lambda *a: None)
        shards = TokenShards(Path(tmp) / "sft", "train")
        lens = np.diff(shards.doc_offsets())
        packed = SFTBatches(shards, args.batch_size, 512, seed=0, pad_id=tok.pad_id)
        pad512 = PaddedRows(shards, args.batch_size, 512, pad_id=tok.pad_id)
        pad768 = PaddedRows(shards, args.batch_size, 768, pad_id=tok.pad_id)
        print(f"# {len(lens):,} conversations, {lens.sum():,} tokens; length median {int(np.median(lens))}, "
              f"p90 {int(np.percentile(lens, 90))}, max {lens.max()}; {packed.report.summary(512)}")
        print(f"# mini preset, batch {args.batch_size}, {args.precision}, median of {args.steps} steps after "
              f"{args.warmup} warm-up, torch {torch.__version__}, {torch.get_num_threads()} threads")
        rows = [("packed into 512 (nanoforge)", packed, 512, 1 - packed.report.padding_fraction),
                ("padded to 512", pad512, 512, pad512.real_fraction()),
                ("padded to 768", pad768, 768, pad768.real_fraction())]
        results = []
        for name, source, seq_len, real in rows:
            r = measure(source, seq_len, args.steps, args.warmup, args.precision)
            results.append((name, real, r))
        base = {name: r["supervised_per_s"] for name, _, r in results}
        print("| rows | real tokens | padding | tokens/s computed | supervised tokens/s | packed speed-up |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, real, r in results:
            speedup = base["packed into 512 (nanoforge)"] / r["supervised_per_s"]
            print(f"| {name} | {100 * real:.1f}% | {100 * (1 - real):.1f}% | {r['tokens_per_s']:,.0f} | "
                  f"{r['supervised_per_s']:,.0f} | {speedup:.2f}x |")


if __name__ == "__main__":
    main()
