"""Reading a run directory for a report: `metrics.jsonl` (the source of truth for every logged step), `config.toml`
(the config as used), `samples.jsonl` (text generated during training or by `nanoforge eval --samples`) and the
latest checkpoint's `state.json` (tokens seen). Nothing here loads weights or torch, so a run can be read while it
is still going, or long after, on a machine without them. Rendering what is read is report/markdown.py's."""
from __future__ import annotations

import json
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoforge.core.config import load_toml
from nanoforge.core.errors import NanoforgeError
from nanoforge.weights.layout import latest_checkpoint, load_state


@dataclass
class RunMetrics:
    """One run's logged records, split by what they hold, and what else its directory says about it."""
    run_dir: Path
    name: str
    config: dict[str, dict[str, Any]]
    train: list[dict] = field(default_factory=list)  # records with "loss"
    val: list[dict] = field(default_factory=list)  # records with "val_loss"
    events: list[dict] = field(default_factory=list)  # rollbacks and the like
    samples: list[dict] = field(default_factory=list)  # samples.jsonl records with a step
    state: dict[str, Any] = field(default_factory=dict)  # the latest checkpoint's state.json, if readable


def _read_jsonl(path: Path) -> list[dict]:
    """Objects with a "step" from a JSONL file; a line cut short by a kill is skipped."""
    out = []
    if not path.is_file():
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                out.append(record)
    return out


def read_run(run_dir: str | Path, name: str | None = None) -> RunMetrics:
    """Read a run directory's metrics.jsonl, config.toml, samples.jsonl and latest state.json."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise NanoforgeError(f"{run_dir}: no metrics.jsonl here; give a run directory written by a training "
                             "command (pretrain, sft, ...)")
    config = load_toml(run_dir / "config.toml") if (run_dir / "config.toml").is_file() else {}
    run = RunMetrics(run_dir, name or run_dir.name, config)
    for record in _read_jsonl(metrics):
        if "event" in record:
            run.events.append(record)
        elif "val_loss" in record:
            run.val.append(record)
        elif "loss" in record:
            run.train.append(record)
    run.samples = _read_jsonl(run_dir / "samples.jsonl")
    with suppress(NanoforgeError, OSError):  # a torn or foreign checkpoint: the report goes on without it
        last = latest_checkpoint(run_dir)
        run.state = load_state(last) if last is not None else {}
    return run
