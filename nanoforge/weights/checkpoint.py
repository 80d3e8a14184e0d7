"""One checkpoint format for every stage: a directory per step, written atomically.

    checkpoints/step_000100/
        model.safetensors   weights (tied lm_head omitted, as in HF Llama)
        trainer.pt          optimizer, grad-scaler and RNG states: tensors and plain containers only,
                            so it loads with torch.load(weights_only=True) and never unpickles code
        state.json          step, data position, counters, config, versions
        checksums.sha256    the sha256 of each file above (core/checksums.py), verified where each is read

The directory is written under a temporary name, every file is fsynced, then it is renamed into place and
the parent directory fsynced. A reader therefore sees either a complete checkpoint or none: a process
killed mid-write leaves only a `.tmp-*` directory, which is ignored and cleaned up by the next save. A file
damaged since (a flipped byte, a truncation, a non-finite weight) is refused where it is read, with a DamagedFile
naming it; checkpoints of older versions, without checksums.sha256, load unchecked.
Finding checkpoints and reading their state.json (no torch) is weights/layout.py's; building a model from a
checkpoint is weights/load.py's."""
import json
import math
import os
import shutil
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nanoforge.core.checksums import DamagedFile, verify_file, write_dir_checksums
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import fsync_dir, fsync_file, replace_dir
from nanoforge.weights.layout import FORMAT_VERSION, STEP_DIR, latest_checkpoint, list_checkpoints, load_state, \
    step_dir_name


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint directory or a run directory (then its latest checkpoint)."""
    path = Path(path)
    if (path / "state.json").is_file() and (path / "model.safetensors").exists():
        return path
    if not path.exists():
        raise NanoforgeError(f"{path}: no such run or checkpoint directory")
    latest = latest_checkpoint(path)
    if latest is None:
        raise NanoforgeError(f"{path}: no checkpoint found (expected {path}/checkpoints/step_NNNNNN/)")
    return latest


def rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = [torch.cuda.get_rng_state()]  # the current device's (each rank's own GPU)
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["cpu"])
    cuda = list(states.get("cuda", []))
    if cuda and torch.cuda.is_available():
        # Older checkpoints hold every visible GPU's state (get_rng_state_all); restoring all of them fails with
        # IndexError on a machine with fewer GPUs. Take the one for the current device when there, else the first.
        i = torch.cuda.current_device()
        torch.cuda.set_rng_state(cuda[i] if i < len(cuda) else cuda[0])


def save_checkpoint(run_dir: str | Path, step: int, weights: dict[str, torch.Tensor], trainer: dict[str, Any],
                    state: dict[str, Any], keep_last: int = 3) -> Path:
    """Write checkpoint `step` atomically, then delete all but the newest `keep_last`.

    On any failure (full disk, permissions) the temporary directory is removed, the previous checkpoints
    are untouched, and a NanoforgeError says what happened."""
    root = Path(run_dir) / "checkpoints"
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a process killed mid-write
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        cpu_weights = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
        save_file(cpu_weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        torch.save(trainer, tmp / "trainer.pt")
        state = {"format_version": FORMAT_VERSION, "step": step, **state}
        # state.json last: its presence marks the directory complete even before the rename.
        (tmp / "state.json").write_text(json.dumps(state, indent=1, ensure_ascii=False), encoding="utf-8")
        write_dir_checksums(tmp)  # (fsynced)
        for name in ("model.safetensors", "trainer.pt", "state.json"):
            fsync_file(tmp / name)
        fsync_dir(tmp)
        replace_dir(tmp, final)  # re-saving a step (e.g. after a rollback) swaps, never leaves a gap
        fsync_dir(root)
    except (OSError, SafetensorError, RuntimeError) as e:  # safetensors and torch.save wrap ENOSPC their own way
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(run_dir)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        with suppress(OSError):  # torch.save reports a full disk as an iostream error; free space says what happened
            reason += f" ({shutil.disk_usage(root).free / 1e6:.1f} MB free on that filesystem)"
        raise NanoforgeError(f"could not write checkpoint {final}: {reason}. "
                             f"The last good checkpoint is {last or 'none'}.") from e
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def verify_checkpoint(ckpt: Path) -> None:
    """Read every file of a checkpoint as a resume would (checksums, weights finite); DamagedFile if one fails."""
    load_state(ckpt)
    read_weights(ckpt / "model.safetensors")
    load_trainer_file(ckpt)


def previous_intact_advice(damaged: Path) -> str:
    """What to do about a damaged checkpoint of a run: set it aside and resume from the newest intact one
    before it (named, with its step), or start again when there is none."""
    run_dir = damaged.parent.parent
    held = list_checkpoints(run_dir)
    for earlier in reversed(held[:held.index(damaged)] if damaged in held else held):
        try:
            verify_checkpoint(earlier)
        except NanoforgeError:
            continue
        return (f"the previous checkpoint {earlier} is intact: move the damaged one out of checkpoints/ "
                f"(mv {damaged} {run_dir / ('damaged-' + damaged.name)}) and resume again to continue from step "
                f"{int(STEP_DIR.match(earlier.name).group(1))}")
    return "no earlier checkpoint of the run is intact: start the run again without --resume, in another --out"


def load_weights_file(ckpt: Path) -> dict[str, torch.Tensor]:
    return read_weights(ckpt / "model.safetensors")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A model.safetensors file (a checkpoint's, or a LoRA run's base) -> its tensors, checked against its
    recorded checksum (after the read: a file that does not read says why) and for non-finite values. Never a
    pickle."""
    try:
        weights = load_file(str(path))
    except (OSError, SafetensorError, ValueError) as e:
        raise DamagedFile(f"{path}: cannot read weights (truncated or corrupted?): {e}") from None
    verify_file(path)
    check_finite(weights, path)
    return weights


def check_finite(weights: dict[str, torch.Tensor], path: str | Path) -> None:
    """Refuse weights (read from `path`) with a NaN or an infinity, naming the first such tensor: a model that
    computes NaN fails later with a traceback or, in eval, a silent `loss nan`. A finite sum proves a tensor
    finite (a NaN or an infinity never sums to a finite value) at a fifth of the cost of isfinite; only a
    non-finite sum (or an overflowing one) is looked at element by element."""
    for name, tensor in weights.items():
        if tensor.is_floating_point() and not math.isfinite(float(tensor.sum())) \
                and not bool(torch.isfinite(tensor).all()):
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            what = " and ".join([f"{nan:,} NaN"] * bool(nan) + [f"{inf:,} infinite"] * bool(inf))
            raise DamagedFile(f"{path}: tensor {name} holds non-finite values ({what} of {tensor.numel():,}); "
                              "the weights are damaged or diverged: use another checkpoint")


def load_trainer_file(ckpt: Path) -> dict[str, Any]:
    path = ckpt / "trainer.pt"
    try:
        trainer = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged zip; all mean the same to the user
        raise DamagedFile(f"{path}: cannot read optimizer state (truncated or corrupted?): {e}") from None
    verify_file(path)
    return trainer

