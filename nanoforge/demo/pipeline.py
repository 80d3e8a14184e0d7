"""`nanoforge demo`: the whole pipeline, on the CPU, in under five minutes, on a corpus every machine already has:
the docstrings of standard-library modules (demo/corpus.py), as pretraining documents and SFT conversations.

What a model of about a million parameters learns in three minutes of two CPU cores shapes all of it: the
corpus is small (about 450 KB), so pretraining reads it several times over; an answer is one sentence (the
docstring's first) or a signature; and the SFT set is a thousand of them, trained on until memorised. The
questions asked at the end are scored by score_replies. The training steps are sized from a measured step
time so the whole run fits `minutes` on the machine at hand."""
from __future__ import annotations

import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoforge.core.config import build_config
from nanoforge.data.batches import EvalBatches, SFTBatches
from nanoforge.data.prepare import prepare_dataset
from nanoforge.data.shards import TokenShards
from nanoforge.demo.corpus import DEMO_MODULES, build_demo_corpus
from nanoforge.core.device import autocast_context
from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.generate import SamplingConfig, complete
from nanoforge.weights.load import load_model
from nanoforge.model.gpt import GPT
from nanoforge.report.markdown import read_run, write_report
from nanoforge.data.sources import train_tokenizer
from nanoforge.train.loop import evaluate
from nanoforge.train.metrics import format_duration
from nanoforge.train.objectives import causal_lm_loss
from nanoforge.train.optim import build_optimizer
from nanoforge.recipes.pretrain import pretrain
from nanoforge.recipes.sft import sft

# -------------------------------------------------------------------------------------------------- scoring

def held_out_hit(reply: str, keywords: list[str]) -> bool:
    """Whether the reply names one of the keywords as a word of its own, in any case ("JSON" names json). A
    "call" question's keywords leave out the module, since its reply starts by repeating the name from the
    question; one-letter and private arguments ("s", "_nil") are left out too: they name nothing."""
    return any(re.search(rf"(?<!\w){re.escape(k)}(?!\w)", reply, re.IGNORECASE) for k in keywords)


def score_replies(samples: list[dict]) -> dict:
    """in_set: replies equal to the expected answer. held_out: replies that name a keyword of their question
    (held_out_hit), and held_out_exact. chance: what held_out would be for replies that know nothing about
    their question, its mean over random pairings of replies and questions: for each held-out question, the
    share of the other questions' replies that hit its keywords, summed."""
    in_set = [s for s in samples if not s["held_out"]]
    held = [s for s in samples if s["held_out"]]
    chance = sum(sum(held_out_hit(o["reply"], s["keywords"]) for o in samples if o is not s) / (len(samples) - 1)
                 for s in held) if len(samples) > 1 else 0.0
    return {"in_set": sum(s["reply"] == s["expected"] for s in in_set), "in_set_n": len(in_set),
            "held_out": sum(held_out_hit(s["reply"], s["keywords"]) for s in held), "held_out_n": len(held),
            "held_out_exact": sum(s["reply"] == s["expected"] for s in held), "chance": chance}


def score_line(score: dict) -> str:
    return (f"in-set {score['in_set']}/{score['in_set_n']} exact first sentence or signature; held-out "
            f"{score['held_out']}/{score['held_out_n']} name the module or an argument (chance "
            f"{score['chance']:.1f}/{score['held_out_n']}), {score['held_out_exact']}/{score['held_out_n']} exact")


# -------------------------------------------------------------------------------------------------- the run

