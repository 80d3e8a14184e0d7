"""CPU speedrun: validation bits per byte on TinyShakespeare within a training wall-time budget.

    benchmarks/speedrun_shakespeare.sh                       # 3 runs in 50 s each, prints the median
    benchmarks/speedrun_shakespeare.sh --budget 103          # the anchor's time (nanoGPT's CPU recipe)
    benchmarks/speedrun_shakespeare.sh --steps 300 --runs 1  # a fixed number of steps, no calibration

The first int(0.9 * n) bytes of the file are the training text, the rest the validation text (nanoGPT's
split). Steps, each through the ordinary `nanoforge` command line and timed on its own:

1. `nanoforge tokenizer train` on the training text (byte-level BPE, VOCAB tokens);
2. `nanoforge prepare` of the training text and, with the same tokenizer, of the validation text (a .txt file
   is one document);
3. calibration (unless --steps): two short `nanoforge pretrain` runs of the same config (5 and 45 steps)
   measure seconds per step and the fixed cost of a run (start-up, model build, final checkpoint);
   max_steps is then the largest count whose estimated wall time fits 95% of the budget. The loop has no wall-clock budget option, so the step
   count is fixed before the timed run starts, and the timed run is an ordinary fixed-step run;
4. `nanoforge pretrain` with CONFIG and that max_steps, timed as a whole process (Python start-up included):
   this is the training wall time that the budget is about;
5. `nanoforge eval RUN --data VAL` scores every validation token once: bits per byte = total negative
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
DEFAULT_DATA = REPO.parent / "shared" / "data" / "text" / "tinyshakespeare.txt"
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
CALIBRATION_SHORT, CALIBRATION_STEPS = 5, 40  # two calibration runs: 5 and 45 steps


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
    raw = data.read_bytes()
    cut = int(0.9 * len(raw))
    train, val = work / "train.txt", work / "val.txt"
    train.write_bytes(raw[:cut])
    val.write_bytes(raw[cut:])
    return train, val


def calibrate(data_dir: Path, work: Path, budget: float, env: dict) -> tuple[int, float, float]:
    """(max_steps that fit the budget, seconds per step, fixed seconds per run) from the wall times of two
    short runs of the same config, CALIBRATION_STEPS apart: their difference is the cost of those steps with
    every per-step overhead included. (The loop's own tokens/s leaves some of it out: an estimate from it
    made a 50 s run take 66 s; a 12-step median taken while kernels warm up made a 103 s run take 88 s.)"""
    walls = []
    for steps in (CALIBRATION_SHORT, CALIBRATION_SHORT + CALIBRATION_STEPS):
        run_dir = work / "calibrate"
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = {**CONFIG, **QUIET_RUN, "max-steps": steps}
        walls.append(run(NANOFORGE + ["pretrain", "--data", str(data_dir), "--out", str(run_dir), "--quiet"]
                         + flags(cfg), "calibration run", env)[0])
        shutil.rmtree(run_dir, ignore_errors=True)
    per_step = max(1e-3, (walls[1] - walls[0]) / CALIBRATION_STEPS)
    fixed = max(0.0, walls[0] - CALIBRATION_SHORT * per_step)
    # 5% headroom: a long run drifts slower than the short ones (on a busy machine a 457-step run planned at
    # 50 s took 52.6 s)
    return max(1, int((0.95 * budget - fixed) / per_step)), per_step, fixed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the TinyShakespeare text file")
    ap.add_argument("--runs", type=int, default=3, help="timed runs; the median is reported (default 3)")
    ap.add_argument("--budget", type=float, default=50.0, help="training wall-time budget in seconds (50 or 103)")
    ap.add_argument("--steps", type=int, default=0, help="fixed max_steps instead of calibrating to --budget")
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for training (0: torch's default)")
    ap.add_argument("--work", type=Path, default=None, help="keep files here (default: a temporary directory)")
    ap.add_argument("--set", nargs=2, action="append", default=[], metavar=("FLAG", "VALUE"),
                    help="override a config entry, e.g. --set lr 4e-3 (repeatable)")
    args = ap.parse_args()
    for key, value in args.set:
        CONFIG[key.lstrip("-")] = value
    CONFIG["batch-size"], CONFIG["seq-len"] = int(CONFIG["batch-size"]), int(CONFIG["seq-len"])
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
        t_prep_val, _ = run(NANOFORGE + ["prepare", "--kind", "pretrain", "--data", str(val_txt), "--tokenizer",
                                         str(tok), "--out", str(val_dir), "--val-fraction", "0"], "prepare (val)")
        manifest = json.loads((train_dir / "manifest.json").read_text())["splits"]["train"]
        print(f"tokenizer: vocab {VOCAB}, trained in {t_tok:.1f} s; prepare: train {t_prep:.1f} s "
              f"({manifest['tokens']:,} tokens, {manifest['bytes'] / manifest['tokens']:.2f} bytes/token), "
              f"val {t_prep_val:.1f} s")
        if args.steps:
            steps = args.steps
            print(f"max_steps {steps} (fixed by --steps)")
        else:
            steps, per_step, fixed = calibrate(train_dir, work, args.budget, env)
            print(f"calibration: {per_step * 1000:.0f} ms/step, {fixed:.1f} s fixed per run -> max_steps {steps} "
                  f"for a {args.budget:g} s budget")
        tokens_per_step = CONFIG["batch-size"] * CONFIG["seq-len"]
        print(f"config: {' '.join(flags(CONFIG))} --max-steps {steps}  ({tokens_per_step * steps:,} tokens, "
              f"{tokens_per_step * steps / manifest['tokens']:.2f} epochs)")
        results = []
        for i in range(args.runs):
            run_dir = work / f"run{i}"
            shutil.rmtree(run_dir, ignore_errors=True)
            wall, peak_mb = run(NANOFORGE + ["pretrain", "--data", str(train_dir), "--out", str(run_dir), "--quiet"]
                                + flags({**CONFIG, **QUIET_RUN, "max-steps": steps}), "pretrain", env)
            out_json = run_dir / "val.json"
            run(NANOFORGE + ["eval", str(run_dir), "--data", str(val_dir), "--json", str(out_json), "--quiet",
                             "--no-write"], "eval")
            bpb = json.loads(out_json.read_text())["data"]["bpb"]
            results.append((bpb, wall, peak_mb))
            print(f"run {i + 1}/{args.runs}: training wall time {wall:.1f} s, val bpb {bpb:.4f}, "
                  f"peak memory {peak_mb} MB", flush=True)
        bpb, wall, peak = (statistics.median(x) for x in zip(*results))
        print(f"median of {args.runs}: val bpb {bpb:.4f}, training wall time {wall:.1f} s (budget {args.budget:g} s), "
              f"peak memory {peak:.0f} MB; tokenizer {t_tok:.1f} s, prepare {t_prep + t_prep_val:.1f} s")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
