"""Does training wait on data under torchrun? The loop's own per-step split (`data_ms`, `fwd_bwd_ms`,
`optim_ms` in metrics.jsonl) for `torchrun --nproc-per-node 2` reading prepared shards, against one process.

    .venv/bin/python benchmarks/data_wait.py            # tinystories prepared with MiniMind's tokenizer
    .venv/bin/python benchmarks/data_wait.py --steps 60

The data ($NANOFORGE_DATA/minimind/pretrain_en_tinystories.jsonl, MiniMind's 6400-token tokenizer) is prepared
into a temporary directory; then each configuration trains `--steps` steps of the tiny preset on the CPU with
gloo and rank 0's metrics are read back (the first logged window, which holds start-up, is dropped). "cold"
runs first evict the shards from the page cache (posix_fadvise DONTNEED on each file, no root needed), so the
windows are read from the disk as from storage that caches nothing. Figures go to docs/perf.md with this
command line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from nanoforge.data.prepare import prepare_dataset  # noqa: E402

from data_dir import data_path  # noqa: E402  (benchmarks/data_dir.py: NANOFORGE_DATA)



def evict(directory: Path) -> None:
    """Drop the shards' pages from the page cache, so the next reads go to the disk."""
    for path in directory.glob("*.bin"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def train(data: Path, out: Path, nproc: int, batch: int, steps: int, seq_len: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                if nproc > 1 else [sys.executable])
    cmd = launcher + ["-m", "nanoforge", "pretrain", "--preset", "tiny", "--data", str(data), "--out", str(out),
                      "--batch-size", str(batch), "--seq-len", str(seq_len), "--max-seq-len", str(seq_len),
                      "--max-steps", str(steps),
                      "--log-every", "5", "--eval-every", "0", "--save-every", "0", "--tensorboard", "false",
                      "--precision", "fp32", "--device", "cpu", "--quiet"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)}\nfailed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "data_ms" in r]
    med = {k: statistics.median(r[f"{k}_ms"] for r in windows[1:])  # the first window holds start-up
           for k in ("data", "fwd_bwd", "optim")}
    first_data = windows[0]["data_ms"]
    med["step"] = sum(med.values())
    med["share"] = med["data"] / med["step"]
    med["bytes_per_step"] = batch * (seq_len + 1) * 2  # one rank's uint16 tokens per step
    med["first_data"] = first_data
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    source = data_path("minimind/pretrain_en_tinystories.jsonl")
    with tempfile.TemporaryDirectory(prefix="nanoforge-data-wait-") as tmp:
        data = Path(tmp) / "data"
        prepare_dataset("pretrain", [source], data_path("minimind-tokenizer"), data, workers=1, log=lambda *a: None)
        print(f"{args.steps} steps, tiny preset, seq_len {args.seq_len}, fp32, CPU, gloo; medians of rank 0's "
              "5-step windows\n")
        print("| processes | batch / rank | cache | data ms (first 5 steps) | data ms | fwd+bwd ms | optim ms |"
              " step ms | data share | bytes / rank / step |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for nproc, batch, cache in ((1, 8, "warm"), (2, 4, "warm"), (2, 4, "cold"), (2, 16, "cold")):
            if cache == "cold":
                evict(data)
            m = train(data, Path(tmp) / f"run-{nproc}-{batch}-{cache}", nproc, batch, args.steps, args.seq_len)
            print(f"| {nproc} | {batch} | {cache} | {m['first_data']:.2f} | {m['data']:.2f} | {m['fwd_bwd']:.1f} | {m['optim']:.1f} | "
                  f"{m['step']:.1f} | {m['share']:.1%} | {m['bytes_per_step']:,} |", flush=True)


if __name__ == "__main__":
    main()
