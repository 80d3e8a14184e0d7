"""Stages: the recipes. Each opens its run directory (train/rundir.py), builds its batches, model and objective,
and hands them to the one loop (train/loop.py): pretrain, sft (and lora), dpo, distill, and lora merge.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Sequence

import torch

from nanoforge.config import PRESETS, ModelConfig, TrainConfig, build_config, config_dicts
from nanoforge.data.batches import EvalBatches, PretrainBatches, SFTBatches
from nanoforge.data.dpo import DPOBatches, count_pairs, reference_logps
from nanoforge.data.shards import TokenShards, check_tokenizer
from nanoforge.data.sources import data_kind
from nanoforge.device import resolve_device
from nanoforge.errors import NanoforgeError
from nanoforge.infer.generate import SamplingConfig
from nanoforge.infer.samples import generate_samples, load_prompts, write_samples
from nanoforge.model.gpt import GPT
from nanoforge.weights.load import (adapter_metadata, check_base, init_tokenizer_dir, init_weights, load_adapter_checkpoint,
                              load_model)
from nanoforge.model.lora import LoraConfig, LoraModel
from nanoforge.train.microbatch import fit_micro_batch
from nanoforge.report.markdown import write_run_report
from nanoforge.tokenizer import load_tokenizer
from nanoforge.weights import checkpoint as ckpt
from nanoforge.train.distributed import main_first, setup, world
from nanoforge.train.loop import Stage, TrainingInterrupted, train
from nanoforge.train.objectives import causal_lm_loss, dpo_loss, make_distill_loss
from nanoforge.train.rundir import (check_resume_options, check_same_origin, copy_tokenizer, finetune_setup,
                                    fit_vocab, fresh_run_guard, open_run, resolve_data, saved_data_dir,
                                    saved_run_info, write_run_config)


SAMPLE_MAX_TOKENS = 48


def seeded_gpt(mcfg: ModelConfig, tcfg: TrainConfig) -> GPT:
    """The run's GPT after seeding: --seed fixes the draws no checkpoint overwrites (LoRA's A, PPO's value head)."""
    torch.manual_seed(tcfg.seed)
    return GPT(mcfg)


def sample_prompts(tcfg: TrainConfig) -> list[str] | None:
    """The prompts of --sample-prompts, read and checked now, so a missing or malformed file stops the run
    before any work (the error names the file and line); None means the built-in set."""
    return load_prompts(tcfg.sample_prompts) if tcfg.sample_prompts else None


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


def train_and_report(stage: Stage, model, mcfg: ModelConfig, tcfg: TrainConfig, run_dir: Path, resume: bool,
                     quiet: bool) -> dict[str, Any]:
    """The loop, then RUN/report.md (rank 0; a report failure is a warning, never a failed run). A run stopped
    by SIGINT/SIGTERM gets the report of its steps so far, after its checkpoint and before it exits."""
    if tcfg.epochs:
        steps_from_epochs(stage.train_batches, tcfg, quiet)
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