# How big each part of a run is. "full" is what `nanoforge demo` runs; "test" is the same pipeline shrunk to
# finish in well under a minute (the end-to-end test). Steps of None are sized from the time budget.
SCALES = {
    "full": dict(sft_size=1000, vocab_size=2048, preset="demo", precision=None, pretrain_steps=None,
                 sft_steps=None, sft_lr=3e-3, max_new_tokens=64),
    "test": dict(sft_size=120, vocab_size=512, preset="tiny", precision="fp32", pretrain_steps=60, sft_steps=40,
                 sft_lr=3e-3, max_new_tokens=32),
}
VAL_FRACTION = 0.02  # of documents and of conversations (every 50th; the asked ones come first and stay in)
# Share of the training time for pretraining when the budget, not MAX_*_EPOCHS, limits the run; SFT gets the
# rest. SFT on a well-pretrained model is quick to memorise its answers (its training loss is below 0.3 within
# 50 steps), while the names and signatures it asks for have to be read many times in pretraining first.
PRETRAIN_SHARE = 0.65
# A step inside the training loop costs more than the bare step measure_step_seconds times: batches read from the
# shards, gradient clipping, logging, the stage's start-up (measured: 660 steps in 79 s, 0.120 s each, 0.100 bare).
LOOP_OVERHEAD = 1.25
# Seconds kept back from the budget for what follows training: loading, the chat replies, the report, and
# each stage's start-up (TensorBoard, the MFU matmul probe, the final checkpoint). Measured: ~20 s here.
RESERVE_S = 20.0
MIN_STEPS = 50
# Enough (measured by step count, the machine's load aside): pretraining 600 steps (~9 epochs) then SFT 300
# (~14 epochs) answered 13/13 in-set questions exactly and named the module or an argument in 6/6 held-out
# replies; 1200 + 650 steps scored no better (13/13, 5/6) and only overfitted more; 300 + 150 steps, what a
# busy machine may leave, still 11/13 and 4/6. A quiet machine stops at these caps, well under the budget.
MAX_PRETRAIN_EPOCHS, MAX_SFT_EPOCHS = 10, 15
DEMO_MARKER = ".nanoforge-demo"  # marks a directory the demo made, and may therefore wipe


def _say(text: str, quiet: bool) -> None:
    if not quiet:
        print(text, flush=True)


class _Clock:
    """Stage headers and timings: `[4/7] pretraining ...`, then `done in 171.3 s (total 3m30s)`."""

    def __init__(self, total_stages: int, quiet: bool):
        self.start = self.stage_start = time.perf_counter()
        self.total, self.index, self.quiet, self.key = total_stages, 0, quiet, ""
        self.timings: dict[str, float] = {}  # seconds per stage, by short name

    def stage(self, key: str, title: str) -> None:
        self.index += 1
        self.key, self.stage_start = key, time.perf_counter()
        _say(f"\n[{self.index}/{self.total}] {title}", self.quiet)

    def done(self, note: str = "") -> None:
        now = time.perf_counter()
        self.timings[self.key] = now - self.stage_start
        _say(f"    done in {now - self.stage_start:.1f} s (total {format_duration(now - self.start)})"
             + (f": {note}" if note else ""), self.quiet)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def fresh_work_dir(work_dir: Path, quiet: bool) -> None:
    """Start from an empty work_dir. A previous demo's directory is wiped; anything else is left alone."""
    if work_dir.exists() and any(work_dir.iterdir()):
        if not (work_dir / DEMO_MARKER).is_file():
            raise NanoforgeError(f"{work_dir} exists and was not made by `nanoforge demo`; remove it or pass "
                                 "another directory (--out)")
        _say(f"removing the previous demo in {work_dir}", quiet)
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / DEMO_MARKER).write_text("made by `nanoforge demo`; the next demo run wipes this directory\n")


def measure_step_seconds(mcfg, tcfg, precision: str, threads: int, steps: int = 5, warmup: int = 2) -> float:
    """Seconds per optimizer step of this model shape on `threads` threads (restored after) on this machine:
    the fastest of `steps` after `warmup` untimed ones (which allocate and pick kernels). The fastest, not the
    median: another program busy for a moment is noise (a slowdown for real is caught after pretraining)."""
    device, before = torch.device("cpu"), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = GPT(mcfg)
        optimizer = build_optimizer(model, tcfg, device)
        ids = torch.randint(0, mcfg.vocab_size, (tcfg.batch_size, tcfg.seq_len))
        batch = {"input_ids": ids, "labels": ids}
        times = []
        for _ in range(warmup + steps):
            t0 = time.perf_counter()
            with autocast_context(device, precision):
                loss_sum, n, _ = causal_lm_loss(model, batch)
            (loss_sum.float() / n).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return min(times[warmup:])
    finally:
        torch.set_num_threads(before)


