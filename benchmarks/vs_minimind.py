"""nanoforge against MiniMind's own trainers: the same JSONL, tokenizer, model and recipe, one
after the other on the same threads, each for the same wall-time budget, both scored by `nanoforge eval` on the
same held-out records.

    .venv/bin/python benchmarks/vs_minimind.py --minimind ../shared/anchors/minimind \\
        --minimind-python MINIMIND_VENV/bin/python --model minimind-3 --budget 300 --threads 1

Per model (MiniMind-3: hidden 768; minimind2-small: MiniMind's config at hidden_size=512, which is MiniMind-3's
layout at width 512: 8 heads of 64, 4 KV heads, SwiGLU ceil(512 pi / 64) 64 = 1664, QK-norm, RoPE 1e6, eps 1e-6)
and per stage:

- pretrain: every `pretrain_*.jsonl` of DATA/minimind/, MiniMind's trainer/train_pretrain.py against
  `nanoforge pretrain`, both from random weights;
- sft: every `sft_*.jsonl`, MiniMind's trainer/train_full_sft.py against `nanoforge sft`, BOTH starting from the
  .pth MiniMind's own pretraining wrote in the pretrain stage (nanoforge reads it with --init FILE.pth --tokenizer).

The held-out records are the ones `nanoforge prepare --val-fraction F` puts in its validation split (record i
when floor((i+1) F) > floor(i F)); the script writes the records that are left to the file MiniMind trains on, and
checks that nanoforge's validation split holds exactly the held-out records (their count, and for pretraining
their tokens). nanoforge validates on all of them during training (its metrics.jsonl val_loss records give the
curve); after both runs `nanoforge eval --data PREPARED --split val --seq-len SEQ --max-tokens VAL_COUNT` scores
the final weights of each (MiniMind's final .pth through nanoforge's .pth loading), fp32, the same windows for
both, over the tokens nanoforge's validation covers (val_count: its windows drop the split's partial tail).

MiniMind's trainers have no time budget. Chosen here: a calibration run of the unmodified trainer (stopped after
a few logged steps) gives its start-up time and seconds per step on this machine now; the step count N that fits
the budget follows, and MiniMind then trains one epoch over a seeded random sample of N x batch training records,
so that its own cosine schedule ends exactly with the budget (as nanoforge's --time-budget schedule does, which
follows elapsed / budget). Saving often and killing at the budget would leave its lr undecayed and would charge it
for a 0.6 GB save (weights and AdamW state) per interval. It also saves every N/3 steps; if the machine slows
down and it is still running at 1.1 x the budget, it is stopped there and its last save is used (the table says
so). Its final weights are the fp16 state dict it wrote atomically to checkpoints/ (the same tensors as out/);
its wall time runs from its launch to that file's time.

Recipe: MiniMind's argparse defaults (lr 5e-4 / 1e-5, seq len 340 / 768, cosine to lr/10 without warmup, AdamW
betas (0.9, 0.999), weight decay 0.01, clip 1.0) for both sides, from configs/minimind-3.toml and
configs/minimind-3-sft.toml, except the batch: its 32 x 8 accumulation (pretrain) and 16 (SFT) would give one
optimizer step or a few in a few CPU minutes, so both sides take --pretrain-batch / --sft-batch rows per step
without accumulation. What stays different is each tool's recipe, named in the table's notes: MiniMind pads every
record to the sequence length and computes the padding, nanoforge packs; MiniMind runs fp32 on a CPU (its autocast
is CUDA only; `--dtype float32` keeps its GradScaler off), nanoforge what `--precision auto` picks; MiniMind
tokenizes in its training loop (--num_workers 0: no extra processes, so the same threads), nanoforge prepares
the tokens first (`nanoforge prepare`, timed, and added to nanoforge's wall time and to its curve's times);
MiniMind decays every parameter, nanoforge matrices only. Both sides run with OMP_NUM_THREADS = --threads.

Memory is the peak RSS of the process tree (the trainer and any children), sampled from /proc every 0.1 s, the
same way for both; nanoforge's is the larger of its prepare and its training.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import Proc, crossing_time, is_heldout, loss_at  # benchmarks/measure.py

ROOT = Path(__file__).resolve().parent.parent
NANOFORGE = [sys.executable, "-m", "nanoforge"]

MODELS = {
    # name: (MiniMind's --hidden_size, nanoforge flags over configs/minimind-3.toml)
    "minimind-3": (768, []),
    "minimind2-small": (512, ["--d-model", "512", "--ffn-hidden", "1664"]),
}
STAGES = {
    # stage: (MiniMind trainer, its --save_weight, nanoforge command, config, seq len, files)
    "pretrain": ("train_pretrain.py", "pretrain", "pretrain", "configs/minimind-3.toml", 340, "pretrain_*.jsonl"),
    "sft": ("train_full_sft.py", "full_sft", "sft", "configs/minimind-3-sft.toml", 768, "sft_*.jsonl"),
}
LR = {"pretrain": 5e-4, "sft": 1e-5}
# --time-budget counts nanoforge's training loop; its start-up (imports, model, data) and its final save and
# report come on top: about this much here, taken off its budget so that its wall time is the budget too
NANOFORGE_STARTUP_S = 8.0


class BenchError(Exception):
    pass


# ------------------------------------------------------------------------------------------------ helpers


def run_checked(cmd: list[str], log: Path, env: dict) -> Proc:
    proc = Proc(cmd, log, env=env)
    rc, _ = proc.wait()
    if rc != 0:
        raise BenchError(f"{' '.join(map(str, cmd))} failed ({rc}); its output: {log}\n"
                         + "".join(log.read_text().splitlines(True)[-15:]))
    return proc


def thread_env(threads: int, **extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", **extra)
    return env


def read_jsonl_lines(files: list[Path]) -> list[str]:
    lines = []
    for f in files:
        lines += [ln for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return lines


STEP_LINE = re.compile(r"\((\d+)/(\d+)\), loss: ([0-9.]+)")


# ------------------------------------------------------------------------------------------------ one stage


class Stage:
    def __init__(self, args, model: str, stage: str, work: Path, tokenizer: Path, init_pth: Path | None):
        self.args, self.model, self.stage, self.work = args, model, stage, work
        self.tokenizer, self.init_pth = tokenizer, init_pth
        self.hidden, self.model_flags = MODELS[model]
        self.trainer, self.weight, self.command, self.config, self.seq, pattern = STAGES[stage]
        self.batch = args.pretrain_batch if stage == "pretrain" else args.sft_batch
        self.files = sorted((args.data / "minimind").glob(pattern))
        if not self.files:
            raise BenchError(f"no {pattern} in {args.data / 'minimind'}")
        self.env = thread_env(args.threads)

    def split(self):
        lines = read_jsonl_lines(self.files)
        n_held = self.args.heldout_pretrain if self.stage == "pretrain" else self.args.heldout_sft
        self.fraction = n_held / len(lines)
        self.all_path = self.work / "all.jsonl"
        self.all_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        self.train = [ln for i, ln in enumerate(lines) if not is_heldout(i, self.fraction)]
        self.heldout = [ln for i, ln in enumerate(lines) if is_heldout(i, self.fraction)]
        (self.work / "heldout.jsonl").write_text("\n".join(self.heldout) + "\n", encoding="utf-8")
        (self.work / "train.jsonl").write_text("\n".join(self.train) + "\n", encoding="utf-8")
        print(f"  data: {len(lines):,} records from {len(self.files)} files; {len(self.heldout)} held out "
              f"(val fraction {self.fraction:.3g})", flush=True)

    # ---- MiniMind

    def minimind_copy(self) -> Path:
        """A writable copy of the checkout (its trainers write ../out, ../checkpoints)."""
        dst = self.work / "minimind"
        shutil.copytree(self.args.minimind, dst, ignore=shutil.ignore_patterns(".git", "out", "checkpoints"))
        for p in [dst, *dst.rglob("*")]:
            p.chmod(p.stat().st_mode | 0o200)
        if self.stage == "sft":
            (dst / "out").mkdir()
            shutil.copy(self.init_pth, dst / "out" / f"pretrain_{self.hidden}.pth")
        return dst

    def minimind_cmd(self, data: Path, save_interval: int) -> list[str]:
        return [str(self.args.minimind_python), self.trainer, "--device", "cpu", "--dtype", "float32",
                "--num_workers", "0", "--epochs", "1", "--batch_size", str(self.batch), "--accumulation_steps", "1",
                "--learning_rate", str(LR[self.stage]), "--max_seq_len", str(self.seq),
                "--hidden_size", str(self.hidden), "--num_hidden_layers", "8", "--log_interval", "1",
                "--save_interval", str(save_interval), "--data_path", str(data)]
        # sft: --from_weight defaults to 'pretrain' (out/pretrain_<hidden>.pth); pretrain: to 'none'

    def minimind_env(self, mm: Path) -> dict:
        return thread_env(self.args.threads, HF_HOME=str(mm / "hf-home"), HF_DATASETS_OFFLINE="1",
                          HF_HUB_OFFLINE="1")

    def calibrate(self, mm: Path) -> tuple[float, float]:
        """Start-up seconds (launch to the first step's log line) and seconds per step after it."""
        steps = self.args.calibration_steps
        # on a sample of the size its run will read (its datasets cache is built at start-up, per file)
        data = self.work / "minimind-calibration.jsonl"
        data.write_text("\n".join(random.Random(1).sample(self.train, min(256, len(self.train)))) + "\n",
                        encoding="utf-8")
        cmd = self.minimind_cmd(data, 10 ** 9)
        log = self.work / "minimind-calibration.log"
        proc = Proc(cmd, log, cwd=mm / "trainer", env=self.minimind_env(mm))
        seen: list[float] = []
        deadline = time.time() + self.args.budget
        pos = 0
        while proc.p.poll() is None and time.time() < deadline and len(seen) < steps + 1:
            time.sleep(0.05)
            text = log.read_text(errors="replace")
            new = len(STEP_LINE.findall(text[pos:]))
            seen += [time.time()] * new
            pos = len(text)
        if proc.p.poll() is None:
            proc.stop()
        proc.wait()
        shutil.rmtree(mm / "checkpoints", ignore_errors=True)
        if len(seen) < 2:
            raise BenchError(f"MiniMind's {self.trainer} logged {len(seen)} steps in its calibration run; its "
                             f"output: {log}\n" + "".join(log.read_text().splitlines(True)[-15:]))
        return seen[0] - proc.start, (seen[-1] - seen[0]) / (len(seen) - 1)

    def run_minimind(self) -> dict:
        mm = self.minimind_copy()
        startup, per_step = self.calibrate(mm)
        n = max(1, int(0.95 * (self.args.budget - startup) / per_step))  # 5% for its saves
        rng = random.Random(0)
        sample = rng.sample(self.train, min(n * self.batch, len(self.train)))
        n = math.ceil(len(sample) / self.batch)
        data = self.work / "minimind-train.jsonl"
        data.write_text("\n".join(sample) + "\n", encoding="utf-8")
        save_interval = max(2, n // 3)
        print(f"  MiniMind: calibration {startup:.0f} s start-up + {per_step:.1f} s/step -> {n} steps of "
              f"{self.batch} x {self.seq}", flush=True)
        proc = Proc(self.minimind_cmd(data, save_interval), self.work / "minimind.log", cwd=mm / "trainer",
                    env=self.minimind_env(mm))
        rc, stopped = proc.wait(deadline=proc.start + 1.1 * self.args.budget)
        final = mm / "checkpoints" / f"{self.weight}_{self.hidden}.pth"
        log = (self.work / "minimind.log").read_text(errors="replace")
        if not final.exists() or (rc != 0 and not stopped):
            raise BenchError(f"MiniMind's {self.trainer} failed ({rc}) without weights; its output: "
                             f"{self.work / 'minimind.log'}\n" + "".join(log.splitlines(True)[-15:]))
        logged = [int(m[0]) for m in STEP_LINE.findall(log)]
        steps = n if not stopped else (max(logged, default=0) // save_interval) * save_interval
        wall = final.stat().st_mtime - proc.start
        positions = steps * self.batch * self.seq
        real = self.real_tokens(sample[:steps * self.batch])
        return {"wall": wall, "steps": steps, "planned_steps": n, "stopped": stopped, "peak": proc.peak,
                "positions_per_s": positions / wall, "real_per_s": real / wall, "weights": final,
                "startup": startup, "per_step": per_step}

    def real_tokens(self, records: list[str]) -> int:
        """Non-padding tokens of MiniMind's rows: the tokens of each record, capped at the sequence length (for
        pretraining its <|im_start|> and <|im_end|> around the text; for SFT the chat template's rendering, as
        nanoforge prepares it, without MiniMind's random system prompts)."""
        from nanoforge.data.shards import TokenShards
        import numpy as np
        if not records:
            return 0
        path = self.work / "minimind-used.jsonl"
        path.write_text("\n".join(records) + "\n", encoding="utf-8")
        out = self.work / "minimind-used-prepared"
        self.prepare(path, out, 0.0, quiet=True)
        shards = TokenShards(out, "train")
        lens = np.diff(np.append(shards.doc_offsets(), shards.num_tokens))
        return int(np.minimum(lens, self.seq).sum())

    # ---- nanoforge

    def prepare(self, src: Path, out: Path, fraction: float, quiet: bool = False) -> Proc:
        cmd = [*NANOFORGE, "prepare", "--kind", self.stage, "--data", str(src), "--tokenizer", str(self.tokenizer),
               "--out", str(out), "--val-fraction", repr(fraction), "--workers", str(self.args.threads), "--force"]
        if self.stage == "sft":
            cmd += ["--drop-empty-think", "0.8"]  # MiniMind's post_processing_chat drops 80% of empty thinks
        return run_checked(cmd, self.work / f"prepare-{out.name}.log", self.env)

    def check_heldout(self, prepared: Path):
        """nanoforge's validation split holds exactly the held-out records."""
        manifest = json.loads((prepared / "manifest.json").read_text())
        val = manifest["splits"]["val"]
        if val["docs"] != len(self.heldout):
            raise BenchError(f"{prepared}: {val['docs']} validation records, expected the {len(self.heldout)} "
                             "held out: nanoforge's validation draw is not the one this script assumes")
        if self.stage == "pretrain":
            check = self.work / "heldout-prepared"
            self.prepare(self.work / "heldout.jsonl", check, 0.0)
            from nanoforge.data.shards import TokenShards
            a, b = TokenShards(prepared, "val"), TokenShards(check, "train")
            if a.num_tokens != b.num_tokens or (a.read(0, a.num_tokens) != b.read(0, b.num_tokens)).any():
                raise BenchError(f"{prepared}: the validation split's tokens are not the held-out records'")

    def run_nanoforge(self, minimind: dict) -> dict:
        prepared = self.work / "nanoforge-data"
        prep = self.prepare(self.all_path, prepared, self.fraction)
        prep_s = prep.end - prep.start
        self.check_heldout(prepared)
        # ~evals validations over the budget, from MiniMind's step time (nanoforge's is usually shorter, so
        # more evaluations happen; each is charged to nanoforge's time)
        est_steps = max(1, int(self.args.budget / minimind["per_step"] * 1.5))
        eval_every = max(1, est_steps // self.args.evals)
        run = self.work / "nanoforge-run"
        cmd = [*NANOFORGE, self.command, "--config", str(ROOT / self.config), "--data", str(prepared),
               "--out", str(run), "--time-budget", str(self.args.budget - prep_s - NANOFORGE_STARTUP_S),
               "--epochs", "0",
               "--max-steps", "10000000", "--batch-size", str(self.batch), "--grad-accum", "1",
               "--seq-len", str(self.seq), "--lr", str(LR[self.stage]), "--warmup-steps", "0",
               "--eval-every", str(eval_every), "--eval-batches", "100000", "--save-every", "0",
               "--log-every", "1", "--tensorboard", "false"]
        if self.stage == "pretrain":
            cmd += ["--tokenizer", str(self.tokenizer), *self.model_flags]
        else:
            cmd += ["--init", str(self.init_pth), "--tokenizer", str(self.tokenizer)]
        proc = run_checked(cmd, self.work / "nanoforge.log", self.env)
        wall = proc.end - proc.start + prep_s
        records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        curve = [(r["time"] - proc.start + prep_s, r["val_loss"]) for r in records if "val_loss" in r]
        val_count = next((int(r["val_count"]) for r in records if "val_count" in r), None)
        train = [r for r in records if "tokens_per_s" in r]
        steps = max((r["step"] for r in records), default=0)
        tokens = steps * self.batch * self.seq
        train_s = wall - prep_s - (train[0]["time"] - proc.start if train else 0)
        padding = re.search(r"\(padding ([0-9.]+)%\)", (self.work / "nanoforge.log").read_text(errors="replace"))
        real = tokens * (1 - float(padding.group(1)) / 100) if padding else tokens  # pretraining: packed, no pad
        step_ms = sorted(r.get("data_ms", 0) + r.get("fwd_bwd_ms", 0) + r.get("optim_ms", 0) for r in train)
        return {"wall": wall, "prepare_s": prep_s, "val_count": val_count, "steps": steps, "peak": max(proc.peak, prep.peak),
                "positions_per_s": tokens / wall, "real_per_s": real / wall, "curve": curve, "run": run,
                "prepared": prepared, "train_s": train_s, "precision": precision_of(run),
                "per_step": step_ms[len(step_ms) // 2] / 1e3 if step_ms else None,
                "startup": (train[0]["time"] - proc.start - step_ms[0] / 1e3) if train else None}

    def score(self, weights: Path, pth: bool, max_tokens: int | None) -> float:
        """nanoforge eval's loss over the first max_tokens scored tokens of the held-out split: as many as
        nanoforge's in-training validation covers (its windows leave out the split's last partial window), so
        that MiniMind's figure and nanoforge's curve are over the same tokens."""
        out = self.work / f"eval-{'minimind' if pth else 'nanoforge'}.json"
        cmd = [*NANOFORGE, "eval", str(weights), "--data", str(self.work / "nanoforge-data"), "--split", "val",
               "--seq-len", str(self.seq), "--json", str(out), "--no-write", "--quiet"]
        if max_tokens:
            cmd += ["--max-tokens", str(max_tokens)]
        if pth:
            cmd += ["--tokenizer", str(self.tokenizer)]
        run_checked(cmd, out.with_suffix(".log"), self.env)
        return float(json.loads(out.read_text())["data"]["loss"])

    def run(self) -> dict:
        self.work.mkdir(parents=True, exist_ok=True)
        print(f"\n== {self.model} / {self.stage} (budget {self.args.budget:g} s per side)", flush=True)
        self.split()
        mm = self.run_minimind()
        print(f"  MiniMind: {mm['steps']} steps in {mm['wall']:.0f} s, peak {mm['peak'] / 1e9:.2f} GB"
              + (" (stopped at 1.1 x budget)" if mm["stopped"] else ""), flush=True)
        nf = self.run_nanoforge(mm)
        print(f"  nanoforge: {nf['steps']} steps in {nf['wall']:.0f} s, peak {nf['peak'] / 1e9:.2f} GB", flush=True)
        mm["loss"] = self.score(mm["weights"], pth=True, max_tokens=nf["val_count"])
        nf["loss"] = self.score(nf["run"], pth=False, max_tokens=nf["val_count"])
        nf["curve"].append((nf["wall"], nf["loss"]))  # the final weights, scored at the end of the run
        nf["reach"] = crossing_time(nf["curve"], mm["loss"])
        nf["at_minimind_wall"] = loss_at(nf["curve"], mm["wall"])
        print(f"  held-out loss: MiniMind {mm['loss']:.4f}, nanoforge {nf['loss']:.4f}; nanoforge reached "
              f"MiniMind's at {fmt_s(nf['reach'])}", flush=True)
        result = {"model": self.model, "stage": self.stage, "minimind": mm, "nanoforge": nf}
        (self.work / "result.json").write_text(json.dumps(result, default=str, indent=1))
        return result


def precision_of(run: Path) -> str:
    """What --precision auto resolved to (the run's config.toml)."""
    import tomllib
    with open(run / "config.toml", "rb") as f:
        return tomllib.load(f)["train"]["precision"]


def fmt_s(s):
    return "not reached" if s is None else f"{s:.0f} s"


# ------------------------------------------------------------------------------------------------ report


def table(results: list[dict]) -> str:
    rows = ["| model | stage | side | steps | s/step | wall s | positions/s | tokens/s (non-pad) | peak RSS "
            "| held-out loss, end | at MiniMind's wall | time to MiniMind's loss |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        mm, nf = r["minimind"], r["nanoforge"]
        reach = "not reached" if nf["reach"] is None else \
            f"{nf['reach']:.0f} s = {nf['reach'] / mm['wall']:.2f}x MiniMind's"
        at = "-" if nf["at_minimind_wall"] is None else f"{nf['at_minimind_wall']:.4f}"
        stopped = " (stopped)" if mm["stopped"] else ""
        rows.append(f"| {r['model']} | {r['stage']} | MiniMind fp32 | {mm['steps']}{stopped} | {mm['per_step']:.1f} "
                    f"| {mm['wall']:.0f} | {mm['positions_per_s']:.0f} | {mm['real_per_s']:.0f} "
                    f"| {mm['peak'] / 1e9:.2f} GB | {mm['loss']:.4f} | {mm['loss']:.4f} | - |")
        per_step = "-" if nf["per_step"] is None else f"{nf['per_step']:.1f}"
        rows.append(f"| {r['model']} | {r['stage']} | nanoforge {nf['precision']} | {nf['steps']} | {per_step} "
                    f"| {nf['wall']:.0f} | {nf['positions_per_s']:.0f} | {nf['real_per_s']:.0f} "
                    f"| {nf['peak'] / 1e9:.2f} GB ({nf['peak'] / mm['peak']:.2f}x) | {nf['loss']:.4f} | {at} "
                    f"| {reach} |")
    return "\n".join(rows)


def machine() -> str:
    cpu = subprocess.run(["grep", "-m1", "model name", "/proc/cpuinfo"], capture_output=True, text=True).stdout
    import torch
    return (f"CPU: {cpu.split(':', 1)[-1].strip() or platform.processor()}; torch {torch.__version__}; "
            f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


def main(argv=None) -> int:
    default_data = os.environ.get("NANOFORGE_DATA") or str(ROOT.parent / "shared" / "data")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minimind", type=Path, required=True, help="MiniMind checkout (trainer/, model/, dataset/)")
    ap.add_argument("--minimind-python", type=Path, required=True,
                    help="python of a virtual environment with MiniMind's requirements (docs/perf.md)")
    ap.add_argument("--data", type=Path, default=Path(default_data),
                    help="folder with minimind/ and minimind-tokenizer/ (default: NANOFORGE_DATA or ../shared/data)")
    ap.add_argument("--model", choices=[*MODELS, "both"], default="minimind-3")
    ap.add_argument("--budget", type=float, default=300.0, help="wall seconds per stage per side (default 300)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of both sides (default 1)")
    ap.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder, deleted)")
    ap.add_argument("--stages", default="pretrain,sft", help="pretrain,sft (sft alone needs --sft-init)")
    ap.add_argument("--sft-init", type=Path, help="MiniMind pretrained .pth both SFTs start from (default: the one "
                    "MiniMind's pretraining writes in the pretrain stage)")
    ap.add_argument("--pretrain-batch", type=int, default=4, help="rows per step, both sides (default 4)")
    ap.add_argument("--sft-batch", type=int, default=2, help="rows per step, both sides (default 2)")
    ap.add_argument("--heldout-pretrain", type=int, default=24, help="held-out pretraining records (default 24)")
    ap.add_argument("--heldout-sft", type=int, default=12, help="held-out SFT records (default 12)")
    ap.add_argument("--evals", type=int, default=8, help="nanoforge validations aimed for per run (default 8)")
    ap.add_argument("--calibration-steps", type=int, default=3, help="MiniMind steps timed before a run")
    args = ap.parse_args(argv)

    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    problems = []
    if not (args.minimind / "trainer" / "train_pretrain.py").is_file():
        problems.append(f"--minimind {args.minimind}: no MiniMind checkout there (trainer/train_pretrain.py)")
    if not (args.minimind_python.is_file() and os.access(args.minimind_python, os.X_OK)):
        problems.append(f"--minimind-python {args.minimind_python}: no executable there (docs/perf.md says how to "
                        "make MiniMind's virtual environment)")
    tokenizer = args.data / "minimind-tokenizer"
    if not (args.data / "minimind").is_dir() or not (tokenizer / "tokenizer.json").is_file():
        problems.append(f"--data {args.data}: expected minimind/ and minimind-tokenizer/ in it")
    if bad := [s for s in stages if s not in STAGES]:
        problems.append(f"--stages: unknown {', '.join(bad)} (pretrain, sft)")
    if "sft" in stages and "pretrain" not in stages and not (args.sft_init and args.sft_init.is_file()):
        problems.append("--stages sft without pretrain needs --sft-init FILE.pth (MiniMind's pretrained weights)")
    if problems:
        print("error: " + "\nerror: ".join(problems), file=sys.stderr)
        return 2
    args.minimind, args.data = args.minimind.resolve(), args.data.resolve()
    if args.model == "both" and args.sft_init:
        print("error: --sft-init fits one model; give --model", file=sys.stderr)
        return 2

    out = args.out.resolve() if args.out else Path(tempfile.mkdtemp(prefix="vs-minimind-"))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{started}; {machine()}; threads {args.threads}", flush=True)
    results = []
    try:
        for model in (list(MODELS) if args.model == "both" else [args.model]):
            init = args.sft_init.resolve() if args.sft_init else None
            for stage in stages:
                r = Stage(args, model, stage, out / model / stage, tokenizer, init).run()
                results.append(r)
                if stage == "pretrain":
                    init = r["minimind"]["weights"]
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    print(f"\n{started}; {machine()}; threads {args.threads}; budget {args.budget:g} s per stage per side")
    print(table(results))
    print("\ns/step: MiniMind's from its calibration run, nanoforge's median step (same rows x seq len per step). "
          "wall s: launch to final weights (nanoforge: its prepare + its run, validations included). positions/s: "
          "rows x seq len computed per wall second; tokens/s (non-pad): the tokens trained on per wall second "
          "(MiniMind pads every record to the seq len, nanoforge packs). Held-out loss, end: `nanoforge eval` "
          "fp32 on the final weights of each; at MiniMind's wall: nanoforge's last validation by then.")
    for r in results:
        nf = r["nanoforge"]
        print(f"{r['model']} {r['stage']}: nanoforge's curve (s, val loss): "
              + ", ".join(f"({t:.0f}, {v:.3f})" for t, v in nf["curve"]))
    if args.out:
        (out / "results.json").write_text(json.dumps(results, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
