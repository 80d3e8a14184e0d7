"""A run directory and everything about opening one: one training process at a time (its lock), the config a
new or resumed run trains with, the data it reads (prepared here on the fly from raw JSONL), the tokenizer it
keeps, and what a run takes from its --init (setup_from_init) or, with a fresh model, from its preset
(setup_from_scratch).

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
from typing import Any, Callable, Sequence

from nanoforge.core import dirlock
from nanoforge.core.config import (MODEL_FIELDS, PRESETS, SHAPE_FIELDS, TRAINING_ONLY, ConfigError, ModelConfig,
                                   TrainConfig, build_config, config_to_toml, load_toml)
from nanoforge.core.device import build_run_config, resolve_device
from nanoforge.data.columnar import is_columnar
from nanoforge.data.prepare import prepare_dataset
from nanoforge.data.shards import check_tokenizer
from nanoforge.data.parts import merge_prepared
from nanoforge.data.sources import data_kind, is_prepared, prepared_dir, train_tokenizer
from nanoforge.core.checksums import write_dir_checksums
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import check_out_apart, write_atomic, writing
from nanoforge.weights.load import init_config, init_tokenizer_dir
from nanoforge.train.microbatch import fit_micro_batch
from nanoforge.chat.tokenizer import load_tokenizer
from nanoforge.infer.samples import load_prompts
from nanoforge.weights import checkpoint as ckpt
from nanoforge.train.distributed import is_main, main_first


@dataclasses.dataclass
class PreparedRun:
    """A run ready for its batches, model and objective: the directory it writes, its config, what config.toml's
    [run] records, the --init it starts from (None: its own weights), its tokenizer, its data (a prepared
    directory; an RL run's prompt records), its --sample-prompts (None: the built-in set), and the model fields
    its command line or saved config set (the others may be fitted: fit_vocab)."""
    run_dir: Path
    mcfg: ModelConfig
    tcfg: TrainConfig
    info: dict[str, Any]
    init: Path | None = None
    tokenizer: Any = None
    data: Any = None
    prompts: list[str] | None = None
    explicit: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class StageSetup:
    """What a recipe tells its run's setup: its stage, training defaults (from --init) under --config and flags,
    its options (config.toml's [run]), and how it reads --data: prepared data of `kind` (None: as given), with
    `rows_per_item` sequences per item and `probe_loss` for --micro-batch auto; or `open_data(run, data)`."""
    stage: str
    train_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    kind: str | None = None
    rows_per_item: int = 1
    probe_loss: Callable | None = None
    open_data: Callable[[PreparedRun, Any], None] | None = None


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
        check_out_apart(out, run_inputs(given))
        with writing(out):  # a read-only file system: one line
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
            with writing(out):  # a full disk while the run is set up (config, tokenizer, data): one line
                return stage_fn(*args, **kwargs)
        except BaseException:
            if is_main() and not existed and out.is_dir() and not (out / "metrics.jsonl").exists():
                shutil.rmtree(out, ignore_errors=True)
            raise
        finally:
            if lock is not None:
                lock.release()
    return guarded


RUN_INPUTS = ("data", "init", "teacher", "tokenizer")  # the arguments of a stage that name what it reads


def run_inputs(given: dict[str, Any]) -> list:
    """The paths a stage reads (its RUN_INPUTS, each a path or a list of them), which its --out keeps apart from."""
    values = [given.get(name) for name in RUN_INPUTS]
    return [path for value in values for path in ([value] if isinstance(value, (str, Path)) else value or [])]


def lock_run_directory(out: Path) -> dirlock.DirLock:
    """Create `out` if needed and take its lock (DirectoryBusy names the process that holds it)."""
    if out.exists() and not out.is_dir():
        raise NanoforgeError(f"{out}: exists and is not a directory; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    return dirlock.acquire(out / RUN_LOCK, f"run directory {out}")


def open_run(stage: str, out: str | Path, resume: bool, preset: str | None, config_file: str | None,
             overrides: dict[str, Any]) -> PreparedRun:
    """Check the run directory and merge the config. On --resume the saved config is the base (of a run of this
    stage) and the command line may change training fields (e.g. extend --max-steps), never the model's shape."""
    run_dir = Path(out)
    saved = load_toml(run_dir / "config.toml") if resume else None  # fresh_run_guard checked it has a checkpoint
    if resume:
        if saved.get("run", {}).get("stage") != stage:
            raise NanoforgeError(f"--resume: {run_dir} is a {saved.get('run', {}).get('stage')!r} run, not {stage}")
        check_resume_shape(run_dir, saved.get("model", {}), preset, config_file, overrides)
        preset = None  # it asked for the saved shape; its [train] defaults must not undo the run's own settings
    mcfg, tcfg = build_run_config(preset, config_file, overrides, base=saved)
    explicit = set(overrides) | set((saved or {}).get("model", {}))
    if config_file:
        explicit |= set(load_toml(config_file).get("model", {}))
    return PreparedRun(run_dir, mcfg, tcfg, (saved or {}).get("run", {}), explicit=explicit)


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
            if key in explicit or key not in ("vocab_size", *TRAINING_ONLY):  # (a fresh run fits vocab_size)
                fields[key] = (value, f"--preset {preset}")
    if config_file:
        fields.update({k: (v, f"--config {config_file}") for k, v in load_toml(config_file).get("model", {}).items()})
    fields.update({k: (v, f"--{k.replace('_', '-')}") for k, v in overrides.items() if k in MODEL_FIELDS})
    return fields


def check_init_shape(init: str, init_model: dict[str, Any], config_file: str | None,
                     overrides: dict[str, Any]) -> None:
    """A run from --init takes the model's shape from it: a --config [model] key or a model flag that asks for
    another value of a shape field (config.SHAPE_FIELDS) is refused, each named with --init's value."""
    have = {**dataclasses.asdict(ModelConfig()), **init_model}
    diffs = [f"{key} {have[key]!r}, requested {value!r} (by {source})"
             for key, (value, source) in requested_model_fields(None, config_file, overrides).items()
             if key in SHAPE_FIELDS and value != have[key]]
    if diffs:
        raise NanoforgeError(f"--init {init} has another model shape than this command asks for: {'; '.join(diffs)}. "
                             "The model shape comes from --init: drop those options (a --config for a run from "
                             "--init has only [train], e.g. configs/mini-sft.toml)")


def check_same_origin(run_dir: Path, flag: str, given: str | None, saved: str | None) -> None:
    """--resume with the --init (or --teacher) that started the run. The run saved the checkpoint it resolved
    then; the same run directory given again may hold newer checkpoints since, and still names that one."""
    if not given or not saved or given == saved:
        return
    given_path, saved_path = Path(given).resolve(), Path(saved)
    if given_path != saved_path and given_path not in saved_path.parents:
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


def resolve_data(kind: str, data: Sequence[str], run_dir: Path, tokenizer, mcfg: ModelConfig, tcfg: TrainConfig,
                 quiet: bool) -> Path:
    """A prepared directory is used as is; raw JSONL files are prepared into RUN/data (once), with `tokenizer`
    (None: one trained on them). Under torchrun rank 0 prepares; the others find RUN/data ready."""
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
        if tokenizer is None and any(is_columnar(p) for p in paths):
            raise NanoforgeError("training a tokenizer reads JSONL or text, not Parquet or a datasets directory: "
                                 "give --tokenizer (e.g. one trained with `nanoforge tokenizer train` on a JSONL "
                                 "sample)")
        if tokenizer is None:
            log(f"no --tokenizer given: training a {mcfg.vocab_size}-token BPE tokenizer on the data")
            tokenizer = train_tokenizer(paths, vocab_size=mcfg.vocab_size, out_dir=run_dir / "tokenizer",
                                        force=True)
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
        write_atomic(run_dir / "config.toml", config_to_toml(mcfg, tcfg, {"run": run_info}))


def copy_tokenizer(src: Path, run_dir: Path) -> None:
    dst = run_dir / "tokenizer"
    if src.resolve() == dst.resolve() or not is_main():
        return
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    write_dir_checksums(dst)  # the run's own, whether or not the source had them (it was checked as it loaded)


def setup_from_init(spec: StageSetup, init: str | None, data, out: str | Path, config_file: str | None,
                    overrides: dict[str, Any], resume: bool, quiet: bool) -> PreparedRun:
    """The setup of every run that starts from trained weights (sft, lora, dpo, distill, grpo, ppo, pretrain
    --init): the model's shape and tokenizer from --init (check_init_shape refuses another shape), the stage's
    training defaults under --config and the flags; on --resume the run's config.toml, of this stage and from the
    same --init. Then its data (finish_setup)."""
    if resume:
        run = open_run(spec.stage, out, True, None, config_file, overrides)
        check_same_origin(run.run_dir, "--init", init, run.info.get("init"))
        run.init, tokenizer_dir = Path(run.info["init"]), run.run_dir / "tokenizer"
    else:
        if not init:
            raise NanoforgeError("--init is required: the run, checkpoint or model directory to start from")
        init_path, init_cfg = init_config(init)
        check_init_shape(init, init_cfg.get("model", {}), config_file, overrides)
        base = {"model": init_cfg.get("model", {}),
                "train": {**spec.train_defaults, "seq_len": init_cfg.get("train", {}).get("seq_len", 512)}}
        mcfg, tcfg = build_run_config(None, config_file, overrides, base=base)
        run = PreparedRun(Path(out), mcfg, tcfg, {"stage": spec.stage, "init": str(init_path.resolve()),
                                                  "tokenizer": "tokenizer", **spec.options}, init=init_path)
        tokenizer_dir = init_tokenizer_dir(init_path)
    run.tokenizer = load_tokenizer(tokenizer_dir)
    return finish_setup(run, spec, data, resume, quiet, tokenizer_dir)


def setup_from_scratch(spec: StageSetup, preset: str | None, tokenizer: str | None, data: Sequence[str],
                       out: str | Path, config_file: str | None, overrides: dict[str, Any], resume: bool,
                       quiet: bool) -> PreparedRun:
    """The setup of a run of a fresh model (pretrain; distill's student of a preset): its shape from the preset,
    --config and the flags (on --resume the saved one), the embedding sized to its tokenizer: `tokenizer` (a
    directory or tokenizer.json) or, without one, its data's (trained on raw JSONL). Then its data (finish_setup)."""
    run = open_run(spec.stage, out, resume, preset, config_file, overrides)
    if not resume:
        run.info = {"stage": spec.stage, "tokenizer": "tokenizer", **spec.options}
    run.tokenizer = load_tokenizer(tokenizer) if tokenizer else None
    return finish_setup(run, spec, data, resume, quiet, None)


def finish_setup(run: PreparedRun, spec: StageSetup, data, resume: bool, quiet: bool,
                 tokenizer_dir: Path | None) -> PreparedRun:
    """What every run's setup ends with, before anything is written: its --sample-prompts read, its data (the
    recipe's open_data, or prepared with the run's tokenizer: raw JSONL into RUN/data, on --resume without --data
    the saved one) and, for prepared data, a fresh model's embedding fitted and --micro-batch auto|N; then, for a
    fresh run, the tokenizer copied into it (from tokenizer_dir, or the data's) and config.toml written."""
    run.prompts = load_prompts(run.tcfg.sample_prompts) if run.tcfg.sample_prompts else None
    run.info = {k: v for k, v in run.info.items() if v is not None}  # an option not set (TOML has no None)
    if spec.open_data:
        spec.open_data(run, data)
    else:
        run.data = saved_data_dir(run.info, run.run_dir) if resume and not data else resolve_data(
            spec.kind or data_kind(data), data, run.run_dir, run.tokenizer, run.mcfg, run.tcfg, quiet)
        run.tokenizer = run.tokenizer or load_tokenizer(run.data / "tokenizer")
        check_tokenizer(run.data, run.tokenizer)
        if run.init is None:
            fit_vocab(run.mcfg, run.tokenizer, run.explicit)
        fit_micro_batch(run.mcfg, run.tcfg, rows_per_item=spec.rows_per_item, loss_fn=spec.probe_loss)
        run.info["data"] = str(run.data.resolve())
    if not resume:  # a resumed run has both: its config is rewritten once its checkpoint is restored (loop._start)
        copy_tokenizer(tokenizer_dir or run.data / "tokenizer", run.run_dir)
        write_run_config(run.run_dir, run.mcfg, run.tcfg, run.info)
    return run
