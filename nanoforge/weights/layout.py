"""Where a run keeps its checkpoints, found and their state.json read without torch (a report reads them, on a
machine that may have no torch): RUN/checkpoints/step_NNNNNN/, complete once state.json is in it. Writing them,
and everything with tensors, is weights/checkpoint.py's."""
import re
from pathlib import Path
from typing import Any

from nanoforge.core.checksums import verify_file
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import read_json

STEP_DIR = re.compile(r"^step_(\d{6,})$")
FORMAT_VERSION = 1


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and (p / "state.json").is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    return (list_checkpoints(run_dir) or [None])[-1]


RUN_INPUTS = ("checkpoints", "tokenizer", "data", "config.toml", "metrics.jsonl", "samples.jsonl")


def read_parts(path: str | Path) -> list[Path]:
    """What a command reading `path` reads of it, for the output rule (fsutil.check_out_apart) of a file it writes:
    of a run directory its own parts (RUN_INPUTS), not the whole (a report or results beside them is their usual
    place); any other path (a checkpoint, an HF directory, a .pth) whole."""
    path = Path(path)
    return [path / part for part in RUN_INPUTS] if (path / "checkpoints").is_dir() else [path]


def load_state(ckpt: Path) -> dict[str, Any]:
    state = read_json(ckpt / "state.json", "checkpoint state")
    verify_file(ckpt / "state.json")
    if state.get("format_version") != FORMAT_VERSION:
        raise NanoforgeError(f"{ckpt / 'state.json'}: checkpoint format {state.get('format_version')!r} "
                             f"is not the supported version {FORMAT_VERSION}")
    return state
