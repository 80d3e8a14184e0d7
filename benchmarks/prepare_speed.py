"""How fast `prepare` tokenizes pretraining JSONL, and how much memory the whole process tree uses.

    .venv/bin/python benchmarks/prepare_speed.py            # the Chinese pretrain files (~35 MB)
    .venv/bin/python benchmarks/prepare_speed.py --big      # + a ~1 GB file made by repeating them

A vocab-6400 tokenizer is first trained on a sample of the Chinese and English pretrain files; then
prepare_dataset runs, each time in a fresh process as `nanoforge prepare` would, on the Chinese files, the
English files and with --big the repeated file, while a thread samples the resident memory of that process
plus all its worker processes. Also reported: tokenizer compression (UTF-8
bytes per token, eos excluded) on the Chinese and the English pretrain files. Everything is written to a
temporary directory that is deleted at the end. Figures go to docs/perf.md with this command line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from nanoforge.data.prepare import prepare_dataset  # noqa: E402  (no torch import: workers start faster)
from nanoforge.data.sources import train_tokenizer  # noqa: E402

DEFAULT_DATA = Path(os.environ.get("NANOFORGE_DATA", "data")) / "minimind"  # see data_dir.py


class TreeMemory:
    """Peak resident memory of this process and all its descendants, sampled from /proc every 50 ms.

    getrusage cannot give this: RUSAGE_CHILDREN reports the largest single child, not the sum of the workers
    alive at the same time (and on Linux a fork+exec'd child starts from its parent's peak at fork time).
    Summing RSS counts shared library pages once per process, so it errs high.
    """

    def __init__(self, interval: float = 0.05):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_bytes(os.getpid()))
            self._stop.wait(self.interval)


def tree_rss_bytes(root: int) -> int:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(entry))
            except (OSError, IndexError):
                continue  # the process ended while we looked
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
        stack.extend(children.get(pid, []))
    return total


def write_sample(files: list[Path], out: Path, total_bytes: int) -> Path:
    """Every k-th line of each file, about total_bytes in all, spread evenly over the files."""
    per_file = total_bytes // len(files)
    with open(out, "wb") as sink:
        for path in files:
            stride = max(1, path.stat().st_size // per_file)
            with open(path, "rb") as f:
                for i, line in enumerate(f):
                    if i % stride == 0:
                        sink.write(line)
    return out


def write_repeated(files: list[Path], out: Path, target_bytes: int) -> Path:
    written = 0
    with open(out, "wb") as sink:
        while written < target_bytes:
            for path in files:
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, sink, 8 << 20)
                written += path.stat().st_size
    return out


def run_prepare(name: str, files: list[Path], tokenizer_dir: Path, out: Path, workers: int) -> dict:
    """prepare_dataset in a fresh process (as `nanoforge prepare` runs), so that the memory figure is that of
    a prepare run and not of this process, which has just trained a tokenizer."""
    command = [sys.executable, __file__, "--measure", json.dumps(
        {"name": name, "files": [str(f) for f in files], "tokenizer": str(tokenizer_dir), "out": str(out),
         "workers": workers})]
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(spec: dict) -> dict:
    """Runs in the child process: load the tokenizer, prepare, report speed and the process tree's peak RSS."""
    from nanoforge.chat.tokenizer import load_tokenizer

    files = [Path(f) for f in spec["files"]]
    tokenizer = load_tokenizer(spec["tokenizer"])
    baseline = tree_rss_bytes(os.getpid())
    input_bytes = sum(p.stat().st_size for p in files)
    with TreeMemory() as memory:
        started = time.perf_counter()
        manifest = prepare_dataset("pretrain", files, tokenizer, spec["out"], workers=spec["workers"],
                                   log=lambda m: None)
        seconds = time.perf_counter() - started
    splits = manifest["splits"].values()
    tokens, docs = sum(s["tokens"] for s in splits), sum(s["docs"] for s in splits)
    text_bytes = sum(s["bytes"] for s in splits)
    shutil.rmtree(spec["out"])
    return {"input": spec["name"], "files": len(files), "input_mb": round(input_bytes / 1e6, 1), "docs": docs,
            "tokens": tokens, "seconds": round(seconds, 1), "mb_per_s": round(input_bytes / 1e6 / seconds, 2),
            "tokens_per_s": round(tokens / seconds), "peak_tree_rss_mb": round(memory.peak / 1e6),
            "parent_rss_before_mb": round(baseline / 1e6),
            "bytes_per_token": round(text_bytes / (tokens - docs), 3), "workers": manifest["stats"]["workers"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with pretrain_{zh,en}_*.jsonl")
    parser.add_argument("--workers", type=int, default=0, help="prepare workers (0 = one per CPU)")
    parser.add_argument("--vocab-size", type=int, default=6400)
    parser.add_argument("--sample-mb", type=float, default=4.0, help="tokenizer training sample size")
    parser.add_argument("--big", action="store_true", help="also prepare a ~1 GB file of repeated data")
    parser.add_argument("--big-gb", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one run, in a child process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure))), flush=True)
        return

    zh = sorted(args.data.glob("pretrain_zh_*.jsonl"))
    en = sorted(args.data.glob("pretrain_en_*.jsonl"))
    if not zh or not en:
        sys.exit(f"no pretrain_zh_*/pretrain_en_*.jsonl files in {args.data}; pass --data")
    work = Path(tempfile.mkdtemp(prefix="nanoforge-bench-"))
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                          f"Python {platform.python_version()}", "command": " ".join(sys.argv), "runs": []}
    try:
        sample = write_sample(zh + en, work / "sample.jsonl", int(args.sample_mb * 1e6))
        started = time.perf_counter()
        tokenizer = train_tokenizer([sample], vocab_size=args.vocab_size, out_dir=work / "tokenizer")
        results["tokenizer"] = {"vocab_size": tokenizer.vocab_size, "sample_mb": args.sample_mb,
                                "train_seconds": round(time.perf_counter() - started, 1)}
        print(f"tokenizer: vocab {tokenizer.vocab_size}, trained on {args.sample_mb} MB in "
              f"{results['tokenizer']['train_seconds']} s", flush=True)
        runs = [("zh pretrain", zh), ("en pretrain", en)]
        if args.big:
            runs.append((f"zh x{args.big_gb:g} GB", [write_repeated(zh, work / "big.jsonl", int(args.big_gb * 1e9))]))
        for name, files in runs:
            run = run_prepare(name, files, work / "tokenizer", work / "out", args.workers)
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def print_table(results: dict) -> None:
    print(f"\n{results['machine']}; `{results['command']}`")
    print("| input | MB | docs | tokens | s | MB/s | tokens/s | peak RSS, all processes (MB) | bytes/token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results["runs"]:
        print(f"| {r['input']} | {r['input_mb']} | {r['docs']:,} | {r['tokens']:,} | {r['seconds']} | "
              f"{r['mb_per_s']} | {r['tokens_per_s']:,} | {r['peak_tree_rss_mb']} | {r['bytes_per_token']} |")
    print("peak RSS sums the prepare process and its workers (sampled from /proc every 50 ms); "
          "parent RSS before prepare: " + ", ".join(f"{r['parent_rss_before_mb']} MB" for r in results["runs"]))


if __name__ == "__main__":
    main()