@dataclass
class Plan:
    precision: str
    threads: int  # torch's intra-op threads for the training stages
    step_s: float  # the bare step time of that precision on that many threads, measured (0: not measured)
    pretrain_steps: int
    note: str  # what was measured, for the log and the report
    thread_options: tuple[int, ...]  # the thread counts to choose from: all of torch's, and one


def plan_pretraining(mcfg, tcfg, budget_s: float, precision: str | None, steps: int | None,
                     most: float = 10**6) -> Plan:
    """Pick the faster precision and thread count by measurement and size pretraining to its share of budget_s
    (at most `most` steps). What the scale fixes is kept."""
    options = tuple(dict.fromkeys((torch.get_num_threads(), 1)))
    if precision and steps:
        return Plan(precision, options[0], 0.0, steps, "steps and precision fixed by the scale", options)
    precisions = (precision,) if precision else ("fp32", "bf16")
    precision, threads, step_s, note = fastest_setting(mcfg, tcfg, precisions, options)
    # validation costs about a third of a training step per batch (forward only), every eval_every steps
    eval_share = tcfg.eval_batches / (3 * tcfg.eval_every)
    if steps is None:
        steps = _round_steps(PRETRAIN_SHARE * budget_s / (step_s * LOOP_OVERHEAD * (1 + eval_share)), most)
    return Plan(precision, threads, step_s, steps, note, options)


def fastest_setting(mcfg, tcfg, precisions: tuple[str, ...], thread_options: tuple[int, ...]):
    """(precision, threads, seconds per step, a note of every timing) of the fastest measured combination.

    bf16 autocast wins on CPUs with AVX512-BF16 or AMX and loses badly on older ones. One thread wins when
    other programs keep the cores busy, since two threads then wait for each other at every operation (on this
    2-core machine with other programs running: 2.5 s per step on two threads, 0.26-0.5 s on one); all of
    them win on a quiet machine (0.11 s against 0.18 s)."""
    timings = {(p, n): measure_step_seconds(mcfg, tcfg, p, n) for p in precisions for n in thread_options}
    precision, threads = min(timings, key=timings.get)
    note = (", ".join(f"{t:.2f} s/step in {p} on {_threads(n)}" for (p, n), t in timings.items())
            + f" -> {precision} on {_threads(threads)}")
    return precision, threads, timings[precision, threads], note


def _threads(n: int) -> str:
    return f"{n} thread" + ("s" if n > 1 else "")


