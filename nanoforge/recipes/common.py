"""What the training recipes share: the initial model, the samples written during training, --epochs as a step
count, the language-model batches (pretrain, sft, lora, distill), SFT's default settings, and the loop followed
by the run's report."""
import math
from pathlib import Path
from typing import Any

import torch

from nanoforge.core.config import ModelConfig, TrainConfig
from nanoforge.data.batches import EvalBatches, PretrainBatches, SFTBatches
from nanoforge.data.shards import TokenShards
from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.generate import SamplingConfig
from nanoforge.infer.samples import generate_samples, write_samples
from nanoforge.model.gpt import GPT
from nanoforge.model.lora import LoraModel
from nanoforge.report.markdown import write_run_report
from nanoforge.train.distributed import world
from nanoforge.train.loop import Stage, TrainingInterrupted, train
from nanoforge.train.rundir import PreparedRun, write_run_config
from nanoforge.weights import checkpoint as ckpt
from nanoforge.weights.load import init_weights

SAMPLE_MAX_TOKENS = 48


def initial_gpt(mcfg: ModelConfig, tcfg: TrainConfig, init_path: Path | None, resume: bool) -> GPT:
    """The run's GPT after seeding (--seed fixes the draws no checkpoint overwrites: LoRA's A, PPO's value head),
    with --init's weights on a fresh start; a resumed run's come from its checkpoint, in the loop."""
    torch.manual_seed(tcfg.seed)
    model = GPT(mcfg)
    if init_path is not None and not resume:
        model.load_weights(init_weights(init_path))
    return model


def make_sampler(run_dir: Path, tcfg: TrainConfig, tokenizer, prompts: list[str] | None, chat: bool):
    """Stage.sampler for the loop, or None when --sample-every is 0. Each call appends to RUN/samples.jsonl
    (with the step), to TensorBoard as text and to wandb as a table. chat=True sends each prompt as a user
    turn through the chat template (SFT-style stages); False continues it as plain text (pretraining)."""
    if not tcfg.sample_every:
        return None

    sampling = SamplingConfig(temperature=0.8, top_p=0.95, max_new_tokens=SAMPLE_MAX_TOKENS, seed=0)

    def sampler(model, step: int, log) -> None:
        # Generation draws from its own seeded generator; saving and restoring the global RNG as well keeps the
        # training stream (dropout, data order) identical with and without samples, so resume stays exact.
        if isinstance(model, LoraModel):  # its GPT carries the adapters in its layers, and is what generate reads
            model = model.gpt
        rng = ckpt.rng_states()
        try:
            got = generate_samples(model, tokenizer, prompts, sampling, chat=chat, precision=tcfg.precision)
        finally:
            ckpt.set_rng_states(rng)
        write_samples(run_dir, got, step)
        log.samples(step, got)
    return sampler


def steps_from_epochs(batches, tcfg: TrainConfig, quiet: bool) -> None:
    """--epochs E: max_steps = ceil(E x sequences per epoch / sequences per step), from the batch source's size
    (windows for pretraining, packed rows for SFT, pairs for DPO) and the global batch of every process."""
    per_step = tcfg.batch_size * tcfg.grad_accum * world().world_size
    n = batches.sequences_per_epoch
    tcfg.max_steps = max(1, math.ceil(tcfg.epochs * n / per_step))
    tcfg.validate()
    if not quiet:
        print(f"epochs {tcfg.epochs:g}: {n:,} sequences per epoch / {per_step:,} per step -> "
              f"{tcfg.max_steps:,} steps", flush=True)


def train_and_report(stage: Stage, model, run: PreparedRun, resume: bool, quiet: bool) -> dict[str, Any]:
    """The loop, then RUN/report.md (rank 0; a report failure is a warning, never a failed run). A run stopped
    by SIGINT/SIGTERM gets the report of its steps so far, after its checkpoint and before it exits."""
    mcfg, tcfg, run_dir = run.mcfg, run.tcfg, run.run_dir
    if tcfg.epochs:
        steps_from_epochs(stage.train_batches, tcfg, quiet)
        if not resume:  # (a resumed run's: once its checkpoint is restored)
            write_run_config(run_dir, mcfg, tcfg, stage.run_info)
    try:
        summary = train(stage, model, mcfg, tcfg, run_dir, resume=resume, quiet=quiet)
    except TrainingInterrupted as e:
        try:
            write_run_report(run_dir, quiet=quiet, stopped=str(e))
        except KeyboardInterrupt:  # a second Ctrl-C skips the report; the exit code stays the first signal's
            pass
        raise
    report = write_run_report(run_dir, quiet=quiet)
    if report is not None:
        summary["report"] = str(report)
    return summary


# Training defaults of a fine-tuning stage, under the preset/--config/--field layers. A pretrained model has
# found its basin; a tenth of the pretraining rate adapts it without wiping what it learned.
SFT_DEFAULTS = {"lr": 5e-5, "warmup_steps": 20, "min_lr_ratio": 0.1, "weight_decay": 0.0, "max_steps": 500,
                "eval_every": 50, "save_every": 200}


def lm_batches(data_dir: Path, tcfg: TrainConfig, tok, quiet: bool, need: str | None = None):
    """Training batches, a validation-batch factory and bytes per token for a pretraining or SFT directory:
    the language-model stages (pretrain, sft, lora, distill) share them. `need`: the one kind the stage takes."""
    w = world()  # under torchrun each rank reads its slice of every step's global batch
    train_shards, val_shards = TokenShards(data_dir, "train"), TokenShards(data_dir, "val")
    if need and train_shards.kind != need:
        raise NanoforgeError(f"{data_dir}: prepared as {train_shards.kind!r} data; this stage needs {need} data "
                             f"(`nanoforge prepare --kind {need}`)")
    if train_shards.kind == "pretrain":
        batches = PretrainBatches(train_shards, tcfg.batch_size, tcfg.seq_len, tcfg.seed, w.rank, w.world_size)
        if val_shards.num_tokens > tcfg.seq_len + 1:
            return (batches, lambda: EvalBatches(val_shards, tcfg.batch_size, tcfg.seq_len, tcfg.eval_batches),
                    val_shards.num_bytes / val_shards.num_tokens)
        if not quiet:
            print(f"note: the validation split of {data_dir} has {val_shards.num_tokens} tokens, fewer than one "
                  f"window of {tcfg.seq_len + 1}; validation is off (raise --val-fraction when preparing)")
        return batches, None, None
    if train_shards.kind == "sft":
        batches = SFTBatches(train_shards, tcfg.batch_size, tcfg.seq_len, tcfg.seed, w.rank, w.world_size,
                             pad_id=tok.pad_id)
        if not quiet:
            print(f"{data_dir.name} train: {batches.report.summary(tcfg.seq_len)}", flush=True)
        if not val_shards.num_docs:
            return batches, None, None
        val = SFTBatches(val_shards, tcfg.batch_size, tcfg.seq_len, shuffle=False, pad_id=tok.pad_id)
        return batches, (lambda: val.eval_batches(tcfg.eval_batches)), None
    raise NanoforgeError(f"{data_dir}: prepared as {train_shards.kind!r} data, which this stage does not train "
                         f"on (use pretrain or sft data)")
