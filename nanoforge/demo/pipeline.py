"""`nanoforge demo`: the whole pipeline, on the CPU, in under five minutes, on a corpus every machine already has:
the docstrings of standard-library modules (demo/corpus.py), as pretraining documents and SFT conversations.

What a model of about a million parameters learns in three minutes of two CPU cores shapes all of it: the
corpus is small (about 450 KB), so pretraining reads it several times over; an answer is one sentence (the
docstring's first) or a signature; and the SFT set is a thousand of them, trained on until memorised. The
questions asked at the end are scored by demo/score.py. The training steps are sized from steps of the training
loop timed on the machine at hand (demo/sizing.py), so that the whole run fits `minutes`. This module runs the
stages in order and writes the report."""
from __future__ import annotations

import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from nanoforge.core.config import build_config
from nanoforge.core.durations import format_duration
from nanoforge.core.errors import NanoforgeError
from nanoforge.data.batches import EvalBatches, SFTBatches
from nanoforge.data.prepare import prepare_dataset
from nanoforge.data.shards import TokenShards
from nanoforge.data.sources import train_tokenizer
from nanoforge.demo.corpus import DEMO_MODULES, build_demo_corpus
from nanoforge.demo.score import ask, print_replies, score_line, score_replies
from nanoforge.demo.sizing import (MAX_PRETRAIN_EPOCHS, MAX_SFT_EPOCHS, RESERVE_S, DemoSizing, size_pretraining,
                                   size_sft)
from nanoforge.model.gpt import GPT
from nanoforge.recipes.pretrain import pretrain
from nanoforge.recipes.sft import sft
from nanoforge.report.markdown import write_report
from nanoforge.report.runs import read_run
from nanoforge.train.loop import evaluate
from nanoforge.train.objectives import causal_lm_loss
from nanoforge.weights.load import load_model

# How big each part of a run is. "full" is what `nanoforge demo` runs; "test" is the same pipeline shrunk to
# finish in well under a minute (the end-to-end test). Steps of None are sized from the time budget.
SCALES = {
    "full": dict(sft_size=1000, vocab_size=2048, preset="demo", precision=None, pretrain_steps=None,
                 sft_steps=None, sft_lr=3e-3, max_new_tokens=64),
    "test": dict(sft_size=120, vocab_size=512, preset="tiny", precision="fp32", pretrain_steps=60, sft_steps=40,
                 sft_lr=3e-3, max_new_tokens=32),
}
VAL_FRACTION = 0.02  # of documents and of conversations (every 50th; the asked ones come first and stay in)
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
        torch.set_num_threads(threads)  # the sizing may have chosen fewer for training


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

    mcfg, tcfg, sizing = _prepare_stage(clock, work_dir, s, tokenizer, deadline, facts, quiet)
    pre_run = _pretrain_stage(clock, work_dir, s, mcfg, tcfg, sizing, facts, quiet)
    sft_run = _sft_stage(clock, work_dir, s, pre_run, mcfg, tcfg, sizing, deadline, facts, quiet)

    clock.stage("chat", f"asking {len(questions)} questions (greedy decoding, stop at <|im_end|>) and scoring "
                        "the replies")
    samples = ask(sft_run, questions, s["max_new_tokens"])
    if not quiet:
        print_replies(samples)
    facts["score"] = score_line(score_replies(samples))
    facts["closed"] = sum(x["finish_reason"] == "stop" for x in samples)
    clock.done(f"{facts['closed']}/{len(samples)} replies ended with <|im_end|>")

    clock.stage("report", "writing the report")
    report = _write_demo_report(work_dir, [pre_run, sft_run], samples, mcfg, sizing, s, facts, clock)
    clock.done()
    pre, post = facts["pre_loss"], facts["sft_loss"]
    _say(f"\nscore: {facts['score']}\npretraining validation loss {pre['start']:.3f} -> {pre['end']:.3f}; SFT "
         f"{post['start']:.3f} -> {post['end']:.3f}; {facts['closed']}/{len(samples)} replies closed with "
         f"<|im_end|>; whole demo {format_duration(clock.elapsed())}\nreport: {report}", quiet)
    return report


