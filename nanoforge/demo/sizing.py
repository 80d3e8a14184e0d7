"""How long the demo trains: the precision and thread count that run fastest here, and the steps that fit the
time budget, from steps of the training loop itself timed on this machine."""
from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass

import torch

from nanoforge.model.gpt import GPT
from nanoforge.recipes.bench import RandomTokens, bench_settings
from nanoforge.report.runs import read_run
from nanoforge.train.loop import Stage, train
from nanoforge.train.objectives import causal_lm_loss

# Share of the training time for pretraining when the budget, not MAX_*_EPOCHS, limits the run; SFT gets the
# rest. SFT on a well-pretrained model is quick to memorise its answers (its training loss is below 0.3 within
# 50 steps), while the names and signatures it asks for have to be read many times in pretraining first.
PRETRAIN_SHARE = 0.65
# A stage's step costs more than a timed step: batches read from the shards, the stage's start-up (measured
# against a bare forward+backward+update: 660 steps in 79 s, 0.120 s each, 0.100 bare; the timed step is now the
# loop's own, clipping and logging included, so this is an upper bound, and SFT corrects it from pretraining's pace).
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


def measure_step_seconds(mcfg, tcfg, precision: str, threads: int, steps: int = 5, warmup: int = 2) -> float:
    """Seconds per optimizer step of this model shape on `threads` threads (restored after) on this machine: the
    training loop (train/loop.py) run for `warmup + steps` steps on random tokens, each step's time as the loop
    logs it, the fastest of the last `steps` (the first ones allocate and pick kernels). The fastest, not the
    median: another program busy for a moment is noise (a slowdown for real is caught after pretraining)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    tcfg = dataclasses.replace(tcfg, **bench_settings(steps, warmup), precision=precision, device="cpu")
    try:
        torch.manual_seed(tcfg.seed)
        source = RandomTokens(mcfg.vocab_size, tcfg.batch_size, tcfg.seq_len, seed=tcfg.seed)
        with tempfile.TemporaryDirectory(prefix="nanoforge-demo-timing-") as run_dir:
            train(Stage(name="timing", train_batches=source, loss_fn=causal_lm_loss), GPT(mcfg), mcfg, tcfg,
                  run_dir, quiet=True)
            timed = read_run(run_dir).train[warmup:]
    finally:
        torch.set_num_threads(before)
    tokens = tcfg.batch_size * tcfg.seq_len * tcfg.grad_accum
    return min(tokens / r["tokens_per_s"] for r in timed)


@dataclass
class DemoSizing:
    """The demo's pretraining, sized: not train/plan.py's memory and time estimate of a configuration."""
    precision: str
    threads: int  # torch's intra-op threads for the training stages
    step_s: float  # the loop's step time of that precision on that many threads, measured (0: not measured)
    pretrain_steps: int
    note: str  # what was measured, for the log and the report
    thread_options: tuple[int, ...]  # the thread counts to choose from: all of torch's, and one


def size_pretraining(mcfg, tcfg, budget_s: float, precision: str | None, steps: int | None,
                     most: float = 10**6) -> DemoSizing:
    """Pick the faster precision and thread count by measurement and size pretraining to its share of budget_s
    (at most `most` steps). What the scale fixes is kept."""
    options = tuple(dict.fromkeys((torch.get_num_threads(), 1)))
    if precision and steps:
        return DemoSizing(precision, options[0], 0.0, steps, "steps and precision fixed by the scale", options)
    precisions = (precision,) if precision else ("fp32", "bf16")
    precision, threads, step_s, note = fastest_setting(mcfg, tcfg, precisions, options)
    # validation costs about a third of a training step per batch (forward only), every eval_every steps
    eval_share = tcfg.eval_batches / (3 * tcfg.eval_every)
    if steps is None:
        steps = round_steps(PRETRAIN_SHARE * budget_s / (step_s * LOOP_OVERHEAD * (1 + eval_share)), most)
    return DemoSizing(precision, threads, step_s, steps, note, options)


def size_sft(mcfg, tcfg, sizing: DemoSizing, pretrain_seconds: float, seconds_left: float,
             most: float) -> tuple[int, str]:
    """SFT's steps for the time that is left (at most `most`), and what was measured. Its pace: a fresh measurement
    (the thread count chosen again, since a program that started meanwhile makes two threads many times slower
    than one, and set) times the overhead over the timed step that pretraining showed (at least LOOP_OVERHEAD).
    Same batch shape, so the same cost per step (measured: 0.122 s in SFT against 0.120 s in pretraining)."""
    _, threads, step_s, measured = fastest_setting(mcfg, tcfg, (sizing.precision,), sizing.thread_options)
    torch.set_num_threads(threads)
    pace = pretrain_seconds / sizing.pretrain_steps
    overhead = max(LOOP_OVERHEAD, pace / sizing.step_s) if sizing.step_s else LOOP_OVERHEAD
    return round_steps(seconds_left / (step_s * overhead), most), measured


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


def round_steps(steps: float, most: float) -> int:
    return int(max(MIN_STEPS, min(most, steps) // 10 * 10))
