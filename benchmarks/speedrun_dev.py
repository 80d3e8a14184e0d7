"""One speedrun experiment on the DEV split: the training 90% of TinyShakespeare cut again, its first 90% to train
and its last 10% as dev, so hyperparameters are never chosen on the validation bytes (docs/perf.md, "CPU
speedrun").

    benchmarks/speedrun_dev.py --name base --steps 1280
    benchmarks/speedrun_dev.py --name drop01 --steps 2560 --set dropout 0.1 --vocab 4096

The tokenizer and prepared data are made once per vocabulary size under --work and reused. The run is the
speedrun config (configs/speedrun-shakespeare.toml) with --set overrides, OMP_NUM_THREADS=--threads, a fixed
step count; then `nanoforge eval RUN --data DEV` scores every dev token once. Prints one JSON line: dev bpb,
wall time, median ms per step (from metrics.jsonl), final train loss; appended to WORK/results.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speedrun_shakespeare import CONFIG, DEFAULT_DATA, NANOFORGE, QUIET_RUN, flags, run  # noqa: E402


def dev_data(data: Path, work: Path, vocab: int) -> tuple[Path, Path]:
    """(train dir, dev dir) prepared with a `vocab`-token tokenizer trained on the dev split's training part."""
    raw = data.read_bytes()
    train90 = raw[:int(0.9 * len(raw))]
    cut = int(0.9 * len(train90))
    base = work / f"vocab{vocab}"
    train_dir, dev_dir = base / "train_data", base / "dev_data"
    if (dev_dir / "manifest.json").exists():
        return train_dir, dev_dir
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    (base / "train.txt").write_bytes(train90[:cut])
    (base / "dev.txt").write_bytes(train90[cut:])
    run(NANOFORGE + ["tokenizer", "train", "--data", str(base / "train.txt"), "--vocab-size", str(vocab),
                     "--out", str(base / "tok")], "tokenizer training")
    for txt, out in (("train.txt", train_dir), ("dev.txt", dev_dir)):
        run(NANOFORGE + ["prepare", "--kind", "pretrain", "--data", str(base / txt), "--tokenizer",
                         str(base / "tok"), "--out", str(out), "--val-fraction", "0"], f"prepare {txt}")
    return train_dir, dev_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--steps", type=int, default=0, help="fixed max_steps (or --set time-budget S)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--work", type=Path, default=Path("/tmp/speedrun-dev"))
    ap.add_argument("--resume", action="store_true", help="continue the run NAME from its last checkpoint")
    ap.add_argument("--set", nargs=2, action="append", default=[], metavar=("FLAG", "VALUE"))
    args = ap.parse_args()
    train_dir, dev_dir = dev_data(args.data, args.work, args.vocab)
    cfg = {**CONFIG, **QUIET_RUN, **{k.lstrip("-"): v for k, v in args.set}}
    if args.steps:
        cfg["max-steps"] = args.steps
    run_dir = args.work / "runs" / args.name
    if not args.resume:
        shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    wall, peak = run(NANOFORGE + ["pretrain", "--data", str(train_dir), "--out", str(run_dir), "--quiet"]
                     + flags(cfg) + ["--resume"] * args.resume, "pretrain", env)
    out = run_dir / "dev.json"
    run(NANOFORGE + ["eval", str(run_dir), "--data", str(dev_dir), "--json", str(out), "--quiet", "--no-write"],
        "eval", env)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "tokens_per_s" in r]
    row = {"name": args.name, "vocab": args.vocab, "steps": train[-1]["step"] if train else 0,
           "dev_bpb": round(json.loads(out.read_text())["data"]["bpb"], 4), "wall_s": round(wall, 1),
           "ms_per_step": round(1e3 * statistics.median(int(cfg["batch-size"]) * int(cfg["seq-len"]) / r["tokens_per_s"]
                                                         for r in train[1:] or train), 1),
           "train_loss": round(train[-1]["loss"], 3) if train else None, "peak_mb": peak,
           "set": dict(args.set)}
    print(json.dumps(row), flush=True)
    with open(args.work / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
