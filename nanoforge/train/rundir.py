"""A run directory and everything about opening one: one training process at a time (its lock), the config a
new or resumed run trains with, the data it reads (prepared here on the fly from raw JSONL), the tokenizer it
keeps, and what a fine-tuning run takes from its --init.

    RUN/config.toml      the config actually used ([model], [train], [run])
    RUN/tokenizer/       the tokenizer the run was trained with
    RUN/data/            raw JSONL prepared on the fly
    RUN/checkpoints/     weights/checkpoint.py's format
    RUN/.lock            held by the one process training into RUN (nanoforge/core/dirlock.py)

The recipes (recipes/) call these first, then build their batches, model and objective."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import shutil
from pathlib import Path
from typing import Any, Sequence

from nanoforge.core import dirlock
from nanoforge.core.config import (DROPOUTS, MODEL_FIELDS, PRESETS, ConfigError, ModelConfig, TrainConfig, build_config,
                              config_to_toml, load_toml)
from nanoforge.core.device import build_run_config, resolve_device
from nanoforge.data.columnar import is_columnar
from nanoforge.data.prepare import prepare_dataset
from nanoforge.data.shards import check_tokenizer
from nanoforge.data.parts import merge_prepared
from nanoforge.data.sources import data_kind, is_prepared, prepared_dir, train_tokenizer
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import write_text_atomic
from nanoforge.weights.load import init_config, init_tokenizer_dir
from nanoforge.train.microbatch import fit_micro_batch
from nanoforge.chat.tokenizer import load_tokenizer
from nanoforge.weights import checkpoint as ckpt
from nanoforge.train.distributed import is_main, main_first


@dataclasses.dataclass
class PreparedRun:
    """A run ready for its batches, model and objective: the directory it writes, its config, what config.toml's
    [run] records, the --init it starts from (None: its own weights), its tokenizer, and its data (a prepared
    directory; an RL run's prompt records)."""
    run_dir: Path
    mcfg: ModelConfig
    tcfg: TrainConfig
    info: dict[str, Any]
    init: Path | None
    tokenizer: Any
    data: Any


RUN_LOCK = ".lock"  # in a run directory: held by the one process training into it (nanoforge/core/dirlock.py)


def fresh_run_guard(stage_fn):
    """One training process per run directory, and nothing half-written.

    Before anything else the stage takes the run directory's lock (under torchrun only rank 0 takes it, once
    for the run), so a second process on the same --out stops at once, naming the holder, with nothing changed;
    next --resume needs a checkpoint there, a fresh start none. If the stage then fails before training began
    (bad data, a wrong --init, a config error) in a run directory that was empty when this call took it, the
    directory is removed again."""

    @functools.wraps(stage_fn)
    def guarded(*args, **kwargs):
        given = inspect.signature(stage_fn).bind(*args, **kwargs).arguments
        out = Path(given["out"])
        lock = lock_run_directory(out) if is_main() else None
        existed = out.is_dir() and any(p.name != RUN_LOCK for p in out.iterdir())
        try:
            resume, held = given.get("resume"), ckpt.list_checkpoints(out)
            if resume and not (out / "config.toml").is_file():
                raise NanoforgeError(f"--resume: {out} is not a run directory (no config.toml)")
            if resume and not held:  # e.g. killed before its first save
                raise NanoforgeError(f"--resume: {out} has no checkpoint to resume from (looked in {out}/checkpoints)"
                                     "; nothing was saved before it stopped: start it again with the command that "
                                     "began it, without --resume, or with --resume auto")
            if held and not resume:  # (a kill during the first save leaves only .tmp-*: a fresh start)
                raise NanoforgeError(f"{out} already holds a run; add --resume to continue it, or choose another --out")
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
    saved = load_toml(run_dir / "config.toml") if resume else None  # fresh_run_guard checked it has a checkpoint
    if resume:
        check_resume_shape(run_dir, saved.get("model", {}), preset, config_file, overrides)
        preset = None  # it asked for the saved shape; its [train] defaults must not undo the run's own settings
    mcfg, tcfg = build_run_config(preset, config_file, overrides, base=saved)
    explicit = set(overrides) | set((saved or {}).get("model", {}))
    if config_file:
        explicit |= set(load_toml(config_file).get("model", {}))
    return run_dir, mcfg, tcfg, (saved or {}).get("run", {}), explicit


# Model fields a preset's defaults do not pin on --resume: a fresh run fits vocab_size to the tokenizer, and the
# others do not change the shape. Given explicitly (a flag or a [model] key) they are compared like the rest.
FITTED_OR_REGULARISING = {"vocab_size", *DROPOUTS, "moe_aux_weight", "init_std"}


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


def saved_run_info(run_dir: str | Path) -> dict[str, Any]:
    """The [run] table of a run directory's config.toml ({} when it has none yet)."""
    path = Path(run_dir) / "config.toml"
    return load_toml(path).get("run", {}) if path.is_file() else {}


def check_resume_options(run_dir: Path, requested: dict[str, tuple[str, Any]]) -> None:
    """--resume with the stage's own options ({[run] key: (flag, value)}; None where the flag was not given):
    the saved value is kept, an equal one is fine, a different one is an error naming both."""
    saved = saved_run_info(run_dir)
    diffs = [f"{flag} saved {saved[key]!r}, requested {value!r}" for key, (flag, value) in requested.items()
             if value is not None and key in saved and saved[key] != value]
    if diffs:
        raise NanoforgeError(f"--resume: {run_dir} was started with other options: {'; '.join(diffs)}. A run keeps "
                             "its own: drop them (--resume alone uses the saved ones), or choose another --out")


def given_fields(options, given=None) -> set[str]:
    """The fields of a stage's options that its caller set: `given` (cli: the flags on the command line), by
    default those off their default (a call from Python)."""
    return set(given) if given is not None else {f.name for f in dataclasses.fields(options)
                                                 if getattr(options, f.name) != f.default}


def resolve_run_options(out: Path, options, resume: bool, given=None) -> dict[str, Any]:
    """A stage's own options (a dataclass of them; saved under [run] in config.toml): on --resume the saved ones,
    but for those `given` (the flags on the command line; by default the fields off their default), where a
    different value is an error."""
    values, given = dataclasses.asdict(options), given_fields(options, given)
    if resume:
        check_resume_options(out, {k: ("--" + k.replace("_", "-"), values[k]) for k in given})
        values.update({k: v for k, v in saved_run_info(out).items() if k in values and k not in given})
    return values


def fit_vocab(mcfg: ModelConfig, tokenizer, explicit: set[str]) -> None:
    """The embedding is as large as the tokenizer unless the user sized it (never smaller)."""
    if "vocab_size" not in explicit:
        mcfg.vocab_size = tokenizer.vocab_size
    elif mcfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"vocab_size={mcfg.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")


