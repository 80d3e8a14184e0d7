"""Stages: each builds a model, a batch source and an objective, then hands them to the one loop.

Also the run-directory plumbing they share: resolving data (prepared directory, or raw JSONL prepared on the
fly into the run), the tokenizer copy, and config.toml.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Sequence

import torch

from nanoforge.config import (ConfigError, ModelConfig, TrainConfig, build_config, config_to_toml, load_toml)
from nanoforge.errors import NanoforgeError
from nanoforge.train.loop import Stage, train
from nanoforge.train.objectives import causal_lm_loss


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
        changed = [k for k in overrides if k in saved.get("model", {}) and overrides[k] != saved["model"][k]]
        if changed or preset:
            raise NanoforgeError(f"--resume: the model shape of {run_dir} is fixed; drop "
                                 + ", ".join(f"--{k.replace('_', '-')}" for k in changed or ["preset"]))
    elif (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise NanoforgeError(f"{run_dir} already holds a run; add --resume to continue it, or choose another --out")
    mcfg, tcfg = build_config(preset, config_file, overrides, base=saved)
    explicit = set(overrides) | set((saved or {}).get("model", {}))
    if config_file:
        explicit |= set(load_toml(config_file).get("model", {}))
    return run_dir, mcfg, tcfg, (saved or {}).get("run", {}), explicit


def fit_vocab(mcfg: ModelConfig, tokenizer, explicit: set[str]) -> None:
    """The embedding is as large as the tokenizer unless the user sized it (never smaller)."""
    if "vocab_size" not in explicit:
        mcfg.vocab_size = tokenizer.vocab_size
    elif mcfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"vocab_size={mcfg.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")


def resolve_data(kind: str, data: Sequence[str], run_dir: Path, tokenizer_path: str | None, mcfg: ModelConfig,
                 tcfg: TrainConfig, quiet: bool) -> Path:
    """A prepared directory is used as is; raw JSONL files are prepared into RUN/data (once)."""
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


def write_run_config(run_dir: Path, mcfg: ModelConfig, tcfg: TrainConfig, run_info: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.toml.tmp"
    tmp.write_text(config_to_toml(mcfg, tcfg, {"run": run_info}), encoding="utf-8")
    tmp.replace(run_dir / "config.toml")


def copy_tokenizer(src: Path, run_dir: Path) -> None:
    dst = run_dir / "tokenizer"
    if src.resolve() == dst.resolve():
        return
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


def pretrain(data: Sequence[str], out: str | Path, preset: str | None = None, config_file: str | None = None,
             overrides: dict[str, Any] | None = None, resume: bool = False, tokenizer: str | None = None,
             quiet: bool = False) -> dict[str, Any]:
    """`nanoforge pretrain`: packed next-token prediction on a token stream."""
    from nanoforge.data.batches import PretrainBatches, eval_batches
    from nanoforge.data.shards import TokenShards
    from nanoforge.model.gpt import GPT
    from nanoforge.tokenizer import load_tokenizer

    run_dir, mcfg, tcfg, saved_run, explicit = open_run(out, resume, preset, config_file, overrides or {})
    data_dir = Path(saved_run["data"]) if resume and saved_run.get("data") and not data else \
        resolve_data("pretrain", data, run_dir, tokenizer, mcfg, tcfg, quiet)
    tok = load_tokenizer(data_dir / "tokenizer")
    fit_vocab(mcfg, tok, explicit)
    train_shards = TokenShards(data_dir, "train")
    if train_shards.manifest.get("kind") != "pretrain":
        raise NanoforgeError(f"{data_dir}: prepared as {train_shards.manifest.get('kind')!r} data, "
                             f"but pretrain needs --kind pretrain")
    batches = PretrainBatches(train_shards, tcfg.batch_size, tcfg.seq_len, tcfg.seed)
    val_batches, val_bpt = None, None
    val_shards = TokenShards(data_dir, "val")
    if val_shards.num_tokens > tcfg.seq_len + 1:
        val_batches = lambda: eval_batches(val_shards, tcfg.batch_size, tcfg.seq_len, tcfg.eval_batches)  # noqa: E731
        val_bpt = val_shards.num_bytes / val_shards.num_tokens
    elif not quiet:
        print(f"note: the validation split of {data_dir} has {val_shards.num_tokens} tokens, fewer than one "
              f"window of {tcfg.seq_len + 1}; validation is off (raise --val-fraction when preparing)")

    run_info = {"stage": "pretrain", "data": str(data_dir.resolve()), "tokenizer": "tokenizer"}
    copy_tokenizer(data_dir / "tokenizer", run_dir)
    write_run_config(run_dir, mcfg, tcfg, run_info)
    torch.manual_seed(tcfg.seed)  # the initial weights are part of what the seed fixes
    model = GPT(mcfg)
    stage = Stage("pretrain", batches, causal_lm_loss, val_batches, val_bpt, run_info)
    return train(stage, model, mcfg, tcfg, run_dir, resume=resume, quiet=quiet)


# Training defaults of a fine-tuning stage, under the preset/--config/--field layers. A pretrained model has
# found its basin; a tenth of the pretraining rate adapts it without wiping what it learned.
SFT_DEFAULTS = {"lr": 5e-5, "warmup_steps": 20, "min_lr_ratio": 0.1, "weight_decay": 0.0, "max_steps": 500,
                "eval_every": 50, "save_every": 200}


def init_config(init: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint --init points at, and the config it was trained with."""
    from nanoforge.train import checkpoint as ckpt
    path = ckpt.resolve_checkpoint(init)
    return path, ckpt.load_state(path).get("config", {})