@fresh_run_guard
def pretrain(data: Sequence[str], out: str | Path, preset: str | None = None, config_file: str | None = None,
             overrides: dict[str, Any] | None = None, resume: bool = False, tokenizer: str | None = None,
             quiet: bool = False, init: str | None = None) -> dict[str, Any]:
    """`nanoforge pretrain`: packed next-token prediction on a token stream, from random weights, or with
    `init` from a trained model (continued pretraining: its shape and tokenizer, a fresh optimizer)."""
    saved = saved_run_info(out) if resume else {}
    init_path = None
    if init or saved.get("init"):  # continued pretraining: the fine-tuning plumbing, TrainConfig's defaults
        if preset:
            raise NanoforgeError("--preset with --init: the model's shape comes from --init; drop --preset")
        if tokenizer:
            raise NanoforgeError("--tokenizer with --init: the tokenizer is --init's; drop --tokenizer")
        run_dir, mcfg, tcfg, run_info, init_path, tok, data_dir = finetune_setup(
            "pretrain", init, data, out, config_file, dict(overrides or {}), resume, quiet, {})
        prompts = sample_prompts(tcfg)
    else:
        run_dir, mcfg, tcfg, saved_run, explicit = open_run(out, resume, preset, config_file, overrides or {})
        prompts = sample_prompts(tcfg)  # a bad prompts file stops the run before data is prepared
        data_dir = saved_data_dir(saved_run, run_dir) if resume and saved_run.get("data") and not data else \
            resolve_data("pretrain", data, run_dir, tokenizer, mcfg, tcfg, quiet)
        tok = load_tokenizer(data_dir / "tokenizer")
        fit_vocab(mcfg, tok, explicit)
        fit_micro_batch(mcfg, tcfg)  # --micro-batch auto|N: before any batch source is sized
        run_info = {"stage": "pretrain", "data": str(data_dir.resolve()), "tokenizer": "tokenizer"}
    batches, val_batches, val_bpt = lm_batches(data_dir, tcfg, tok, quiet, need="pretrain")
    if init_path is None:
        copy_tokenizer(data_dir / "tokenizer", run_dir)
        write_run_config(run_dir, mcfg, tcfg, run_info)
    model = seeded_gpt(mcfg, tcfg)
    if init_path is not None and not resume:
        model.load_weights(init_weights(init_path))
    stage = Stage("pretrain", batches, causal_lm_loss, val_batches, val_bpt, run_info,
                  sampler=make_sampler(run_dir, tcfg, tok, prompts, chat=False))
    return train_and_report(stage, model, mcfg, tcfg, run_dir, resume, quiet)


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


LORA_DEFAULTS = {**SFT_DEFAULTS, "lr": 1e-4}  # adapters start at zero and tolerate a larger step (MiniMind's too)


@fresh_run_guard
def sft(init: str | None, data: Sequence[str], out: str | Path, config_file: str | None = None,
        overrides: dict[str, Any] | None = None, resume: bool = False, quiet: bool = False,
        lora=None) -> dict[str, Any]:
    """`nanoforge sft` (and `nanoforge lora`, with a LoraConfig): next-token loss on assistant replies only,
    conversations packed without padding. With LoRA only the adapters train and checkpoints hold only them,
    with a reference (path, sha256, fingerprint) to the base they belong to."""
    if resume and saved_run_info(out).get("stage") == "lora":
        lora = LoraConfig.from_dict(saved_run_info(out))
    name = "lora" if lora else "sft"
    run_dir, mcfg, tcfg, run_info, init_path, tok, data_dir = finetune_setup(
        name, init, data, out, config_file, dict(overrides or {}), resume, quiet,
        LORA_DEFAULTS if lora else SFT_DEFAULTS, lora.to_dict() if lora else None)
    prompts = sample_prompts(tcfg)
    batches, val_batches, _ = lm_batches(data_dir, tcfg, tok, quiet, need="sft")
    model = seeded_gpt(mcfg, tcfg)
    if lora:
        base_weights = init_weights(init_path)  # every time: the checkpoints hold adapters only
        if resume:
            check_base(run_info, init_path)
        else:
            run_info.update(adapter_metadata(init_path, base_weights))
            write_run_config(run_dir, mcfg, tcfg, run_info)
        model.load_weights(base_weights)
        model = LoraModel(model, lora)
    elif not resume:
        model.load_weights(init_weights(init_path))
    stage = Stage(name, batches, causal_lm_loss, val_batches, None, run_info,
                  sampler=make_sampler(run_dir, tcfg, tok, prompts, chat=True))
    return train_and_report(stage, model, mcfg, tcfg, run_dir, resume, quiet)


def lora_merge(run: str | Path, out: str | Path) -> Path:
    """`nanoforge lora merge`: fold a LoRA run's adapters into its base and write a plain run directory
    (config, tokenizer, one checkpoint) that chat, export and further training read like any other."""
    src = ckpt.resolve_checkpoint(run)
    state = ckpt.load_state(src)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise NanoforgeError(f"{out} exists and is not empty; choose another --out")
    model = load_adapter_checkpoint(src)
    cfg = state.get("config", {})
    mcfg, tcfg = build_config(None, None, None, base={"model": cfg.get("model", {}), "train": cfg.get("train", {})})
    run_info = {"stage": "lora-merge", "merged_from": str(src.resolve()), "tokenizer": "tokenizer"}
    copy_tokenizer(init_tokenizer_dir(src), out)
    write_run_config(out, mcfg, tcfg, run_info)
    ckpt.save_checkpoint(out, state["step"], model.state_dict_for_save(), {},
                         {"stage": "lora-merge", "config": config_dicts(mcfg, tcfg), "run": run_info,
                          "run_state": {"step": state["step"]}, "data": {}})
    return out


