"""CPU speedrun: TinyShakespeare validation bits per byte within a wall-time budget for the whole command.

    benchmarks/speedrun_shakespeare.sh                       # 3 runs of 300 s each, prints the median
    benchmarks/speedrun_shakespeare.sh --runs 1 --budget 120 # a shorter budget
    benchmarks/speedrun_shakespeare.sh --steps 300 --runs 1  # a fixed number of steps, no time budget

The first int(0.9 * n) bytes of the file are the training text, the rest the validation text (nanoGPT's
split). Steps, each through the ordinary `nanoforge` command line and timed on its own:

1. `nanoforge tokenizer train` on the training text (byte-level BPE, VOCAB tokens);
2. `nanoforge prepare` of the training text (a .txt file is one document);
3. `nanoforge pretrain` with CONFIG and `--time-budget`: what is left of --budget after steps 1-2 and the
   pretrain process's own fixed cost (PROCESS_COST: Python start-up, model build, final checkpoint, report),
   so tokenizer + prepare + pretrain fit the budget; the loop ends on time with its lr schedule completed.
   Timed as a whole process. Each run's end-to-end time is steps 1-2 (made once) plus its pretrain time;
4. (not timed: scoring) `nanoforge prepare` of the validation text with the same tokenizer, and
   `nanoforge eval RUN --data VAL`, which scores every validation token once: bits per byte = total negative
   log-likelihood in bits / UTF-8 bytes of the validation text (so any tokenizer is comparable).

Each run prints its times, bits per byte and peak resident memory (of the pretrain process); the last line is
the median over the runs. Hyperparameters were chosen on the last 10% of the TRAINING text, never on the
validation bytes (see docs/perf.md, "CPU speedrun").
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = Path(os.environ.get("NANOFORGE_DATA", "data")) / "text" / "tinyshakespeare.txt"  # see data_dir.py
NANOFORGE = [sys.executable, "-m", "nanoforge"]

VOCAB = 2048
# The model and training config: configs/speedrun-shakespeare.toml, ordinary `nanoforge pretrain` fields chosen
# in the experiments of docs/perf.md, "CPU speedrun". Kept here as flags, so --set can override them.
CONFIG_FILE = REPO / "configs" / "speedrun-shakespeare.toml"


def load_config(path: Path) -> dict:
    import tomllib
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    return {k.replace("_", "-"): (str(v).lower() if isinstance(v, bool) else v)
            for section in ("model", "train") for k, v in cfg.get(section, {}).items()}


CONFIG = load_config(CONFIG_FILE)
# What a speed run does not need: periodic validation, intermediate checkpoints, TensorBoard files.
QUIET_RUN = {"eval-every": 0, "save-every": 0, "tensorboard": "false", "log-every": 10}
PROCESS_COST = 12.0  # seconds of a pretrain process outside its training loop (measured 5-10 s on 2 shared cores)


def run(cmd: list[str], what: str, env: dict | None = None) -> tuple[float, int]:
    """Run a command; return (wall seconds, peak RSS in MB of the process, from wait4)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    out = proc.stdout.read()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{what} failed:\n$ {' '.join(cmd)}\n{out}")
    return seconds, usage.ru_maxrss // 1024


def flags(config: dict) -> list[str]:
    return [x for k, v in config.items() for x in (f"--{k}", str(v))]


def split_text(data: Path, work: Path) -> tuple[Path, Path]:
    if not data.is_file():
        sys.exit(f"error: {data}: no such file; pass --data FILE or set NANOFORGE_DATA to the data folder "
                 f"holding text/tinyshakespeare.txt (TinyShakespeare: the input.txt of Karpathy's char-rnn)")
    raw = data.read_bytes()
    cut = int(0.9 * len(raw))
    train, val = work / "train.txt", work / "val.txt"
    train.write_bytes(raw[:cut])
    val.write_bytes(raw[cut:])
    return train, val