def resolve_data(kind: str, data: Sequence[str], run_dir: Path, tokenizer_path: str | None, mcfg: ModelConfig,
                 tcfg: TrainConfig, quiet: bool) -> Path:
    """A prepared directory is used as is; raw JSONL files are prepared into RUN/data (once). Under torchrun
    rank 0 prepares; the others find RUN/data ready."""
    paths = [Path(p) for p in data]
    target = run_dir / "data"
    log = (lambda *a: None) if quiet else print
    with main_first(resolve_device(tcfg.device)):
        prepared = prepared_dir(paths)
        if prepared is not None:
            return prepared
        if (target / "manifest.json").is_file():
            return target
        if all(is_prepared(p) for p in paths):  # several prepared parts: a manifest over their shards
            merge_prepared(paths, target, log=log)
            return target
        if tokenizer_path:
            tokenizer = load_tokenizer(tokenizer_path)
        elif any(is_columnar(p) for p in paths):
            raise NanoforgeError("training a tokenizer reads JSONL or text, not Parquet or a datasets directory: "
                                 "give --tokenizer (e.g. one trained with `nanoforge tokenizer train` on a JSONL "
                                 "sample)")
        else:
            log(f"no --tokenizer given: training a {mcfg.vocab_size}-token BPE tokenizer on the data")
            tokenizer = train_tokenizer(paths, vocab_size=mcfg.vocab_size, out_dir=run_dir / "tokenizer")
        prepare_dataset(kind, paths, tokenizer, target, val_fraction=tcfg.val_fraction, workers=tcfg.workers,
                        log=log, text_column=tcfg.text_column)
        return target


def saved_data_dir(run_info: dict[str, Any], run_dir: Path) -> Path:
    """The prepared data a run trained on (config.toml's [run] data), for --resume without --data."""
    path = Path(run_info["data"])
    if not (path / "manifest.json").is_file():
        raise NanoforgeError(f"--resume: {run_dir} trained on {path} (config.toml, [run] data), which is not a "
                             f"prepared data directory any more; give --data with the same data's new location")
    return path


def write_run_config(run_dir: Path, mcfg: ModelConfig, tcfg: TrainConfig, run_info: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    if is_main():  # under torchrun only rank 0 writes the run directory
        write_text_atomic(run_dir / "config.toml", config_to_toml(mcfg, tcfg, {"run": run_info}))


def copy_tokenizer(src: Path, run_dir: Path) -> None:
    dst = run_dir / "tokenizer"
    if src.resolve() == dst.resolve() or not is_main():
        return
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


def resumed_run(stage: str, init: str | None, out: str | Path, config_file: str | None, overrides: dict[str, Any]):
    """--resume of a run that started from --init: its saved config, checked to be this stage's and from the same
    --init. Returns (run_dir, mcfg, tcfg, run_info, init_path)."""
    run_dir, mcfg, tcfg, run_info, _ = open_run(out, True, None, config_file, overrides)
    if run_info.get("stage") != stage:
        raise NanoforgeError(f"--resume: {run_dir} is a {run_info.get('stage')!r} run, not {stage}")
    check_same_origin(run_dir, "--init", init, run_info.get("init"))
    return run_dir, mcfg, tcfg, run_info, Path(run_info["init"])


def finetune_setup(stage: str, init: str | None, data: Sequence[str], out: str | Path, config_file: str | None,
                   overrides: dict[str, Any], resume: bool, quiet: bool, train_defaults: dict[str, Any],
                   run_options: dict[str, Any] | None = None, probe_loss=None) -> PreparedRun:
    """What every stage that starts from a trained model shares: the run directory, the config (the model
    shape from --init, training defaults of the stage under --config and flags), the tokenizer of the init
    run, and the data prepared with that tokenizer. On --resume, --init, the data and the stage's options
    (run_options) come from the run's config.toml."""
    run_dir = Path(out)
    if resume:
        run_dir, mcfg, tcfg, run_info, init_path = resumed_run(stage, init, out, config_file, overrides)
        tokenizer_dir = run_dir / "tokenizer"
    else:
        if not init:
            raise NanoforgeError("--init is required: the run directory or checkpoint to start from")
        init_path, init_cfg = init_config(init)
        base = {"model": init_cfg.get("model", {}),
                "train": {**train_defaults, "seq_len": init_cfg.get("train", {}).get("seq_len", 512)}}
        shape = {k for k in base["model"] if k not in (*DROPOUTS, "moe_aux_weight")}
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
        mcfg, tcfg = build_run_config(None, config_file, overrides, base=base)
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
    return PreparedRun(run_dir, mcfg, tcfg, run_info, init_path, tok, data_dir)
