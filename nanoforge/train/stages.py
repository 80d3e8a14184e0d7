"""Stages: each builds a model, a batch source and an objective, then hands them to the one loop.

Also the run-directory plumbing they share: resolving data (prepared directory, or raw JSONL prepared on the
fly into the run), the tokenizer copy, and config.toml.
"""
from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch

from nanoforge import dirlock
from nanoforge.config import (MODEL_FIELDS, PRESETS, ConfigError, ModelConfig, TrainConfig, build_config,
                              config_dicts, config_to_toml, load_toml)
from nanoforge.errors import NanoforgeError
from nanoforge.plan import fit_micro_batch
from nanoforge.train import checkpoint as ckpt
from nanoforge.train.loop import Stage, TrainingInterrupted, train
from nanoforge.train.objectives import causal_lm_loss


RUN_LOCK = ".lock"  # in a run directory: held by the one process training into it (nanoforge/dirlock.py)


def fresh_run_guard(stage_fn):
    """One training process per run directory, and nothing half-written.

    Before anything else the stage takes the run directory's lock (under torchrun only rank 0 takes it, once
    for the run), so a second process on the same --out stops at once, naming the holder, with nothing changed.
    If the stage then fails before training began (bad data, a wrong --init, a config error) in a run
    directory that was empty when this call took it, the directory is removed again."""
    import functools

    from nanoforge.train.distributed import is_main

    @functools.wraps(stage_fn)
    def guarded(*args, **kwargs):
        out = Path(kwargs["out"] if "out" in kwargs else args[list(inspect.signature(stage_fn).parameters).index("out")])
        lock = lock_run_directory(out) if is_main() else None
        existed = out.is_dir() and any(p.name != RUN_LOCK for p in out.iterdir())
        try:
            return stage_fn(*args, **kwargs)
        except BaseException:
            if is_main() and not existed and out.is_dir() and not (out / "metrics.jsonl").exists():
                shutil.rmtree(out, ignore_errors=True)
            raise
        finally:
            if lock is not None:
                lock.release()
    return guarded