def train_run(run_dir: Path, train_dir: Path, val_dir: Path, extra: dict, env: dict) -> tuple[float, float, int, int]:
    """One timed `nanoforge pretrain` and its (untimed) scoring: (wall s, val bpb, peak MB, steps trained)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    wall, peak_mb = run(NANOFORGE + ["pretrain", "--data", str(train_dir), "--out", str(run_dir), "--quiet"]
                        + flags({**CONFIG, **QUIET_RUN, **extra}), "pretrain", env)
    out_json = run_dir / "val.json"
    run(NANOFORGE + ["eval", str(run_dir), "--data", str(val_dir), "--json", str(out_json), "--quiet", "--no-write"],
        "eval")
    steps = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    return wall, json.loads(out_json.read_text())["data"]["bpb"], peak_mb, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the TinyShakespeare text file")
    ap.add_argument("--runs", type=int, default=3, help="timed runs; the median is reported (default 3)")
    ap.add_argument("--budget", type=float, default=300.0,
                    help="wall-time budget in seconds of tokenizer training + prepare + pretrain (default 300)")
    ap.add_argument("--steps", type=int, default=0, help="fixed max_steps instead of a time budget")
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for training (0: torch's default)")
    ap.add_argument("--work", type=Path, default=None, help="keep files here (default: a temporary directory)")
    ap.add_argument("--set", nargs=2, action="append", default=[], metavar=("FLAG", "VALUE"),
                    help="override a config entry, e.g. --set lr 4e-3 (repeatable)")
    ap.add_argument("--print-config", action="store_true", help="print the pretrain flags as JSON and stop")
    args = ap.parse_args()
    for key, value in args.set:
        CONFIG[key.lstrip("-")] = value
    if args.print_config:
        print(json.dumps(CONFIG))
        return
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="speedrun-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        train_txt, val_txt = split_text(args.data, work)
        print(f"data: {args.data} -> train {train_txt.stat().st_size:,} bytes, val {val_txt.stat().st_size:,} bytes")
        tok, train_dir, val_dir = work / "tokenizer", work / "train_data", work / "val_data"
        for d in (tok, train_dir, val_dir):
            shutil.rmtree(d, ignore_errors=True)
        t_tok, _ = run(NANOFORGE + ["tokenizer", "train", "--data", str(train_txt), "--vocab-size", str(VOCAB),
                                    "--out", str(tok)], "tokenizer training")
        t_prep, _ = run(NANOFORGE + ["prepare", "--kind", "pretrain", "--data", str(train_txt), "--tokenizer",
                                     str(tok), "--out", str(train_dir), "--val-fraction", "0"], "prepare (train)")
        run(NANOFORGE + ["prepare", "--kind", "pretrain", "--data", str(val_txt), "--tokenizer", str(tok), "--out",
                         str(val_dir), "--val-fraction", "0"], "prepare (val, for scoring: not timed)")
        manifest = json.loads((train_dir / "manifest.json").read_text())["splits"]["train"]
        print(f"tokenizer: vocab {VOCAB}, trained in {t_tok:.1f} s; prepare (train) {t_prep:.1f} s "
              f"({manifest['tokens']:,} tokens, {manifest['bytes'] / manifest['tokens']:.2f} bytes/token)")
        budget = round(args.budget - t_tok - t_prep - PROCESS_COST, 1)
        extra = {"max-steps": args.steps} if args.steps else {"max-steps": 10**6, "time-budget": budget}
        print(f"config: {' '.join(flags({**CONFIG, **extra}))}")
        results = []
        for i in range(args.runs):
            wall, bpb, peak_mb, steps = train_run(work / f"run{i}", train_dir, val_dir, extra, env)
            results.append((bpb, t_tok + t_prep + wall, wall, peak_mb, steps))
            print(f"run {i + 1}/{args.runs}: {steps} steps, pretrain wall time {wall:.1f} s, end to end "
                  f"{t_tok + t_prep + wall:.1f} s, val bpb {bpb:.4f}, peak memory {peak_mb} MB", flush=True)
        bpb, total, wall, peak, steps = (statistics.median(x) for x in zip(*results))
        print(f"median of {args.runs}: val bpb {bpb:.4f}, end to end {total:.1f} s (budget {args.budget:g} s; "
              f"pretrain {wall:.1f} s, {steps:.0f} steps), peak memory {peak:.0f} MB; tokenizer {t_tok:.1f} s, "
              f"prepare {t_prep:.1f} s")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
