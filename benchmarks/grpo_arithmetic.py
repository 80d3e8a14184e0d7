"""RL's learning demonstration: a tiny model SFT'd to answer `a+b=` / `a*b=` wrongly about half the time is
trained with `nanoforge grpo --reward math` until its greedy answers are right.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/grpo_arithmetic.py [--loss grpo|cispo|reinforce] [--steps 100]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/grpo_arithmetic.py --algo ppo [--steps 200]

1. Data: every `a+b=` (a, b < --add-max) and `a*b=` (a, b < --mul-max) prompt. The SFT set holds each prompt twice,
   once with the right answer and once with a systematic slip (a zero too many: "19" -> "190"), so the SFT
   model's greedy answer is right for about half of the prompts.
2. SFT: a tokenizer trained on the data, the tiny shape (128 wide, 4 layers), `sft` until it has learned both.
3. RL: `grpo` (`ppo` with --algo ppo) on 80% of the prompts (chat-shaped, "answer" the right result), the
   other 20% held out of RL; greedy accuracy on the held-out prompts before and after, and the mean reward of each step.

Prints the before/after accuracies, the reward curve and the RL stage's wall time (docs/rl.md has a run).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import statistics
import time
from pathlib import Path

import torch

from nanoforge.core.config import build_config
from nanoforge.data.prepare import prepare_dataset
from nanoforge.infer.generate import SamplingConfig, complete
from nanoforge.weights.load import load_model
from nanoforge.model.gpt import GPT
from nanoforge.recipes.grpo import RLOptions, grpo
from nanoforge.recipes.ppo import PPOOptions, ppo
from nanoforge.rl.rewards import answer_number
from nanoforge.data.sources import train_tokenizer
from nanoforge.weights import checkpoint as ckpt
from nanoforge.recipes.sft import sft

QUIET = dict(log=lambda *a: None)


def wrong_reply(answer: int) -> str:
    """The wrong half of the SFT replies: the right digits with a slip, a zero too many ("12+7=" -> "190"). One
    systematic habit, as real models have: GRPO finds that such replies score 0 and unlearns the habit for
    every prompt, the held-out ones too (a wrong answer that differed per prompt could only be fixed prompt by
    prompt, on the prompts RL sees)."""
    return f"{answer}0" if answer else "1"


def problems(add_max: int, mul_max: int) -> list[tuple[str, int]]:
    """Every (prompt, right answer) of the two tables."""
    out = [(f"{a}+{b}=", a + b) for a in range(add_max) for b in range(add_max)]
    return out + [(f"{a}*{b}=", a * b) for a in range(mul_max) for b in range(mul_max)]


def chat(prompt: str, reply: str | None = None) -> dict:
    turns = [{"role": "user", "content": prompt}]
    return {"conversations": turns + ([{"role": "assistant", "content": reply}] if reply is not None else [])}


def write_data(work: Path, add_max: int, mul_max: int, seed: int = 0, held_out: float = 0.2):
    """SFT JSONL (each prompt right and with the slip), RL prompts JSONL and the held-out (prompt, answer) list."""
    work.mkdir(parents=True, exist_ok=True)
    items = problems(add_max, mul_max)
    random.Random(seed).shuffle(items)
    n_held = max(1, int(len(items) * held_out))
    held, train = items[:n_held], items[n_held:]
    with open(work / "sft.jsonl", "w") as f:
        for prompt, answer in items:
            for reply in (str(answer), wrong_reply(answer)):
                f.write(json.dumps(chat(prompt, reply)) + "\n")
    with open(work / "prompts.jsonl", "w") as f:
        for prompt, answer in train:
            f.write(json.dumps({**chat(prompt), "answer": str(answer)}) + "\n")
    return work / "sft.jsonl", work / "prompts.jsonl", held


def sft_model(work: Path, sft_file: Path, steps: int = 400, d_model: int = 128, layers: int = 4,
              lr: float = 3e-3, seed: int = 0) -> Path:
    """A tokenizer on the data, a random tiny model, then SFT on sft_file: the run directory."""
    tok = train_tokenizer([sft_file], vocab_size=320, out_dir=work / "tokenizer")
    prepare_dataset("sft", [sft_file], tok, work / "sft", val_fraction=0.0, workers=1, **QUIET)
    _random_base(work / "base", tok, d_model, layers, seed)
    sft(str(work / "base"), [str(work / "sft")], work / "run", quiet=True,
        overrides={"seed": seed, "max_steps": steps, "lr": lr, "warmup_steps": 10, "seq_len": 128, "batch_size": 16,
                   "eval_every": 0, "save_every": 0, "tensorboard": False, "precision": "fp32", "sample_every": 0,
                   "min_lr_ratio": 0.1})
    return work / "run"


def _random_base(out: Path, tok, d_model: int, layers: int, seed: int = 0) -> None:
    """A randomly initialised run (config, tokenizer, one checkpoint) for sft --init."""
    mcfg, _ = build_config("tiny", None, {"vocab_size": tok.vocab_size, "d_model": d_model, "max_seq_len": 128,
                                         "n_layers": layers})
    torch.manual_seed(seed)
    tok.save(out / "tokenizer")
    ckpt.save_checkpoint(out, 0, GPT(mcfg).state_dict_for_save(), {},
                         {"config": {"model": dataclasses.asdict(mcfg), "train": {"seq_len": 128}}})


def greedy_accuracy(run: Path, items: list[tuple[str, int]]) -> float:
    """Share of prompts whose greedy reply's number is the right answer."""
    model, tok, _ = load_model(run)
    ids = [tok.render_chat(chat(p)["conversations"], add_generation_prompt=True)[0] for p, _ in items]
    got = complete(model, tok, ids, SamplingConfig(temperature=0, max_new_tokens=8), stop_ids=[tok.im_end_id])
    return sum(answer_number(c.text) == a for c, (_, a) in zip(got, items)) / len(items)