def _prepare_stage(clock: _Clock, work_dir: Path, s: dict, tokenizer, deadline: float, facts: dict, quiet: bool):
    """Both sets tokenized into shards, the configs, and the pretraining sizing (measured; its thread count is
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
    sizing = size_pretraining(mcfg, tcfg, budget, s["precision"], s["pretrain_steps"], MAX_PRETRAIN_EPOCHS * epoch)
    torch.set_num_threads(sizing.threads)
    facts["params"] = GPT(mcfg).num_params()
    clock.done(f"measured {sizing.note}")
    return mcfg, tcfg, sizing


def _pretrain_stage(clock: _Clock, work_dir: Path, s: dict, mcfg, tcfg, sizing: DemoSizing, facts: dict,
                    quiet: bool) -> Path:
    pre_data, pre_run = work_dir / "data" / "pretrain", work_dir / "pretrain"
    # the validation loss of the weights pretraining starts from (same seed): the "before" of its validation losses
    val = EvalBatches(TokenShards(pre_data, "val"), tcfg.batch_size, tcfg.seq_len, tcfg.eval_batches)
    torch.manual_seed(tcfg.seed)
    start = evaluate(GPT(mcfg), val, causal_lm_loss, torch.device("cpu"), sizing.precision)[0]
    epochs = sizing.pretrain_steps * tcfg.batch_size * tcfg.seq_len / TokenShards(pre_data, "train").num_tokens
    facts["pre_epochs"] = epochs
    clock.stage("pretrain", f"pretraining a {facts['params'] / 1e6:.2f}M-parameter GPT ({s['preset']} preset, "
                            f"{sizing.precision}, {tcfg.optimizer}) for {sizing.pretrain_steps} steps (~{epochs:.1f} "
                            f"epochs; validation loss before training: {start:.3f})")
    pretrain([str(pre_data)], pre_run, preset=s["preset"], quiet=quiet,
             overrides={"device": "cpu", "precision": sizing.precision, "vocab_size": mcfg.vocab_size,
                        "max_steps": sizing.pretrain_steps})
    facts["pre_loss"] = _losses(pre_run, start)
    clock.done(f"validation loss {_loss_note(facts['pre_loss'])}")
    return pre_run


def _sft_stage(clock: _Clock, work_dir: Path, s: dict, pre_run: Path, mcfg, tcfg, sizing: DemoSizing, deadline: float,
               facts: dict, quiet: bool) -> Path:
    """Fine-tune with pretraining's optimizer, schedule and batch shape, for the time that is left."""
    sft_data, sft_run = work_dir / "data" / "sft", work_dir / "sft"
    # the pretrained model's loss on the held-out answers (the batches SFT evaluates on): SFT's "before"
    model, tokenizer, _ = load_model(pre_run)
    val = SFTBatches(TokenShards(sft_data, "val"), tcfg.batch_size, tcfg.seq_len, shuffle=False,
                     pad_id=tokenizer.pad_id)
    start = evaluate(model, val.eval_batches(tcfg.eval_batches), causal_lm_loss, torch.device("cpu"),
                     sizing.precision)[0]
    steps = s["sft_steps"]
    rows = SFTBatches(TokenShards(sft_data, "train"), tcfg.batch_size, tcfg.seq_len).sequences_per_epoch
    measured = ""
    if steps is None:  # SFT gets the time that is left
        steps, measured = size_sft(mcfg, tcfg, sizing, clock.timings["pretrain"],
                                   deadline - time.perf_counter() - RESERVE_S, MAX_SFT_EPOCHS * rows / tcfg.batch_size)
        measured = f"; measured again: {measured}"
    epochs = steps * tcfg.batch_size / rows
    clock.stage("sft", f"fine-tuning on the {facts['convs']} question/answer conversations for {steps} steps "
                       f"(~{epochs:.1f} epochs; validation loss on the answers before: {start:.3f}{measured})")
    keep = ("optimizer", "muon_lr", "schedule", "decay_fraction", "min_lr_ratio", "batch_size", "eval_every",
            "eval_batches")
    sft(str(pre_run), [str(sft_data)], sft_run, quiet=quiet,
        overrides={**{k: getattr(tcfg, k) for k in keep}, "device": "cpu", "precision": sizing.precision,
                   "max_steps": steps, "lr": s["sft_lr"], "warmup_steps": min(20, steps // 5), "save_every": 0,
                   "keep_last": 1})
    facts.update(sft_loss=_losses(sft_run, start), sft_steps=steps, sft_epochs=epochs, sft_measured=measured)
    clock.done(f"validation loss on the answers {_loss_note(facts['sft_loss'])}")
    return sft_run


def _write_demo_report(work_dir: Path, runs: list[Path], samples: list[dict], mcfg, sizing: DemoSizing, s: dict,
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
               f"- Pretraining validation loss after {sizing.pretrain_steps} steps: {_loss_note(facts['pre_loss'])};"
               f" ln(vocab) = {math.log(mcfg.vocab_size):.3f} is a uniform guess. The corpus is read "
               f"~{facts['pre_epochs']:.1f} times: a training loss below the validation loss is the model "
               f"memorising it, which is what the questions ask of it.\n"
               f"- SFT validation loss (answer tokens of conversations held out of SFT) after "
               f"{facts['sft_steps']} steps (~{facts['sft_epochs']:.1f} epochs): {_loss_note(facts['sft_loss'])}"
               f"{facts['sft_measured']}.\n"
               f"- Replies that closed with <|im_end|> (greedy, at most {s['max_new_tokens']} tokens): "
               f"**{facts['closed']}/{len(samples)}**.\n"
               f"- Precision and threads, by measurement: {sizing.note}.\n"
               f"- Stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in clock.timings.items()) +
               f"; total {format_duration(clock.elapsed())}.")
    return write_report(runs, work_dir / "report.md", samples=samples, title="nanoforge demo", preamble=summary)