def _round_steps(steps: float, most: float) -> int:
    return int(max(MIN_STEPS, min(most, steps) // 10 * 10))


def ask(run_dir: Path, questions: list[dict], max_new_tokens: int) -> list[dict]:
    """Greedy replies of the fine-tuned model to each question, rendered with the chat template it was
    trained on. finish_reason "stop" means the reply ended where every reply ends (tokenizer.stop_ids: the
    template's <|im_end|>, or end of text) and "length" that it ran on."""
    model, tokenizer, _ = load_model(run_dir)
    prompts = [tokenizer.render_chat([{"role": "user", "content": q["question"]}], add_generation_prompt=True)[0]
               for q in questions]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens)
    completions = complete(model, tokenizer, prompts, cfg, stop_ids=tokenizer.stop_ids)
    return [{**q, "reply": c.text.strip(), "finish_reason": c.finish_reason, "tokens": len(c.token_ids)}
            for q, c in zip(questions, completions)]


def _print_replies(samples: list[dict], quiet: bool) -> None:
    for s in samples:
        named = [k for k in s["keywords"] if held_out_hit(s["reply"], [k])]
        if s["held_out"]:
            verdict = "held out of SFT: " + ("names " + ", ".join(named) if named else "names nothing asked")
        else:
            verdict = "in the SFT set: " + ("exact" if s["reply"] == s["expected"] else "not exact")
        _say(f"\n  Q ({verdict}): {s['question']}\n  A: {s['reply']}\n     [{s['finish_reason']}, "
             f"{s['tokens']} tokens]  expected: {s['expected']}", quiet)


def _losses(run_dir: Path, start: float) -> dict:
    """Validation loss before (`start`), at the end and at its lowest (with the step); last training loss."""
    run = read_run(run_dir)
    best = min(run.val, key=lambda r: r["val_loss"])
    return {"start": start, "end": run.val[-1]["val_loss"], "best": (best["val_loss"], best["step"]),
            "train": run.train[-1]["loss"]}


def _loss_note(losses: dict) -> str:
    return (f"{losses['start']:.3f} -> {losses['end']:.3f} (lowest {losses['best'][0]:.3f} at step "
            f"{losses['best'][1]}; training loss {losses['train']:.3f})")


def run_demo(work_dir: str | os.PathLike = "runs/demo", minutes: float = 5.0, quiet: bool = False,
             scale: str = "full") -> Path:
    """Corpus -> tokenizer -> prepare -> pretrain -> SFT -> questions and score -> report, in a fresh work_dir
    (fresh_work_dir), sized to fit `minutes`; scale="test" runs in well under a minute. Returns report.md."""
    if scale not in SCALES:
        raise NanoforgeError(f"unknown demo scale {scale!r}; choose one of {', '.join(SCALES)}")
    deadline = time.perf_counter() + minutes * 60
    fresh_work_dir(Path(work_dir), quiet)
    _say(f"nanoforge demo in {work_dir}: budget {minutes:g} min, CPU only, nothing downloaded", quiet)
    threads = torch.get_num_threads()
    try:
        return _run_stages(Path(work_dir), SCALES[scale], deadline, quiet)
    finally:
        torch.set_num_threads(threads)  # the plan may have chosen fewer for training


def _run_stages(work_dir: Path, s: dict, deadline: float, quiet: bool) -> Path:
    clock = _Clock(7, quiet)
    clock.stage("corpus", f"building the corpus from the docstrings of {len(DEMO_MODULES)} standard-library "
                          f"modules of Python {sys.version.split()[0]} ({', '.join(DEMO_MODULES[:6])}, ...)")
    pretrain_jsonl, sft_jsonl, questions = build_demo_corpus(work_dir / "corpus", s["sft_size"])
    documents = pretrain_jsonl.read_bytes()  # one record per line
    facts = {"docs": documents.count(b"\n"), "kb": len(documents) / 1e3, "convs": sft_jsonl.read_bytes().count(b"\n")}
    clock.done(f"{facts['docs']} documents ({facts['kb']:.0f} KB), {facts['convs']} question/answer conversations")

    clock.stage("tokenizer", f"training a {s['vocab_size']}-token byte-level BPE tokenizer on the documents")
    tokenizer = train_tokenizer([pretrain_jsonl], vocab_size=s["vocab_size"], out_dir=work_dir / "tokenizer")
    clock.done()

    mcfg, tcfg, plan = _prepare_stage(clock, work_dir, s, tokenizer, deadline, facts, quiet)
    pre_run = _pretrain_stage(clock, work_dir, s, mcfg, tcfg, plan, facts, quiet)
    sft_run = _sft_stage(clock, work_dir, s, pre_run, mcfg, tcfg, plan, deadline, facts, quiet)

    clock.stage("chat", f"asking {len(questions)} questions (greedy decoding, stop at <|im_end|>) and scoring "
                        "the replies")
    samples = ask(sft_run, questions, s["max_new_tokens"])
    _print_replies(samples, quiet)
    facts["score"] = score_line(score_replies(samples))
    facts["closed"] = sum(x["finish_reason"] == "stop" for x in samples)
    clock.done(f"{facts['closed']}/{len(samples)} replies ended with <|im_end|>")

    clock.stage("report", "writing the report")
    report = _write_demo_report(work_dir, [pre_run, sft_run], samples, mcfg, plan, s, facts, clock)
    clock.done()
    pre, post = facts["pre_loss"], facts["sft_loss"]
    _say(f"\nscore: {facts['score']}\npretraining validation loss {pre['start']:.3f} -> {pre['end']:.3f}; SFT "
         f"{post['start']:.3f} -> {post['end']:.3f}; {facts['closed']}/{len(samples)} replies closed with "
         f"<|im_end|>; whole demo {format_duration(clock.elapsed())}\nreport: {report}", quiet)
    return report


def _prepare_stage(clock: _Clock, work_dir: Path, s: dict, tokenizer, deadline: float, facts: dict, quiet: bool):
    """Both sets tokenized into shards, the configs, and the pretraining plan (measured; its thread count is
    set for the rest of the run)."""
    clock.stage("prepare", "tokenizing both sets into shards (2% of each held out for validation), then timing "
                           "a few training steps to size the run")
    log = (lambda *a: None) if quiet else (lambda text: print(f"    {text}", flush=True))
    for kind in ("pretrain", "sft"):
        corpus = work_dir / "corpus" / f"{kind}.jsonl"
        prepare_dataset(kind, [corpus], tokenizer, work_dir / "data" / kind, val_fraction=VAL_FRACTION, log=log)
    mcfg, tcfg = build_config(s["preset"], overrides={"vocab_size": tokenizer.vocab_size, "device": "cpu"})
    budget = deadline - time.perf_counter() - RESERVE_S
    epoch = TokenShards(work_dir / "data" / "pretrain", "train").num_tokens / (tcfg.batch_size * tcfg.seq_len)
    plan = plan_pretraining(mcfg, tcfg, budget, s["precision"], s["pretrain_steps"], MAX_PRETRAIN_EPOCHS * epoch)
    torch.set_num_threads(plan.threads)
    facts["params"] = GPT(mcfg).num_params()
    clock.done(f"measured {plan.note}")
    return mcfg, tcfg, plan


def _pretrain_stage(clock: _Clock, work_dir: Path, s: dict, mcfg, tcfg, plan: Plan, facts: dict, quiet: bool) -> Path:
    pre_data, pre_run = work_dir / "data" / "pretrain", work_dir / "pretrain"
    # the validation loss of the weights pretraining starts from (same seed): the "before" of its validation losses
    val = EvalBatches(TokenShards(pre_data, "val"), tcfg.batch_size, tcfg.seq_len, tcfg.eval_batches)
    torch.manual_seed(tcfg.seed)
    start = evaluate(GPT(mcfg), val, causal_lm_loss, torch.device("cpu"), plan.precision)[0]
    epochs = plan.pretrain_steps * tcfg.batch_size * tcfg.seq_len / TokenShards(pre_data, "train").num_tokens
    facts["pre_epochs"] = epochs
    clock.stage("pretrain", f"pretraining a {facts['params'] / 1e6:.2f}M-parameter GPT ({s['preset']} preset, "
                            f"{plan.precision}, {tcfg.optimizer}) for {plan.pretrain_steps} steps (~{epochs:.1f} "
                            f"epochs; validation loss before training: {start:.3f})")
    pretrain([str(pre_data)], pre_run, preset=s["preset"], quiet=quiet,
             overrides={"device": "cpu", "precision": plan.precision, "vocab_size": mcfg.vocab_size,
                        "max_steps": plan.pretrain_steps})
    facts["pre_loss"] = _losses(pre_run, start)
    clock.done(f"validation loss {_loss_note(facts['pre_loss'])}")
    return pre_run


def _sft_stage(clock: _Clock, work_dir: Path, s: dict, pre_run: Path, mcfg, tcfg, plan: Plan, deadline: float,
               facts: dict, quiet: bool) -> Path:
    """Fine-tune with pretraining's optimizer, schedule and batch shape, for the time that is left."""
    sft_data, sft_run = work_dir / "data" / "sft", work_dir / "sft"
    # the pretrained model's loss on the held-out answers (the batches SFT evaluates on): SFT's "before"
    model, tokenizer, _ = load_model(pre_run)
    val = SFTBatches(TokenShards(sft_data, "val"), tcfg.batch_size, tcfg.seq_len, shuffle=False,
                     pad_id=tokenizer.pad_id)
    start = evaluate(model, val.eval_batches(tcfg.eval_batches), causal_lm_loss, torch.device("cpu"), plan.precision)[0]
    steps = s["sft_steps"]
    rows = SFTBatches(TokenShards(sft_data, "train"), tcfg.batch_size, tcfg.seq_len).sequences_per_epoch
    measured = ""
    if steps is None:
        # SFT gets the time that is left. Its pace: a fresh measurement (the thread count chosen again, since a
        # program that started meanwhile makes two threads many times slower than one) times the loop's
        # overhead over the bare step that pretraining showed (at least LOOP_OVERHEAD). Same batch shape, so
        # the same cost per step (measured: 0.122 s in SFT against 0.120 s in pretraining).
        _, threads, bare, measured = fastest_setting(mcfg, tcfg, (plan.precision,), plan.thread_options)
        torch.set_num_threads(threads)
        pace = clock.timings["pretrain"] / plan.pretrain_steps
        overhead = max(LOOP_OVERHEAD, pace / plan.step_s) if plan.step_s else LOOP_OVERHEAD
        left = deadline - time.perf_counter() - RESERVE_S
        steps = _round_steps(left / (bare * overhead), MAX_SFT_EPOCHS * rows / tcfg.batch_size)
        measured = f"; measured again: {measured}"
    epochs = steps * tcfg.batch_size / rows
    clock.stage("sft", f"fine-tuning on the {facts['convs']} question/answer conversations for {steps} steps "
                       f"(~{epochs:.1f} epochs; validation loss on the answers before: {start:.3f}{measured})")
    keep = ("optimizer", "muon_lr", "schedule", "decay_fraction", "min_lr_ratio", "batch_size", "eval_every",
            "eval_batches")
    sft(str(pre_run), [str(sft_data)], sft_run, quiet=quiet,
        overrides={**{k: getattr(tcfg, k) for k in keep}, "device": "cpu", "precision": plan.precision,
                   "max_steps": steps, "lr": s["sft_lr"], "warmup_steps": min(20, steps // 5), "save_every": 0,
                   "keep_last": 1})
    facts.update(sft_loss=_losses(sft_run, start), sft_steps=steps, sft_epochs=epochs, sft_measured=measured)
    clock.done(f"validation loss on the answers {_loss_note(facts['sft_loss'])}")
    return sft_run


def _write_demo_report(work_dir: Path, runs: list[Path], samples: list[dict], mcfg, plan: Plan, s: dict,
                       facts: dict, clock: _Clock) -> Path:
    summary = (f"The whole pipeline on this machine's CPU: {facts['docs']} documents ({facts['kb']:.0f} KB) of "
               f"docstrings of {len(DEMO_MODULES)} standard-library modules of Python {sys.version.split()[0]}, "
               f"and {facts['convs']} question/answer conversations made from them; a "
               f"{facts['params'] / 1e6:.2f}M-parameter GPT.\n\n"
               f"- **Score: {facts['score']}.** In-set questions are in the SFT set, and a reply counts when it "
               f"equals the answer trained on. Held-out questions are about things no SFT conversation mentions "
               f"(their docstrings are in pretraining only), and a reply counts when it names an argument of the "
               f"function asked about or, for a what-does question, its module; chance is that score for the "
               f"replies to the other questions (its mean over all pairings).\n"
               f"- Pretraining validation loss after {plan.pretrain_steps} steps: {_loss_note(facts['pre_loss'])};"
               f" ln(vocab) = {math.log(mcfg.vocab_size):.3f} is a uniform guess. The corpus is read "
               f"~{facts['pre_epochs']:.1f} times: a training loss below the validation loss is the model "
               f"memorising it, which is what the questions ask of it.\n"
               f"- SFT validation loss (answer tokens of conversations held out of SFT) after "
               f"{facts['sft_steps']} steps (~{facts['sft_epochs']:.1f} epochs): {_loss_note(facts['sft_loss'])}"
               f"{facts['sft_measured']}.\n"
               f"- Replies that closed with <|im_end|> (greedy, at most {s['max_new_tokens']} tokens): "
               f"**{facts['closed']}/{len(samples)}**.\n"
               f"- Precision and threads, by measurement: {plan.note}.\n"
               f"- Stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in clock.timings.items()) +
               f"; total {format_duration(clock.elapsed())}.")
    return write_report(runs, work_dir / "report.md", samples=samples, title="nanoforge demo", preamble=summary)