def reward_curve(run: Path) -> list[float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["reward_mean"] for r in recs if "reward_mean" in r]


def phase_seconds(run: Path) -> dict[str, float]:
    """The loop's own clock, summed over the steps (log_every is 1): rollout (the batch source: generation,
    scoring, reference log-probs), forward + backward, optimizer step."""
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {k: sum(r.get(f"{k}_ms", 0.0) for r in recs) / 1e3 for k in ("data", "fwd_bwd", "optim")}


def run_rl(sft_run: Path, prompts_file: Path, out: Path, loss: str, steps: int, **kw) -> float:
    """`grpo --reward math` from the SFT run; its wall time in seconds. kw: generations, prompts (per step),
    beta, ppo_epochs, lr, seed."""
    options = RLOptions(loss=loss, num_generations=kw.get("generations", 8), prompts_per_step=kw.get("prompts", 8),
                        beta=kw.get("beta", 0.0), temperature=1.0, max_new_tokens=6, reward="math",
                        ppo_epochs=kw.get("ppo_epochs", 1))
    start = time.perf_counter()
    grpo(str(sft_run), str(prompts_file), out, options, quiet=True,
         overrides={"max_steps": steps, "lr": kw.get("lr", 3e-5), "save_every": 0, "tensorboard": False,
                    "precision": "fp32", "seed": kw.get("seed", 0)})
    return time.perf_counter() - start


def run_ppo(sft_run: Path, prompts_file: Path, out: Path, steps: int, **kw) -> float:
    """`ppo --reward math` from the SFT run; its wall time in seconds."""
    options = PPOOptions(num_generations=kw.get("generations", 1), prompts_per_step=kw.get("prompts", 64),
                         beta=kw.get("beta", 0.0), temperature=1.0, max_new_tokens=6, reward="math",
                         ppo_epochs=kw.get("ppo_epochs", 2),
                         **{k: kw[k] for k in ("target_kl", "lam", "vf_coef") if kw.get(k) is not None})
    start = time.perf_counter()
    ppo(str(sft_run), str(prompts_file), out, options, quiet=True,
        overrides={"max_steps": steps, "lr": kw.get("lr", 1e-4), "save_every": 0, "tensorboard": False,
                   "precision": "fp32", "seed": kw.get("seed", 0)})
    return time.perf_counter() - start