# MiniMind's DPO default (lr 4e-8) leaves the loss at log 2 (its users' reports); measured on the tiny preset,
# held-out margin and accuracy move from lr 1e-4 up (see docs/perf.md). The SFT rate is a safe middle here.
DPO_BETA = 0.1  # strength of the pull towards the reference
DPO_DEFAULTS = {**SFT_DEFAULTS, "lr": 5e-5, "warmup_steps": 10, "max_steps": 300, "batch_size": 8}


@fresh_run_guard
def dpo(init: str | None, data: Sequence[str], out: str | Path, config_file: str | None = None,
        overrides: dict[str, Any] | None = None, resume: bool = False, beta: float | None = None,
        quiet: bool = False) -> dict[str, Any]:
    """`nanoforge dpo`: direct preference optimisation on chosen/rejected pairs. The reference model is the
    --init model; its log-probabilities are computed once, before training, and cached in the run."""
    if resume:
        check_resume_options(Path(out), {"beta": ("--beta", beta)})
        beta = saved_run_info(out).get("beta", beta)
    beta = DPO_BETA if beta is None else beta
    run_dir, mcfg, tcfg, run_info, init_path, tok, data_dir = finetune_setup(
        "dpo", init, data, out, config_file, dict(overrides or {}), resume, quiet, DPO_DEFAULTS, {"beta": beta})
    prompts = sample_prompts(tcfg)
    train_shards, val_shards = TokenShards(data_dir, "train"), TokenShards(data_dir, "val")
    if train_shards.kind != "dpo":
        raise NanoforgeError(f"{data_dir}: prepared as {train_shards.kind!r} data; dpo needs chosen/rejected "
                             f"pairs (`nanoforge prepare --kind dpo`)")
    # The reference is the initial policy, whatever step we resume at: rebuild it from --init.
    reference = GPT(mcfg)
    reference.load_weights(init_weights(init_path))
    device = setup(resolve_device(tcfg.device))  # under torchrun: this rank's GPU
    reference.to(device).eval()
    log = (lambda *a: None) if quiet else print
    with main_first(device):  # under torchrun rank 0 computes and caches; the others load the cache
        ref = {split: reference_logps(reference, shards, run_dir, tcfg.batch_size * 2, tcfg.seq_len,
                                      tcfg.precision, device, pad_id=tok.pad_id, log=log)
               for split, shards in (("train", train_shards), ("val", val_shards)) if shards.num_docs}
    model = reference if not resume else GPT(mcfg)  # the policy starts as the reference (train() moves it)
    if resume:
        del reference
    w = world()
    batches = DPOBatches(train_shards, ref["train"], tcfg.batch_size, tcfg.seq_len, tcfg.seed, w.rank, w.world_size,
                         pad_id=tok.pad_id)
    log(f"dpo train: {batches.summary()}")
    val_batches = None
    if "val" in ref:
        val = DPOBatches(val_shards, ref["val"], tcfg.batch_size, tcfg.seq_len, shuffle=False, pad_id=tok.pad_id)
        val_batches = lambda: val.eval_batches(tcfg.eval_batches)  # noqa: E731
    stage = Stage("dpo", batches, functools.partial(dpo_loss, beta=beta), val_batches, None, run_info,
                  count_fn=count_pairs, sampler=make_sampler(run_dir, tcfg, tok, prompts, chat=True))
    return train_and_report(stage, model, mcfg, tcfg, run_dir, resume, quiet)


DISTILL_TEMPERATURE, DISTILL_ALPHA = 1.5, 0.5  # softening of both distributions; weight of the data's own loss