def lock_run_directory(out: Path) -> dirlock.DirLock:
    """Create `out` if needed and take its lock (DirectoryBusy names the process that holds it)."""
    if out.exists() and not out.is_dir():
        raise NanoforgeError(f"{out}: exists and is not a directory; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    return dirlock.acquire(out / RUN_LOCK, f"run directory {out}")


def open_run(out: str | Path, resume: bool, preset: str | None, config_file: str | None,
             overrides: dict[str, Any]) -> tuple[Path, ModelConfig, TrainConfig, dict[str, Any], set[str]]:
    """Check the run directory and merge the config. On --resume the saved config is the base and the
    command line may change training fields (e.g. extend --max-steps), never the model's shape."""
    run_dir = Path(out)
    saved = None
    if resume:
        if not (run_dir / "config.toml").is_file():
            raise NanoforgeError(f"--resume: {run_dir} is not a run directory (no config.toml)")
        saved = load_toml(run_dir / "config.toml")
        check_resume_shape(run_dir, saved.get("model", {}), preset, config_file, overrides)
        preset = None  # it asked for the saved shape; its [train] defaults must not undo the run's own settings
    elif ckpt.list_checkpoints(run_dir):  # (a kill during the first save leaves only .tmp-*: a fresh start)
        raise NanoforgeError(f"{run_dir} already holds a run; add --resume to continue it, or choose another --out")
    mcfg, tcfg = build_config(preset, config_file, overrides, base=saved)
    explicit = set(overrides) | set((saved or {}).get("model", {}))
    if config_file:
        explicit |= set(load_toml(config_file).get("model", {}))
    return run_dir, mcfg, tcfg, (saved or {}).get("run", {}), explicit


# Model fields a preset's defaults do not pin on --resume: a fresh run fits vocab_size to the tokenizer, and the
# others do not change the shape. Given explicitly (a flag or a [model] key) they are compared like the rest.
FITTED_OR_REGULARISING = {"vocab_size", "dropout", "moe_aux_weight", "init_std"}


def check_resume_shape(run_dir: Path, saved_model: dict[str, Any], preset: str | None, config_file: str | None,
                       overrides: dict[str, Any]) -> None:
    """--resume accepts the command that started the run: a --preset, a --config [model] or a model flag that
    asks for the saved shape is fine; each real difference is named with its saved and requested values."""
    requested = requested_model_fields(preset, config_file, overrides)
    diffs = [f"{key} saved {saved_model[key]!r}, requested {value!r} (by {source})"
             for key, (value, source) in requested.items() if key in saved_model and saved_model[key] != value]
    if diffs:
        raise NanoforgeError(f"--resume: {run_dir} was trained with another model shape than this command asks "
                             f"for: {'; '.join(diffs)}. A run's shape is fixed: drop or correct those options "
                             "(--resume alone uses the saved config), or choose another --out")


def requested_model_fields(preset: str | None, config_file: str | None,
                           overrides: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """The model fields a command line asks for, each with the option that asked: a preset stands for its whole
    shape (defaults included), then the --config file's [model], then the flags."""
    import dataclasses
    fields: dict[str, tuple[Any, str]] = {}
    if preset:
        explicit = PRESETS[preset]["model"] if preset in PRESETS else {}
        for key, value in dataclasses.asdict(build_config(preset)[0]).items():
            if key in explicit or key not in FITTED_OR_REGULARISING:
                fields[key] = (value, f"--preset {preset}")
    if config_file:
        fields.update({k: (v, f"--config {config_file}") for k, v in load_toml(config_file).get("model", {}).items()})
    fields.update({k: (v, f"--{k.replace('_', '-')}") for k, v in overrides.items() if k in MODEL_FIELDS})
    return fields


def check_same_origin(run_dir: Path, flag: str, given: str | None, saved: str | None) -> None:
    """--resume with the --init (or --teacher) that started the run. The run saved the checkpoint it resolved
    then; the same run directory given again may hold newer checkpoints since, and still names that one."""
    if not given or not saved:
        return
    if saved.startswith("preset:"):
        same = given == saved.split(":", 1)[1]
    else:
        given_path, saved_path = Path(given).resolve(), Path(saved)
        same = given_path == saved_path or given_path in saved_path.parents
    if not same:
        raise NanoforgeError(f"--resume: {run_dir} started from {flag} {saved} (its config.toml), but this command "
                             f"gives {flag} {given}; drop {flag} (the run keeps its own) or give the same one")


def check_resume_options(run_dir: Path, requested: dict[str, tuple[str, Any]]) -> None:
    """--resume with the stage's own options ({[run] key: (flag, value)}; None where the flag was not given):
    the saved value is kept, an equal one is fine, a different one is an error naming both."""
    path = Path(run_dir) / "config.toml"
    saved = load_toml(path).get("run", {}) if path.is_file() else {}
    diffs = [f"{flag} saved {saved[key]!r}, requested {value!r}" for key, (flag, value) in requested.items()
             if value is not None and key in saved and saved[key] != value]
    if diffs:
        raise NanoforgeError(f"--resume: {run_dir} was started with other options: {'; '.join(diffs)}. A run keeps "
                             "its own: drop them (--resume alone uses the saved ones), or choose another --out")


def fit_vocab(mcfg: ModelConfig, tokenizer, explicit: set[str]) -> None:
    """The embedding is as large as the tokenizer unless the user sized it (never smaller)."""
    if "vocab_size" not in explicit:
        mcfg.vocab_size = tokenizer.vocab_size
    elif mcfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"vocab_size={mcfg.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")


def resolve_data(kind: str, data: Sequence[str], run_dir: Path, tokenizer_path: str | None, mcfg: ModelConfig,
                 tcfg: TrainConfig, quiet: bool) -> Path:
    """A prepared directory is used as is; raw JSONL files are prepared into RUN/data (once)."""
    from nanoforge.train.distributed import main_first
    with main_first(_device(tcfg)):  # under torchrun rank 0 prepares; the others then find RUN/data ready
        return _resolve_data(kind, data, run_dir, tokenizer_path, mcfg, tcfg, quiet)


def _device(tcfg: TrainConfig) -> torch.device:
    from nanoforge.train.loop import resolve_device
    return resolve_device(tcfg.device)


def _resolve_data(kind: str, data: Sequence[str], run_dir: Path, tokenizer_path: str | None, mcfg: ModelConfig,
                  tcfg: TrainConfig, quiet: bool) -> Path:
    from nanoforge.data.shards import prepare_dataset
    from nanoforge.tokenizer import load_tokenizer, train_tokenizer

    if not data:
        raise NanoforgeError("--data is required: a prepared directory or one or more JSONL files")
    paths = [Path(p) for p in data]
    if len(paths) == 1 and (paths[0] / "manifest.json").is_file():
        return paths[0]
    for p in paths:
        if p.is_dir():
            raise NanoforgeError(f"{p}: a directory without manifest.json; give JSONL files or a directory "
                                 f"made by `nanoforge prepare`")
    target = run_dir / "data"
    if (target / "manifest.json").is_file():
        return target
    if tokenizer_path:
        tokenizer = load_tokenizer(tokenizer_path)
    else:
        log = (lambda *a: None) if quiet else print
        log(f"no --tokenizer given: training a {mcfg.vocab_size}-token BPE tokenizer on the data")
        tokenizer = train_tokenizer(paths, vocab_size=mcfg.vocab_size, out_dir=run_dir / "tokenizer")
    prepare_dataset(kind, paths, tokenizer, target, val_fraction=tcfg.val_fraction, workers=tcfg.workers,
                    log=(lambda *a: None) if quiet else print)
    return target


def saved_data_dir(run_info: dict[str, Any], run_dir: Path) -> Path:
    """The prepared data a run trained on (config.toml's [run] data), for --resume without --data."""
    path = Path(run_info["data"])
    if not (path / "manifest.json").is_file():
        raise NanoforgeError(f"--resume: {run_dir} trained on {path} (config.toml, [run] data), which is not a "
                             f"prepared data directory any more; give --data with the same data's new location")
    return path


def write_run_config(run_dir: Path, mcfg: ModelConfig, tcfg: TrainConfig, run_info: dict[str, Any]) -> None:
    from nanoforge.train.distributed import is_main
    run_dir.mkdir(parents=True, exist_ok=True)
    if not is_main():  # under torchrun only rank 0 writes the run directory
        return
    tmp = run_dir / "config.toml.tmp"
    tmp.write_text(config_to_toml(mcfg, tcfg, {"run": run_info}), encoding="utf-8")
    tmp.replace(run_dir / "config.toml")


def copy_tokenizer(src: Path, run_dir: Path) -> None:
    from nanoforge.train.distributed import is_main
    dst = run_dir / "tokenizer"
    if src.resolve() == dst.resolve() or not is_main():
        return
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


# Samples during training (--sample-every N): the same prompts at every N steps show what the model has learnt
# so far. Fixed-seed sampling (as `nanoforge eval --samples`), so successive samples differ only by the weights.
SAMPLE_MAX_TOKENS = 48


def sample_prompts(tcfg: TrainConfig) -> list[str] | None:
    """The prompts of --sample-prompts, read and checked now, so a missing or malformed file stops the run
    before any work (the error names the file and line); None means the built-in set."""
    if not tcfg.sample_prompts:
        return None
    from nanoforge.evaluate import load_prompts
    return load_prompts(tcfg.sample_prompts)


def make_sampler(run_dir: Path, tcfg: TrainConfig, tokenizer, prompts: list[str] | None, chat: bool):
    """Stage.sampler for the loop, or None when --sample-every is 0. Each call appends to RUN/samples.jsonl
    (with the step), to TensorBoard as text and to wandb as a table. chat=True sends each prompt as a user
    turn through the chat template (SFT-style stages); False continues it as plain text (pretraining)."""
    if not tcfg.sample_every:
        return None
    from nanoforge.evaluate import generate_samples, write_samples
    from nanoforge.infer.generate import SamplingConfig

    sampling = SamplingConfig(temperature=0.8, top_p=0.95, max_new_tokens=SAMPLE_MAX_TOKENS, seed=0)

    def sampler(model, step: int, log) -> None:
        # Generation draws from its own seeded generator; saving and restoring the global RNG as well keeps the
        # training stream (dropout, data order) identical with and without samples, so resume stays exact.
        from nanoforge.model.lora import LoraModel
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
    import math
    from nanoforge.train.distributed import world
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
    from nanoforge.report import write_run_report
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
    from nanoforge.model.gpt import GPT
    from nanoforge.tokenizer import load_tokenizer

    saved = load_toml(Path(out) / "config.toml").get("run", {}) if resume and (Path(out) / "config.toml").is_file() \
        else {}
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
    batches, val_batches, val_bpt = lm_batches(data_dir, tcfg, tok, quiet)
    if batches.shards.kind != "pretrain":
        raise NanoforgeError(f"{data_dir}: prepared as {batches.shards.kind!r} data, "
                             f"but pretrain needs --kind pretrain")
    if init_path is None:
        copy_tokenizer(data_dir / "tokenizer", run_dir)
        write_run_config(run_dir, mcfg, tcfg, run_info)
    torch.manual_seed(tcfg.seed)  # the initial weights are part of what the seed fixes
    model = GPT(mcfg)
    if init_path is not None and not resume:
        model.load_weights(init_weights(init_path))
    stage = Stage("pretrain", batches, causal_lm_loss, val_batches, val_bpt, run_info,
                  sampler=make_sampler(run_dir, tcfg, tok, prompts, chat=False))
    return train_and_report(stage, model, mcfg, tcfg, run_dir, resume, quiet)


# Training defaults of a fine-tuning stage, under the preset/--config/--field layers. A pretrained model has
# found its basin; a tenth of the pretraining rate adapts it without wiping what it learned.
SFT_DEFAULTS = {"lr": 5e-5, "warmup_steps": 20, "min_lr_ratio": 0.1, "weight_decay": 0.0, "max_steps": 500,
                "eval_every": 50, "save_every": 200}


def init_config(init: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint (or HF model directory) --init points at, and the config it was trained with."""
    import dataclasses
    from nanoforge.export import is_hf_dir, model_config_from_hf, read_hf_config
    from nanoforge.train import checkpoint as ckpt
    if is_hf_dir(init):
        path = Path(init)
        m = model_config_from_hf(read_hf_config(path), path / "config.json")
        return path, {"model": dataclasses.asdict(m), "train": {"seq_len": min(512, m.max_seq_len)}}
    path = ckpt.resolve_checkpoint(init)
    return path, ckpt.load_state(path).get("config", {})


def init_tokenizer_dir(init_path: Path) -> Path:
    from nanoforge.export import is_hf_dir
    return init_path if is_hf_dir(init_path) else init_path.parent.parent / "tokenizer"


def init_weights(init_path: Path):
    """Weights of --init: a checkpoint's model.safetensors or an HF directory's (strictly mapped later)."""
    from nanoforge.export import is_hf_dir, read_hf_weights
    from nanoforge.train import checkpoint as ckpt
    return read_hf_weights(init_path) if is_hf_dir(init_path) else ckpt.load_weights_file(init_path)


def data_kind(data: Sequence[str]) -> str:
    """The kind of the given data: a prepared directory's manifest, or the first record of a JSONL file."""
    import json
    from nanoforge.data.jsonl import check_input_file, detect_kind
    from nanoforge.data.shards import is_plain_text, read_manifest
    if not data:
        raise NanoforgeError("--data is required: a prepared directory or one or more JSONL files")
    first = Path(data[0])
    if first.is_dir():
        return read_manifest(first)["kind"]
    check_input_file(first)
    if is_plain_text(first):  # a .txt/.md file is one pretraining document
        return "pretrain"
    with open(first, encoding="utf-8-sig", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    kind = detect_kind(json.loads(line))
                except json.JSONDecodeError as e:
                    raise NanoforgeError(f"{first}:{line_no}: invalid JSON: {e.msg}") from None
                if kind is None:
                    raise NanoforgeError(f"{first}:{line_no}: cannot tell the kind of record (no \"text\", "
                                         f"\"conversations\" or \"chosen\"/\"rejected\" key)")
                return kind
    raise NanoforgeError(f"{first}: no records")


def lm_batches(data_dir: Path, tcfg: TrainConfig, tok, quiet: bool):
    """Training batches, a validation-batch factory and bytes per token for a pretraining or SFT directory:
    the language-model stages (pretrain, sft, lora, distill) share them."""
    from nanoforge.data.batches import PretrainBatches, SFTBatches, eval_batches
    from nanoforge.data.shards import TokenShards
    from nanoforge.train.distributed import world

    w = world()  # under torchrun each rank reads its slice of every step's global batch
    train_shards, val_shards = TokenShards(data_dir, "train"), TokenShards(data_dir, "val")
    if train_shards.kind == "pretrain":
        batches = PretrainBatches(train_shards, tcfg.batch_size, tcfg.seq_len, tcfg.seed, w.rank, w.world_size)
        if val_shards.num_tokens > tcfg.seq_len + 1:
            return (batches, lambda: eval_batches(val_shards, tcfg.batch_size, tcfg.seq_len, tcfg.eval_batches),
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


def finetune_setup(stage: str, init: str | None, data: Sequence[str], out: str | Path, config_file: str | None,
                   overrides: dict[str, Any], resume: bool, quiet: bool, train_defaults: dict[str, Any],
                   run_options: dict[str, Any] | None = None, probe_loss=None):
    """What every stage that starts from a trained model shares: the run directory, the config (the model
    shape from --init, training defaults of the stage under --config and flags), the tokenizer of the init
    run, and the data prepared with that tokenizer.

    Returns (run_dir, mcfg, tcfg, run_info, init_path, tokenizer, data_dir). On --resume, --init, the data and
    the stage's options (run_options) come from the run's config.toml."""
    from nanoforge.data.shards import check_tokenizer
    from nanoforge.tokenizer import load_tokenizer

    run_dir = Path(out)
    if resume:
        run_dir, mcfg, tcfg, saved_run, _ = open_run(out, True, None, config_file, overrides)
        if saved_run.get("stage") != stage:
            raise NanoforgeError(f"--resume: {run_dir} is a {saved_run.get('stage')!r} run, not {stage}")
        check_same_origin(run_dir, "--init", init, saved_run.get("init"))
        init_path, tokenizer_dir = Path(saved_run["init"]), run_dir / "tokenizer"
        run_info = saved_run
    else:
        if not init:
            raise NanoforgeError("--init is required: the run directory or checkpoint to start from")
        init_path, init_cfg = init_config(init)
        base = {"model": init_cfg.get("model", {}),
                "train": {**train_defaults, "seq_len": init_cfg.get("train", {}).get("seq_len", 512)}}
        shape = {k for k in base["model"] if k not in ("dropout", "moe_aux_weight")}
        changed = [k for k in overrides if k in shape and overrides[k] != base["model"][k]]
        if changed:
            raise NanoforgeError(f"the model shape comes from --init {init}; drop "
                                 + ", ".join(f"--{k.replace('_', '-')}" for k in changed))
        in_file = load_toml(config_file).get("model", {}) if config_file else {}
        changed = [k for k in in_file if k in shape and k in base["model"] and in_file[k] != base["model"][k]]
        if changed:
            raise NanoforgeError(f"{config_file}: [model] sets " + ", ".join(
                f"{k} = {in_file[k]!r} (--init {init} has {base['model'][k]!r})" for k in changed)
                + "; the model shape comes from --init: use a config with only [train] (e.g. configs/mini-sft.toml)")
        if ckpt.list_checkpoints(run_dir):
            raise NanoforgeError(f"{run_dir} already holds a run; add --resume to continue it, or choose another --out")
        mcfg, tcfg = build_config(None, config_file, overrides, base=base)
        tokenizer_dir = init_tokenizer_dir(init_path)
        run_info = {"stage": stage, "init": str(init_path.resolve()), "tokenizer": "tokenizer", **(run_options or {})}
    tok = load_tokenizer(tokenizer_dir)
    if resume and not data:
        data_dir = saved_data_dir(run_info, run_dir)
    else:
        data_dir = resolve_data(data_kind(data), data, run_dir, str(tokenizer_dir), mcfg, tcfg, quiet)
    check_tokenizer(data_dir, tok)
    # --micro-batch auto|N: before any batch source is sized (a DPO item is a pair of sequences)
    fit_micro_batch(mcfg, tcfg, rows_per_item=2 if stage == "dpo" else 1, loss_fn=probe_loss)
    run_info["data"] = str(data_dir.resolve())
    copy_tokenizer(tokenizer_dir, run_dir)
    write_run_config(run_dir, mcfg, tcfg, run_info)
    return run_dir, mcfg, tcfg, run_info, init_path, tok, data_dir


LORA_DEFAULTS = {**SFT_DEFAULTS, "lr": 1e-4}  # adapters start at zero and tolerate a larger step (MiniMind's too)


@fresh_run_guard
def sft(init: str | None, data: Sequence[str], out: str | Path, config_file: str | None = None,
        overrides: dict[str, Any] | None = None, resume: bool = False, quiet: bool = False,
        lora=None) -> dict[str, Any]:
    """`nanoforge sft` (and `nanoforge lora`, with a LoraConfig): next-token loss on assistant replies only,
    conversations packed without padding. With LoRA only the adapters train and checkpoints hold only them,
    with a reference (path, sha256, fingerprint) to the base they belong to."""
    from nanoforge.model.gpt import GPT
    from nanoforge.model.lora import LoraConfig, LoraModel, adapter_metadata, check_base
    from nanoforge.train import checkpoint as ckpt

    if resume and (Path(out) / "config.toml").is_file():
        saved = load_toml(Path(out) / "config.toml").get("run", {})
        if saved.get("stage") == "lora":
            lora = LoraConfig.from_dict(saved)
    name = "lora" if lora else "sft"
    run_dir, mcfg, tcfg, run_info, init_path, tok, data_dir = finetune_setup(
        name, init, data, out, config_file, dict(overrides or {}), resume, quiet,
        LORA_DEFAULTS if lora else SFT_DEFAULTS, lora.to_dict() if lora else None)
    prompts = sample_prompts(tcfg)
    batches, val_batches, _ = lm_batches(data_dir, tcfg, tok, quiet)
    if batches.shards.kind != "sft":
        raise NanoforgeError(f"{data_dir}: prepared as {batches.shards.kind!r} data; {name} needs conversations "
                             f"(`nanoforge prepare --kind sft`)")
    model = GPT(mcfg)
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


def lora_merge(run: str | Path, out: str | Path, force: bool = False) -> Path:
    """`nanoforge lora merge`: fold a LoRA run's adapters into its base and write a plain run directory
    (config, tokenizer, one checkpoint) that chat, export and further training read like any other."""
    from nanoforge.model.lora import load_adapter_checkpoint
    from nanoforge.train import checkpoint as ckpt

    src = ckpt.resolve_checkpoint(run)
    state = ckpt.load_state(src)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise NanoforgeError(f"{out} exists and is not empty; choose another --out")
    model = load_adapter_checkpoint(src)
    cfg = state.get("config", {})
    mcfg, tcfg = build_config(None, None, None, base={"model": cfg.get("model", {}), "train": cfg.get("train", {})})
    run_info = {"stage": "lora-merge", "merged_from": str(src.resolve()), "tokenizer": "tokenizer"}
    copy_tokenizer(src.parent.parent / "tokenizer", out)
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
    import functools
    from nanoforge.data.dpo import DPOBatches, count_pairs, reference_logps
    from nanoforge.data.shards import TokenShards
    from nanoforge.model.gpt import GPT
    from nanoforge.train.loop import resolve_device
    from nanoforge.train.objectives import dpo_loss

    if resume and (Path(out) / "config.toml").is_file():
        check_resume_options(Path(out), {"beta": ("--beta", beta)})
        beta = load_toml(Path(out) / "config.toml").get("run", {}).get("beta", beta)
    beta = DPO_BETA if beta is None else beta
    if beta <= 0:
        raise NanoforgeError(f"--beta {beta} must be > 0")
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
    from nanoforge.train.distributed import main_first, setup, world
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
    from nanoforge.model.gpt import GPT
    from nanoforge.train import checkpoint as ckpt
    from nanoforge.train.objectives import make_distill_loss

    overrides = dict(overrides or {})
    if resume:
        saved = load_toml(Path(out) / "config.toml").get("run", {}) if (Path(out) / "config.toml").is_file() else {}
        check_same_origin(Path(out), "--teacher", teacher, saved.get("teacher"))
        check_resume_options(Path(out), {"temperature": ("--temperature", temperature), "alpha": ("--alpha", alpha)})
        teacher = saved.get("teacher", teacher)
        temperature, alpha = saved.get("temperature", temperature), saved.get("alpha", alpha)
    temperature = DISTILL_TEMPERATURE if temperature is None else temperature
    alpha = DISTILL_ALPHA if alpha is None else alpha
    if not teacher:
        raise NanoforgeError("--teacher is required: the run or checkpoint to distill from")
    if temperature <= 0 or not 0 <= alpha <= 1:
        raise NanoforgeError(f"--temperature {temperature} must be > 0 and --alpha {alpha} in [0, 1]")
    teacher_model, teacher_tok, teacher_path = ckpt.load_model(teacher)
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
        from nanoforge.data.shards import check_tokenizer
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
    torch.manual_seed(tcfg.seed)
    model = GPT(mcfg)
    if not resume and init_path is not None:
        model.load_weights(init_weights(init_path))
    from nanoforge.train.distributed import setup
    from nanoforge.train.loop import resolve_device
    # setup(): under torchrun cuda:LOCAL_RANK (plain "cuda" is cuda:0 on every rank until setup has run, e.g.
    # on `distill --resume` without --data, where nothing else called it yet)
    teacher_model.to(setup(resolve_device(tcfg.device)))
    # samples speak the way the data does: chat turns for conversation data, plain text for pretraining text
    stage = Stage("distill", batches, loss, val_batches, None, run_info,
                  sampler=make_sampler(run_dir, tcfg, tok, prompts, chat=batches.shards.kind == "sft"))
    return train_and_report(stage, model, mcfg, tcfg, run_dir, resume, quiet)