def sft(init: str | None, data: Sequence[str], out: str | Path, config_file: str | None = None,
        overrides: dict[str, Any] | None = None, resume: bool = False, quiet: bool = False) -> dict[str, Any]:
    """`nanoforge sft`: next-token loss on assistant replies only, conversations packed without padding."""
    from nanoforge.data.batches import SFTBatches
    from nanoforge.data.shards import TokenShards, check_tokenizer
    from nanoforge.model.gpt import GPT
    from nanoforge.train import checkpoint as ckpt
    from nanoforge.tokenizer import load_tokenizer

    overrides = dict(overrides or {})
    run_dir = Path(out)
    if resume:
        run_dir, mcfg, tcfg, saved_run, _ = open_run(out, True, None, config_file, overrides)
        init_path = Path(saved_run["init"])
        tokenizer_dir = run_dir / "tokenizer"
    else:
        if not init:
            raise NanoforgeError("--init is required: the run directory or checkpoint to fine-tune")
        init_path, init_cfg = init_config(init)
        base = {"model": init_cfg.get("model", {}),
                "train": {**SFT_DEFAULTS, "seq_len": init_cfg.get("train", {}).get("seq_len", 512)}}
        shape = {k for k in base["model"] if k not in ("dropout",)}
        changed = [k for k in overrides if k in shape and overrides[k] != base["model"][k]]
        if changed:
            raise NanoforgeError(f"the model shape comes from --init {init}; drop "
                                 + ", ".join(f"--{k.replace('_', '-')}" for k in changed))
        if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
            raise NanoforgeError(f"{run_dir} already holds a run; add --resume to continue it, or choose another --out")
        mcfg, tcfg = build_config(None, config_file, overrides, base=base)
        tokenizer_dir = init_path.parent.parent / "tokenizer"
        saved_run = {}
    tok = load_tokenizer(tokenizer_dir)
    if resume and not data:
        data_dir = Path(saved_run["data"])
    else:
        data_dir = resolve_data("sft", data, run_dir, str(tokenizer_dir), mcfg, tcfg, quiet)
    check_tokenizer(data_dir, tok)
    train_shards = TokenShards(data_dir, "train")
    batches = SFTBatches(train_shards, tcfg.batch_size, tcfg.seq_len, tcfg.seed, pad_id=tok.pad_id)
    if not quiet:
        print(f"sft train: {batches.report.summary(tcfg.seq_len)}", flush=True)
    val_batches = None
    val_shards = TokenShards(data_dir, "val")
    if val_shards.num_docs:
        val = SFTBatches(val_shards, tcfg.batch_size, tcfg.seq_len, shuffle=False, pad_id=tok.pad_id)
        val_batches = lambda: val.eval_batches(tcfg.eval_batches)  # noqa: E731

    run_info = {"stage": "sft", "data": str(data_dir.resolve()), "tokenizer": "tokenizer",
                "init": str(init_path.resolve()), "padding_fraction": round(batches.report.padding_fraction, 4)}
    copy_tokenizer(tokenizer_dir, run_dir)
    write_run_config(run_dir, mcfg, tcfg, run_info)
    model = GPT(mcfg)
    if not resume:
        model.load_weights(ckpt.load_weights_file(init_path))
    stage = Stage("sft", batches, causal_lm_loss, val_batches, None, run_info)
    return train(stage, model, mcfg, tcfg, run_dir, resume=resume, quiet=quiet)