@fresh_run_guard
def distill(teacher: str | None, init: str | None, data: Sequence[str], out: str | Path,
            config_file: str | None = None, overrides: dict[str, Any] | None = None, resume: bool = False,
            temperature: float | None = None, alpha: float | None = None, quiet: bool = False) -> dict[str, Any]:
    """`nanoforge distill`: train a student (a run, or a fresh model of a preset) to match a teacher's
    softened distributions on the data's supervised positions, mixed with the data's own cross-entropy."""
    overrides = dict(overrides or {})
    if resume:
        saved = saved_run_info(out)
        check_same_origin(Path(out), "--teacher", teacher, saved.get("teacher"))
        check_resume_options(Path(out), {"temperature": ("--temperature", temperature), "alpha": ("--alpha", alpha)})
        teacher = saved.get("teacher", teacher)
        temperature, alpha = saved.get("temperature", temperature), saved.get("alpha", alpha)
    temperature = DISTILL_TEMPERATURE if temperature is None else temperature
    alpha = DISTILL_ALPHA if alpha is None else alpha
    if not teacher:
        raise NanoforgeError("--teacher is required: the run or checkpoint to distill from")
    teacher_model, teacher_tok, teacher_path = load_model(teacher)
    teacher_model.eval().requires_grad_(False)
    options = {"teacher": str(teacher_path.resolve()), "temperature": temperature, "alpha": alpha}
    loss = make_distill_loss(teacher_model, temperature, alpha)

    def probe_loss(model, batch):
        """--micro-batch auto probes with the real objective: the teacher's weights and logits take room too.
        (A student of another vocabulary is refused below, with the reason; the probe just skips the teacher.)"""
        if model.cfg.vocab_size != teacher_model.cfg.vocab_size:
            return causal_lm_loss(model, batch)
        teacher_model.to(batch["input_ids"].device)
        return loss(model, batch)

    if not resume and init in PRESETS:
        # a fresh student of a preset's shape, speaking the teacher's tokenizer
        run_dir, mcfg, tcfg, _, explicit = open_run(out, False, init, config_file, overrides)
        fit_vocab(mcfg, teacher_tok, explicit)
        fit_micro_batch(mcfg, tcfg, loss_fn=probe_loss)  # --micro-batch auto|N: before any batch source is sized
        data_dir = resolve_data(data_kind(data), data, run_dir, str(init_tokenizer_dir(teacher_path)),
                                mcfg, tcfg, quiet)
        check_tokenizer(data_dir, teacher_tok)
        run_info = {"stage": "distill", "init": f"preset:{init}", "tokenizer": "tokenizer",
                    "data": str(data_dir.resolve()), **options}
        copy_tokenizer(init_tokenizer_dir(teacher_path), run_dir)
        write_run_config(run_dir, mcfg, tcfg, run_info)
        tok, init_path = teacher_tok, None
    else:
        run_dir, mcfg, tcfg, run_info, init_path, tok, data_dir = finetune_setup(
            "distill", init, data, out, config_file, overrides, resume, quiet, SFT_DEFAULTS, options, probe_loss)
        if str(run_info["init"]).startswith("preset:"):  # resuming a student that began as a preset
            init_path = None
    if tok.sha256 != teacher_tok.sha256:
        raise NanoforgeError(f"the student's tokenizer ({tok.sha256[:12]}, {tok.vocab_size} tokens) is not the "
                             f"teacher's ({teacher_tok.sha256[:12]}, {teacher_tok.vocab_size} tokens): "
                             f"distillation compares distributions token by token, so they must be the same")
    if mcfg.vocab_size != teacher_model.cfg.vocab_size:
        raise NanoforgeError(f"student vocab_size {mcfg.vocab_size} differs from the teacher's "
                             f"{teacher_model.cfg.vocab_size}")
    prompts = sample_prompts(tcfg)
    batches, val_batches, val_bpt = lm_batches(data_dir, tcfg, tok, quiet)
    model = seeded_gpt(mcfg, tcfg)
    if not resume and init_path is not None:
        model.load_weights(init_weights(init_path))
    # setup(): under torchrun cuda:LOCAL_RANK (plain "cuda" is cuda:0 on every rank until setup has run, e.g.
    # on `distill --resume` without --data, where nothing else called it yet)
    teacher_model.to(setup(resolve_device(tcfg.device)))
    # samples speak the way the data does: chat turns for conversation data, plain text for pretraining text
    stage = Stage("distill", batches, loss, val_batches, None, run_info,
                  sampler=make_sampler(run_dir, tcfg, tok, prompts, chat=batches.shards.kind == "sft"))
    return train_and_report(stage, model, mcfg, tcfg, run_dir, resume, quiet)