def one_run(args, work: Path, seed: int) -> dict:
    """SFT, accuracy before, the RL stage, accuracy after, for one seed (model init, SFT order, RL sampling)."""
    shutil.rmtree(work, ignore_errors=True)
    sft_file, prompts, held = write_data(work, args.add_max, args.mul_max)  # the same held-out split every seed
    start = time.perf_counter()
    run = sft_model(work, sft_file, args.sft_steps, seed=seed)
    print(f"seed {seed}: sft {time.perf_counter() - start:.0f} s; {len(held)} held-out prompts", flush=True)
    before = greedy_accuracy(run, held)
    name, rl = ("ppo", run_ppo) if args.algo == "ppo" else (args.loss, run_rl)
    grpo_only = {} if args.algo == "ppo" else {"loss": args.loss}
    seconds = rl(run, prompts, work / f"rl-{name}", steps=args.steps, lr=args.lr, ppo_epochs=args.ppo_epochs,
                 beta=args.beta, prompts=args.prompts_per_step, generations=args.num_generations, seed=seed,
                 **grpo_only)
    curve = reward_curve(work / f"rl-{name}")
    tenth = max(1, len(curve) // 10)
    out = {"seed": seed, "before": before, "after": greedy_accuracy(work / f"rl-{name}", held), "seconds": seconds,
           "phases": phase_seconds(work / f"rl-{name}"),
           "tenths": [sum(curve[i:i + tenth]) / len(curve[i:i + tenth]) for i in range(0, len(curve), tenth)]}
    p = out["phases"]
    print(f"seed {seed}: {args.steps} steps in {seconds:.1f} s ({seconds / args.steps:.3f} s/step; loop clock: "
          f"rollout {p['data']:.1f} s, forward+backward {p['fwd_bwd']:.1f} s, optimizer {p['optim']:.1f} s)\n"
          f"seed {seed}: mean reward per tenth of the run: {' '.join(f'{r:.2f}' for r in out['tenths'])}\n"
          f"seed {seed}: greedy accuracy on held-out prompts: {before:.1%} -> {out['after']:.1%}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algo", default="grpo", choices=["grpo", "ppo"], help="the RL stage")
    ap.add_argument("--loss", default="grpo", choices=["grpo", "cispo", "reinforce"], help="grpo's loss")
    ap.add_argument("--steps", type=int, help="RL steps (default 100 grpo, 200 ppo)")
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--lr", type=float, help="RL learning rate (AdamW, constant; default 3e-5 grpo, 5e-5 ppo)")
    ap.add_argument("--ppo-epochs", type=int, help="updates per rollout (default 1 grpo, 2 ppo)")
    ap.add_argument("--beta", type=float, default=0.0, help="KL weight (grpo: k3 loss term; ppo: reward penalty)")
    ap.add_argument("--prompts-per-step", type=int, help="prompts per rollout (default 8 grpo, 64 ppo)")
    ap.add_argument("--num-generations", type=int, help="replies per prompt (default 8 grpo, 1 ppo)")
    ap.add_argument("--add-max", type=int, default=12)
    ap.add_argument("--mul-max", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    ap.add_argument("--runs", type=int, default=1, help="runs, seeds --seed, --seed + 1, ...; medians printed")
    ap.add_argument("--work", default="runs/grpo_arithmetic", help="work directory (replaced)")
    args = ap.parse_args()
    ppo_ = args.algo == "ppo"
    args.steps = args.steps or (200 if ppo_ else 100)
    args.lr, args.ppo_epochs = args.lr or (5e-5 if ppo_ else 3e-5), args.ppo_epochs or (2 if ppo_ else 1)
    args.prompts_per_step = args.prompts_per_step or (64 if ppo_ else 8)
    args.num_generations = args.num_generations or (1 if ppo_ else 8)
    work = Path(args.work)
    runs = [one_run(args, work / f"seed{s}" if args.runs > 1 else work, s)
            for s in range(args.seed, args.seed + args.runs)]
    if args.runs > 1:
        def med(values, fmt):
            return f"{fmt(statistics.median(values))} (spread {fmt(min(values))}-{fmt(max(values))})"
        pct, sec = "{:.1%}".format, "{:.1f} s".format
        print(f"median of {args.runs}: greedy accuracy {med([r['before'] for r in runs], pct)} -> "
              f"{med([r['after'] for r in runs], pct)}; RL stage {med([r['seconds'] for r in runs], sec)}")


if __name__ == "__main__":
    main()
