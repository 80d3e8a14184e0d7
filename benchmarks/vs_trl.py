"""nanoforge against Hugging Face TRL on the same work (SFT, DPO, GRPO), and an interoperability round trip.

TRL lives in its own venv, outside the repository (nothing of it goes into nanoforge's dependencies):

    python3.11 -m venv TRLVENV
    TRLVENV/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu  # or plain PyPI
    TRLVENV/bin/pip install trl        # measured with trl 1.16.0, transformers 5.25.0, torch 2.13.0+cpu

This script runs in nanoforge's venv; TRL runs as a child process (benchmarks/trl_worker.py under
--trl-python, importing only trl/transformers/torch/datasets), and so does nanoforge (its CLI). Each tool runs
one after the other with one thread (OMP_NUM_THREADS=1; the worker also calls torch.set_num_threads(1)), fp32,
CPU; peak memory is each child's RSS high-water mark (ru_maxrss from wait4).

    NANOFORGE_DATA=DATA .venv/bin/python benchmarks/vs_trl.py --trl-python TRLVENV/bin/python \\
        [--only sft|dpo|grpo|roundtrip] [--steps N] [--repeat N] [--init RUN] [--json OUT]

--repeat N: the model (and GRPO's SFT model) is made once; each comparison then runs N times, nanoforge then TRL
each time; printed: every run, each figure's median and min-max, the nanoforge/TRL ratio of the medians of the
speed and memory figures, and the median ms/step of each phase side by side (nanoforge's from metrics.jsonl,
TRL's from its trainer's methods, timed in trl_worker.py); --json holds every run and the medians.

0. Model: --init RUN, or `nanoforge pretrain` of a small llama-shaped model on $NANOFORGE_DATA/tiny/pretrain_tiny.jsonl
   (a tokenizer trained on the fly), exported with `nanoforge export`; transformers must load it as
   LlamaForCausalLM with the same prompt ids (text and chat template) and the same logits (max |diff| printed).
1. SFT: $NANOFORGE_DATA/minimind/sft_zh_alpaca_gpt4_demo.jsonl, 4 x 512 packed, assistant replies only; supervised
   tokens/s, median step time, peak memory.
2. DPO: $NANOFORGE_DATA/tiny/dpo_tiny.jsonl (4 x steps pairs), 4 pairs/step, beta 0.1, sigmoid loss; pairs/s,
   the reference log-prob pass (over the same pairs), peak memory.
3. GRPO: benchmarks/grpo_arithmetic.py's task (its SFT model, prompts and math reward; TRL's GRPOTrainer gets a
   reward function doing the same check), 8 prompts x 8 replies, 6 new tokens; s/step, held-out greedy accuracy
   before and after (both scored by the same code), peak memory.
4. Round trip: export -> TRL SFT with assistant_only_loss=True on our chat data -> TRL saves -> `nanoforge
   generate`, `chat`, `eval` load TRL's directory -> `nanoforge export` writes it again (same tensors).
The setting mapping of each comparison, and what cannot be matched, is printed with its numbers (MAPPING below).
Recorded runs: docs/perf.md, "nanoforge vs TRL (benchmarks/vs_trl.py)".
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import grpo_arithmetic as arith  # benchmarks/grpo_arithmetic.py: the GRPO task
from data_dir import data_path  # benchmarks/data_dir.py: NANOFORGE_DATA
from nanoforge.weights.load import load_model

REPO = Path(__file__).resolve().parents[1]

WORKER = REPO / "benchmarks" / "trl_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
OPT = dict(lr=5e-5, warmup=2)  # SFT and DPO: AdamW (0.9, 0.95), no weight decay, clip 1.0, cosine to 0.1 x lr
COMMON_FLAGS = ["--precision", "fp32", "--device", "cpu", "--tensorboard", "false", "--eval-every", "0",
                "--save-every", "0", "--log-every", "1", "--seed", "0", "--weight-decay", "0", "--beta1", "0.9",
                "--beta2", "0.95", "--grad-clip", "1.0", "--sample-every", "0"]

MAPPING = {
    "sft": [
        ("loss", "next-token CE on assistant replies + <|im_end|> (our loss mask) | assistant_only_loss=True "
                 "({% generation %} markers of our exported template give the same mask), loss_type nll"),
        ("normalisation", "sum over supervised tokens / supervised tokens of the step | the same "
                          "(num_items_in_batch)"),
        ("packing", "4 rows x 512, whole conversations, block-diagonal attention, positions restart | "
                    "packing_strategy=bfd, padding_free: the 4 packed rows flattened to 1 x <=2048 with "
                    "position_ids, which transformers turns into the same block-diagonal mask"),
        ("truncation", "a conversation over 513 tokens is cut at a turn boundary (skipped if none fits) | "
                       "bfd truncates it to 512"),
        ("order", "seeded permutation, best fit within the next 64 conversations | BFD packing, then the Trainer's seeded shuffle "
                  "(rows differ; tokens/step differ slightly)"),
        ("optimizer", "AdamW betas (0.9, 0.95), eps 1e-8, wd 0, clip 1.0 | adamw_torch, same"),
        ("schedule", "linear warmup 2 steps, cosine to 0.1 x lr 5e-5 | cosine_with_min_lr, min_lr_rate 0.1, "
                     "warmup_steps 2 (HF's step 1 has lr 0; ours lr/2)"),
        ("precision", "fp32, 1 thread, CPU | fp32, 1 thread, use_cpu"),
    ],
    "dpo": [
        ("loss", "-log sigmoid(beta * margin), beta 0.1, mean over pairs | loss_type sigmoid, beta 0.1"),
        ("batch", "4 pairs/step (8 rows, padded to the longest) | per_device_train_batch_size 4"),
        ("reference", "log-probs of the --init model computed once over every pair before training (cached) | "
                      "precompute_ref_log_probs=True over the train set, batch 8"),
        ("length", "seq_len 512 | max_length 512, truncation keep_start"),
        ("optimizer/schedule", "as SFT"),
        ("data", "prompt = the chat before the last turn; the two last assistant turns | explicit prompt, chosen, "
                 "rejected (conversational)"),
    ],
    "grpo": [
        ("loss", "--loss grpo --loss-norm sequence: clipped ratio, mean over each reply's tokens then replies | "
                 "loss_type grpo (per-sequence normalisation), epsilon 0.2"),
        ("advantage", "zscore in the group: (r - mean) / (std + eps) | scale_rewards group"),
        ("KL", "beta 0 (no reference model) | beta 0"),
        ("updates", "1 optimizer step per rollout (ppo_epochs 1) | num_iterations 1, steps_per_generation 1"),
        ("sampling", "temperature 1, no top-k/top-p, 6 new tokens, stop at <|im_end|>/<|endoftext|> | "
                     "temperature 1, top_p 1, top_k 0, max_completion_length 6, eos from our generation_config"),
        ("reward", "math: answer_number(reply) == answer | a reward function with the same rule"),
        ("optimizer/schedule", "AdamW, lr 3e-5 constant, wd 0, clip 1.0 | adamw_torch, constant, same"),
        ("generation", "our KV-cache sampler | transformers generate (no vLLM)"),
    ],
}
UNMATCHED = {
    "sft": "row composition (windowed best fit vs BFD, different shuffles); HF's warmup starts at lr 0",
    "dpo": "how each pads and truncates a batch (not aligned here; the step's cost depends on it); HF's warmup "
           "starts at lr 0",
    "grpo": "the random draws (different samplers: ours with its KV cache, TRL with transformers' generate)",
}


# ------------------------------------------------------------------------------------------- child processes


def child(cmd: list[str], cwd: Path = REPO) -> tuple[list[tuple[float, str]], float, float]:
    """Run cmd; (its output lines with arrival times, wall seconds, peak RSS in MB from wait4). Stops the script
    on failure."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(time.perf_counter(), line.rstrip("\n")) for line in proc.stdout]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = "\n".join(line for _, line in lines[-40:])
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return lines, time.perf_counter() - start, usage.ru_maxrss / 1024


