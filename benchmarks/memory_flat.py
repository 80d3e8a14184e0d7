"""Memory over a long run: pretraining, SFT, DPO and GRPO, each for a few hundred steps through the real commands,
with the process's resident memory read after the first steps and at the end (it should stay flat).

    NANOFORGE_DATA=DATA .venv/bin/python benchmarks/memory_flat.py [--steps 300] [--stages sft,dpo]
        [--precision fp32|bf16] [--d-model 256 --n-layers 4] [--threads 1]

Data (benchmarks/data_dir.py; DATA's files are listed in docs/perf.md): MiniMind's tokenizer; TinyStories for pretraining; ShareGPT (long, multi-turn) and
Alpaca (short) conversations for SFT, so packed rows hold segments of very different lengths that change every
step; LLaMA-Factory's English DPO pairs; GSM8K questions for GRPO (math reward). The model is a small one at
MiniMind-3's row shape (batch 2 x 768 positions; --d-model/--n-layers set its size); pretraining runs first and
is the --init of the other three. While each command runs, this script reads the child's /proc/PID/status at every
progress line: VmRSS (current) and VmHWM (peak). It prints both at the first progress line and at the end, and
end / first. docs/perf.md ("Memory over a long run") has the figures and the command line.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from data_dir import data_path  # benchmarks/data_dir.py: NANOFORGE_DATA

ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^step +(\d+)/\d+ \|")  # right-aligned: "step  10/300 | ..."


def nanoforge(*args: str, env: dict, watch: bool = False) -> list[tuple[int, int, int]]:
    """Run `python -m nanoforge ARGS`; with `watch`, (step, VmRSS MB, VmHWM MB) at each progress line."""
    proc = subprocess.Popen([sys.executable, "-m", "nanoforge", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    samples, tail = [], []
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        match = STEP_LINE.match(line)
        if watch and match:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            rss, hwm = (int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) // 1024 for key in ("VmRSS", "VmHWM"))
            samples.append((int(match.group(1)), rss, hwm))
    if proc.wait():
        sys.exit(f"nanoforge {' '.join(args)} failed:\n{''.join(tail)}")
    return samples


def prepare(tmp: Path, env: dict) -> dict[str, Path]:
    minimind, tokenizer = data_path("minimind"), str(data_path("minimind-tokenizer"))
    sets = {"pretrain": ["pretrain_en_tinystories.jsonl"],
            "sft": ["sft_zh_sharegpt_1k.jsonl", "sft_en_alpaca_gpt4_demo.jsonl"],
            "dpo": ["dpo_en_llamafactory_demo.jsonl"]}
    out = {}
    for kind, files in sets.items():
        out[kind] = tmp / f"data-{kind}"
        nanoforge("prepare", "--kind", kind, "--data", *(str(minimind / f) for f in files), "--tokenizer", tokenizer,
                  "--out", str(out[kind]), "--workers", "1", env=env)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--stages", default="pretrain,sft,dpo,grpo")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--d-model", default="256")
    parser.add_argument("--n-layers", default="4")
    parser.add_argument("--threads", default="1", help="OMP_NUM_THREADS of the training commands")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": args.threads, "PYTHONPATH": str(ROOT)}
    shape = ["--d-model", args.d_model, "--n-layers", args.n_layers, "--n-heads", "4", "--n-kv-heads", "2",
             "--max-seq-len", "768"]
    common = ["--seq-len", "768", "--log-every", "10", "--precision", args.precision, "--device", "cpu",
              "--eval-every", "0", "--save-every", "0", "--sample-every", "0"]
    gsm8k = str(data_path("gsm8k") / "train.jsonl")
    with tempfile.TemporaryDirectory(prefix="nanoforge-memory-") as tmp_name:
        tmp = Path(tmp_name)
        data = prepare(tmp, env)
        init = tmp / "pretrain"
        rows = ["--batch-size", "2"]
        runs = {"pretrain": ["pretrain", "--data", str(data["pretrain"]), *shape, *rows],
                "sft": ["sft", "--init", str(init), "--data", str(data["sft"]), *rows],
                "dpo": ["dpo", "--init", str(init), "--data", str(data["dpo"]), *rows],
                "grpo": ["grpo", "--init", str(init), "--data", gsm8k, "--reward", "math", "--num-generations", "4",
                         "--prompts-per-step", "2", "--max-new-tokens", "64"]}
        stages = args.stages.split(",")
        if "pretrain" not in stages:  # the others start from it: one step is enough
            nanoforge(*runs["pretrain"], *common, "--max-steps", "1", "--out", str(init), env=env)
        print(f"{'stage':<9} {'first step':>10} {'RSS MB':>7} {'peak MB':>8} | {'last step':>9} {'RSS MB':>7} "
              f"{'peak MB':>8} | RSS end/first  peak end/first", flush=True)
        for stage in stages:
            out = init if stage == "pretrain" else tmp / stage
            samples = nanoforge(*runs[stage], *common, "--max-steps", str(args.steps), "--out", str(out), env=env,
                                watch=True)
            (s0, r0, h0), (s1, r1, h1) = samples[0], samples[-1]
            print(f"{stage:<9} {s0:>10} {r0:>7} {h0:>8} | {s1:>9} {r1:>7} {h1:>8} | {r1 / r0:>13.3f}  "
                  f"{h1 / h0:>14.3f}", flush=True)


if __name__ == "__main__":
    main()