def nanoforge(*args: str) -> tuple[list[tuple[float, str]], float, float]:
    return child([sys.executable, "-m", "nanoforge", *args])


def trl(python: str, work: Path, task: str, tag: str = "", **job) -> tuple[dict, float]:
    """Run trl_worker.py's task; (its result, its peak RSS in MB)."""
    name = f"trl-{tag or task}"
    job = {"task": task, "out": str(work / f"{name}.json"), "work": str(work / f"{name}-out"), **job}
    (work / f"{name}-job.json").write_text(json.dumps(job))
    _, _, rss = child([python, str(WORKER), str(work / f"{name}-job.json")], cwd=work)
    return json.loads((work / f"{name}.json").read_text()), rss


def metrics(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def our_steps(run: Path, skip: int = 1) -> dict:
    """Step times (data + forward/backward + optimizer, from metrics.jsonl at --log-every 1) past the first."""
    recs = metrics(run)[skip:]
    times = [(r.get("data_ms", 0) + r.get("fwd_bwd_ms", 0) + r.get("optim_ms", 0)) / 1e3 for r in recs]
    return {"recs": recs, "step_s": times, "step_s_median": statistics.median(times) if times else None}


def our_phases(run: Path, replies: int = 0) -> dict[str, float]:
    """Median ms/step past the first step of each phase, from metrics.jsonl (--log-every 1): data (GRPO: the
    rollout: generation, scoring, advantages), of it generation (GRPO: `replies` x mean reply length / the
    rollout's tokens/s), forward+backward, optimizer (clip, step, zero_grad), other (the rest of the gap between
    two records: the log, bookkeeping), step (that gap)."""
    recs, rows = metrics(run), []
    for prev, r in zip(recs, recs[1:]):
        row = {"rollout": r["data_ms"], "fwd_bwd": r["fwd_bwd_ms"], "optim": r["optim_ms"],
               "step": 1e3 * (r["time"] - prev["time"])}
        if replies:
            row["generation"] = 1e3 * replies * _stat(r, "reply_len") / _stat(r, "rollout_tokens_per_s")
        rows.append({**row, "other": row["step"] - row["rollout"] - row["fwd_bwd"] - row["optim"]})
    return {k: statistics.median(row[k] for row in rows) for k in rows[0]} if rows else {}


def _stat(rec: dict, name: str) -> float:
    return rec[name] if name in rec else rec[f"stat_{name}"]


# -------------------------------------------------------------------------------------------- the model


def base_model(args, work: Path) -> tuple[Path, Path]:
    """(the nanoforge run, its `nanoforge export` HF directory)."""
    run = Path(args.init) if args.init else work / "base"
    if not args.init:
        corpus = data_path("tiny/pretrain_tiny.jsonl")
        nanoforge("pretrain", "--preset", "tiny", "--data", str(corpus), "--out", str(run), "--d-model",
                  str(args.d_model), "--n-layers", str(args.n_layers), "--n-heads", "4", "--n-kv-heads", "2",
                  "--max-seq-len", "512", "--seq-len", "256", "--batch-size", "8", "--vocab-size", "4096",
                  "--max-steps", str(args.pretrain_steps), "--lr", "3e-3", "--warmup-steps", "10",
                  *COMMON_FLAGS, "--quiet")
    hf = work / "base-hf"
    nanoforge("export", str(run), "--out", str(hf), "--force")
    return run, hf


def parity(args, run: Path, hf: Path, work: Path) -> dict:
    """Same ids for text and chat prompts, and the same logits on the same ids (ours vs transformers)."""
    model, tok, _ = load_model(run)
    texts = ["Once upon a time there was a", "且说曹操逃出城外，", "Q: 12+345=?\n\nA: <think>\n\n</think>"]
    chats = [[{"role": "user", "content": "你好，请介绍一下自己。"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3="},
              {"role": "assistant", "content": "5"}, {"role": "user", "content": "Why?"}]]
    ids = [tok.encode(t) for t in texts] + [tok.render_chat(c, add_generation_prompt=True)[0] for c in chats]
    got, _ = trl(args.trl_python, work, "logits", hf_dir=str(hf), texts=texts, chats=chats, ids=ids)
    with torch.no_grad():
        ours = [model(torch.tensor([i]))[0].float() for i in ids]
    diff = max(float((o - torch.tensor(t)).abs().max()) for o, t in zip(ours, got["logits"]))
    out = {"hf_class": got["class"], "ids_equal": got["text_ids"] + got["chat_ids"] == ids,
           "logits_max_abs_diff": diff, "versions": got["versions"]}
    print(f"export: transformers loads {out['hf_class']}; same prompt ids: {out['ids_equal']}; "
          f"logits max |diff| {diff:.2e}")
    return out


# ---------------------------------------------------------------------------------------------- comparisons


def sft_common(steps: int) -> list[str]:
    return ["--batch-size", "4", "--seq-len", "512", "--max-steps", str(steps), "--lr", str(OPT["lr"]),
            "--warmup-steps", str(OPT["warmup"]), "--min-lr-ratio", "0.1", "--schedule", "cosine",
            "--val-fraction", "0", "--workers", "1", *COMMON_FLAGS]


def compare_sft(args, run: Path, hf: Path, work: Path) -> dict:
    data = Path(args.sft_data) if args.sft_data else data_path("minimind/sft_zh_alpaca_gpt4_demo.jsonl")
    steps = args.steps or 30
    _, _, ours_rss = nanoforge("sft", "--init", str(run), "--data", str(data), "--out", str(work / "ours-sft"),
                               *sft_common(steps), "--quiet")
    ours = our_steps(work / "ours-sft")
    tokens = sum(r["supervised_tokens_per_s"] * t for r, t in zip(ours["recs"], ours["step_s"]))
    theirs, trl_rss = trl(args.trl_python, work, "sft", hf_dir=str(hf), data=str(data), steps=steps, batch=4,
                          seq_len=512, **OPT)
    return {"steps": steps, "data": str(data),
            "nanoforge": {"supervised_tokens_per_s": tokens / sum(ours["step_s"]), "step_s": ours["step_s_median"],
                          "peak_rss_mb": ours_rss, "loss_first_last": _first_last(metrics(work / "ours-sft")),
                          "phases_ms": our_phases(work / "ours-sft")},
            "trl": {"supervised_tokens_per_s": theirs["supervised_tokens_per_s"], "step_s": theirs["step_s_median"],
                    "peak_rss_mb": trl_rss, "loss_first_last": [theirs["losses"][0], theirs["losses"][-1]],
                    "phases_ms": theirs["phases_ms"]}}


def _first_last(recs: list[dict]) -> list[float]:
    return [recs[0]["loss"], recs[-1]["loss"]] if recs else []


def compare_dpo(args, run: Path, hf: Path, work: Path) -> dict:
    """4 pairs a step over 4 x steps pairs, so both reference passes cover the same pairs (and only those)."""
    steps = args.steps or 10
    src = Path(args.dpo_data) if args.dpo_data else data_path("tiny/dpo_tiny.jsonl")
    data = work / "dpo-pairs.jsonl"
    data.write_text("".join(src.read_text(encoding="utf-8").splitlines(keepends=True)[:4 * steps]), encoding="utf-8")
    lines, _, ours_rss = nanoforge("dpo", "--init", str(run), "--data", str(data), "--out", str(work / "ours-dpo"),
                                   "--beta", "0.1", *sft_common(steps))
    started = next(t for t, line in lines if "reference log-probs for train: computing" in line)
    ref_s = next(t for t, line in lines if line.startswith("dpo train:")) - started
    ours = our_steps(work / "ours-dpo")
    theirs, trl_rss = trl(args.trl_python, work, "dpo", hf_dir=str(hf), data=str(data), steps=steps, batch=4,
                          seq_len=512, beta=0.1, **OPT)
    return {"steps": steps, "pairs": 4 * steps, "data": str(src),
            "nanoforge": {"pairs_per_s": 4 / ours["step_s_median"], "step_s": ours["step_s_median"],
                          "ref_pass_s": ref_s, "peak_rss_mb": ours_rss,
                          "loss_first_last": _first_last(metrics(work / "ours-dpo")), "phases_ms": our_phases(work / "ours-dpo")},
            "trl": {"pairs_per_s": theirs["pairs_per_s"], "step_s": theirs["step_s_median"], "ref_pass_s": theirs["ref_s"],
                    "peak_rss_mb": trl_rss, "loss_first_last": [theirs["losses"][0], theirs["losses"][-1]],
                    "phases_ms": theirs["phases_ms"]}}


def grpo_setup(args, work: Path) -> dict:
    """grpo_arithmetic's data and SFT model (done once for every repeat), exported; its held-out accuracy."""
    task = work / "arith"
    sft_file, prompts, held = arith.write_data(task, 12, 8)
    sft_run = arith.sft_model(task, sft_file, args.arith_sft_steps)
    hf = task / "sft-hf"
    nanoforge("export", str(sft_run), "--out", str(hf), "--force")
    return {"sft_run": sft_run, "hf": hf, "prompts": prompts, "held": held,
            "before": arith.greedy_accuracy(sft_run, held)}


def compare_grpo(args, task: dict, work: Path) -> dict:
    """Each tool's GRPO from grpo_setup's SFT model; held-out greedy accuracy by one scorer."""
    steps, prompts, held = args.steps or 20, task["prompts"], task["held"]
    _, _, ours_rss = nanoforge(
        "grpo", "--init", str(task["sft_run"]), "--data", str(prompts), "--out", str(work / "ours-grpo"),
        "--loss", "grpo", "--loss-norm", "sequence", "--advantage", "zscore", "--num-generations", "8",
        "--prompts-per-step", "8", "--beta", "0", "--epsilon", "0.2", "--temperature", "1", "--max-new-tokens", "6",
        "--ppo-epochs", "1", "--reward", "math", "--max-steps", str(steps), "--lr", "3e-5", "--schedule", "constant",
        "--warmup-steps", "0", *COMMON_FLAGS, "--quiet")
    recs, phases = metrics(work / "ours-grpo"), our_phases(work / "ours-grpo", replies=64)
    theirs, trl_rss = trl(args.trl_python, work, "grpo", hf_dir=str(task["hf"]), data=str(prompts), steps=steps,
                          prompts=8, generations=8, max_new_tokens=6, temperature=1.0, beta=0.0, lr=3e-5,
                          warmup=0, schedule="constant", schedule_kwargs={}, save=str(work / "trl-grpo-model"))
    return {"steps": steps, "held_out": len(held), "accuracy_before": task["before"],
            "nanoforge": {"step_s": phases["step"] / 1e3 if phases else None, "peak_rss_mb": ours_rss,
                          "accuracy_after": arith.greedy_accuracy(work / "ours-grpo", held),
                          "reward_first_last": _ends([r.get("reward_mean") for r in recs]), "phases_ms": phases},
            "trl": {"step_s": theirs["step_s_median"], "peak_rss_mb": trl_rss,
                    "accuracy_after": arith.greedy_accuracy(work / "trl-grpo-model", held),
                    "reward_first_last": _ends(theirs["rewards"]), "phases_ms": theirs["phases_ms"]}}


def _ends(values: list) -> list:
    return [values[0], values[-1]] if values else []


def roundtrip(args, run: Path, hf: Path, work: Path) -> dict:
    """export -> TRL SFT (assistant_only_loss) -> TRL saves -> nanoforge generate/chat/eval -> export again."""
    from safetensors.torch import load_file

    data = Path(args.sft_data) if args.sft_data else data_path("tiny/sft_tiny.jsonl")
    saved = work / "trl-sft-model"
    theirs, _ = trl(args.trl_python, work, "sft", tag="roundtrip-sft", hf_dir=str(hf), data=str(data),
                    steps=args.roundtrip_steps, batch=4, seq_len=512, save=str(saved), **OPT)
    out = {"trl_sft_losses": theirs["losses"], "supervised_tokens": theirs["supervised_tokens"]}
    lines, _, _ = nanoforge("generate", str(saved), "--prompt", "Once upon a time", "--max-new-tokens", "8",
                            "--temperature", "0")
    out["generate"] = lines[-1][1] if lines else ""
    chat = subprocess.run([sys.executable, "-m", "nanoforge", "chat", str(saved), "--temperature", "0",
                           "--max-new-tokens", "8"], input="你好\n", capture_output=True, text=True, env=ENV, cwd=REPO)
    out["chat_rc"], out["chat"] = chat.returncode, chat.stdout.strip()[-200:]
    lines, _, _ = nanoforge("eval", str(saved), "--data", str(data))
    out["eval"] = next((line.split()[-1] for _, line in lines if line.startswith("loss")), None)
    again = work / "trl-sft-reexport"
    nanoforge("export", str(saved), "--out", str(again), "--force")
    a, b = load_file(str(saved / "model.safetensors")), load_file(str(again / "model.safetensors"))
    out["reexport_same_tensors"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out["parity_after_trl"] = parity(args, saved, saved, work)
    return out


# ------------------------------------------------------------------------------------------------- report


def show(name: str, result: dict) -> None:
    print(f"\n== {name} ==")
    print(json.dumps({k: v for k, v in result.items() if k not in ("nanoforge", "trl")}, ensure_ascii=False))
    for tool in ("nanoforge", "trl"):
        if tool in result:
            print(f"  {tool:10s} " + "  ".join(f"{k} {_fmt(v)}" for k, v in result[tool].items()))


def show_mapping(name: str) -> None:
    for what, pair in MAPPING.get(name, []):
        print(f"  mapping {what}: {pair}")
    if name in UNMATCHED:
        print(f"  not matched: {UNMATCHED[name]}")


RATIOS = ("supervised_tokens_per_s", "pairs_per_s", "step_s", "ref_pass_s", "peak_rss_mb")  # speed and memory
PHASES = {"rollout": "data (GRPO: rollout)", "generation": "  of it: generation", "fwd_bwd": "forward+backward",
          "optim": "optimizer (clip, step, zero_grad)", "other": "other (log, bookkeeping)", "step": "step"}


def summarise(runs: list[dict]) -> dict:
    """Per tool: each number's median, min and max over the runs, and the median ms/step of each phase over the
    runs' medians; the nanoforge/TRL ratio of the medians of the speed and memory figures."""
    out = {}
    for tool in ("nanoforge", "trl"):
        keys = [k for k, v in runs[0][tool].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        values = {k: [r[tool][k] for r in runs] for k in keys}
        out[tool] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in values.items()}
        phases = [r[tool]["phases_ms"] for r in runs if r[tool].get("phases_ms")]
        out[tool]["phases_ms"] = {k: statistics.median(p[k] for p in phases) for k in phases[0]} if phases else {}
    out["ratio"] = {k: out["nanoforge"][k]["median"] / out["trl"][k]["median"] for k in RATIOS
                    if k in out["nanoforge"] and k in out["trl"]}
    return out


def show_summary(name: str, summary: dict, n: int) -> None:
    print(f"\n== {name}: medians of {n} run(s) [min-max] ==")
    print(f"  {'figure':24s} {'nanoforge':>26s} {'TRL':>26s} {'nanoforge/TRL':>14s}")
    ours, theirs = summary["nanoforge"], summary["trl"]
    for key in [k for k in ours if k != "phases_ms"]:
        ratio = f"{summary['ratio'][key]:.3g}" if key in summary["ratio"] else ""
        print(f"  {key:24s} {_spread(ours.get(key)):>26s} {_spread(theirs.get(key)):>26s} {ratio:>14s}")
    print(f"  {'phase (ms/step, median)':36s} {'nanoforge':>12s} {'TRL':>12s}")
    for key, label in PHASES.items():
        if key in ours["phases_ms"] or key in theirs["phases_ms"]:
            print(f"  {label:36s} {_ms(ours['phases_ms'].get(key)):>12s} {_ms(theirs['phases_ms'].get(key)):>12s}")
    show_mapping(name)


def _spread(s: dict | None) -> str:
    return f"{_fmt(s['median'])} [{_fmt(s['min'])}-{_fmt(s['max'])}]" if s else "-"


def _ms(v: float | None) -> str:
    return f"{v:,.1f}" if v is not None else "-"


def repeat(name: str, job, n: int, work: Path) -> dict:
    """job(its own work dir) n times, one after the other (each run: nanoforge, then TRL); every run and the
    summary."""
    runs = []
    for i in range(n):
        sub = work / f"{name}-{i + 1}"
        sub.mkdir()
        start = time.perf_counter()
        runs.append({**job(sub), "wall_s": time.perf_counter() - start})
        show(f"{name}, run {i + 1} of {n}", runs[-1])
    summary = summarise(runs)
    show_summary(name, summary, n)
    return {"runs": runs, **summary}


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trl-python", default=os.environ.get("NANOFORGE_TRL_PYTHON", "TRLVENV/bin/python"),
                    help="the interpreter of TRL's venv (default: $NANOFORGE_TRL_PYTHON)")
    ap.add_argument("--data", help="folder holding tiny/ and minimind/ (default: $NANOFORGE_DATA)")
    ap.add_argument("--init", help="a nanoforge run to compare on (default: pretrain a small one)")
    ap.add_argument("--only", choices=["sft", "dpo", "grpo", "roundtrip"])
    ap.add_argument("--repeat", type=int, default=1, help="runs of each comparison (medians and spread printed)")
    ap.add_argument("--steps", type=int, help="steps of each comparison (default: sft 30, dpo 10, grpo 20)")
    ap.add_argument("--sft-data", help="SFT JSONL (default: minimind/sft_zh_alpaca_gpt4_demo.jsonl; roundtrip: "
                                       "tiny/sft_tiny.jsonl)")
    ap.add_argument("--dpo-data", help="DPO JSONL (default: tiny/dpo_tiny.jsonl)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--pretrain-steps", type=int, default=100)
    ap.add_argument("--arith-sft-steps", type=int, default=400, help="grpo_arithmetic's SFT steps")
    ap.add_argument("--roundtrip-steps", type=int, default=3)
    ap.add_argument("--work", default="runs/vs_trl", help="work directory (replaced)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.data:
        os.environ["NANOFORGE_DATA"] = ENV["NANOFORGE_DATA"] = args.data
    if not Path(args.trl_python).is_file():
        sys.exit(f"{args.trl_python}: no such interpreter; make TRL's venv first (see this script's docstring)")
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    results = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
               "versions": {**trl(args.trl_python, work, "versions")[0]["versions"], "nanoforge_torch": torch.__version__}}
    print("versions: " + json.dumps(results["versions"]))
    if args.only != "grpo":
        run, hf = base_model(args, work)
        results["export"] = parity(args, run, hf, work)
    jobs = {"sft": lambda sub: compare_sft(args, run, hf, sub), "dpo": lambda sub: compare_dpo(args, run, hf, sub)}
    if args.only in (None, "grpo"):
        task = grpo_setup(args, work)
        jobs["grpo"] = lambda sub: compare_grpo(args, task, sub)
    for name, job in jobs.items():
        if args.only in (None, name):
            results[name] = repeat(name, job, args.repeat, work)
    if args.only in (None, "roundtrip"):
        start = time.perf_counter()
        results["roundtrip"] = {**roundtrip(args, run, hf, work), "wall_s": time.perf_counter() - start}
        show("roundtrip", results["roundtrip"])
    results["mapping"] = {k: dict(v) for k, v in MAPPING.items()}
    results["not_matched"] = UNMATCHED
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
