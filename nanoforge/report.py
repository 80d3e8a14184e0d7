"""Run reports: a markdown page with the numbers that say whether a run learned, and PNG plots of its curves.

Everything comes from what a run directory already holds: `metrics.jsonl` (the source of truth for every
logged step) and `config.toml` (the config as used). A report never touches a checkpoint, so it can be
written while a run is still going, or long after, on a machine without the weights.

matplotlib is optional (the `report` extra). Without it the report is written all the same, with a line
saying how to get the plots: a missing plotting library must never cost anyone their numbers.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoforge.errors import NanoforgeError

NO_MATPLOTLIB = ("Plots were skipped: matplotlib is not installed. `pip install matplotlib` (or nanoforge's "
                 "`report` extra) and run `nanoforge report` again to get them.")


@dataclass
class RunMetrics:
    """One run's logged records, split by what they hold."""
    run_dir: Path
    name: str
    config: dict[str, dict[str, Any]]
    train: list[dict] = field(default_factory=list)  # records with "loss"
    val: list[dict] = field(default_factory=list)  # records with "val_loss"
    events: list[dict] = field(default_factory=list)  # rollbacks and the like


def read_run(run_dir: str | Path, name: str | None = None) -> RunMetrics:
    """Read a run directory's metrics.jsonl and config.toml. A last line cut short by a kill is skipped."""
    from nanoforge.config import load_toml

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise NanoforgeError(f"{run_dir}: no metrics.jsonl here; give a run directory written by a training "
                             "command (pretrain, sft, ...)")
    config = load_toml(run_dir / "config.toml") if (run_dir / "config.toml").is_file() else {}
    run = RunMetrics(run_dir, name or run_dir.name, config)
    with open(metrics, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict) or "step" not in record:
                continue
            if "event" in record:
                run.events.append(record)
            elif "val_loss" in record:
                run.val.append(record)
            elif "loss" in record:
                run.train.append(record)
    return run


# ----------------------------------------------------------------------------------------------------------
# numbers


def count_params(model_config: dict[str, Any]) -> int | None:
    """Parameters of the model a config describes, built on the meta device (no memory, no init cost)."""
    import torch

    from nanoforge.config import MODEL_FIELDS, ModelConfig
    from nanoforge.model.gpt import GPT

    try:
        with torch.device("meta"):
            return GPT(ModelConfig(**{k: v for k, v in model_config.items() if k in MODEL_FIELDS})).num_params()
    except Exception:  # a config from another version: the report goes on without the count
        return None


def summarize(run: RunMetrics) -> list[tuple[str, str]]:
    """(label, value) rows for one run's table."""
    model, train, info = run.config.get("model", {}), run.config.get("train", {}), run.config.get("run", {})
    rows: list[tuple[str, str]] = []
    if info.get("stage"):
        rows.append(("stage", str(info["stage"])))
    if model:
        params = count_params(model)
        if params is not None:
            rows.append(("parameters", f"{params / 1e6:.2f}M"))
        rows.append(("shape", f"d_model {model.get('d_model')}, {model.get('n_layers')} layers, "
                              f"{model.get('n_heads')} heads ({model.get('n_kv_heads')} KV), "
                              f"vocab {model.get('vocab_size')}, context {model.get('max_seq_len')}"))
    if train:
        tokens = train.get("batch_size", 0) * train.get("seq_len", 0) * train.get("grad_accum", 1)
        rows.append(("steps", f"{train.get('max_steps')} planned, batch {train.get('batch_size')} x "
                              f"{train.get('seq_len')} x {train.get('grad_accum')} accum = {tokens:,} tokens/step"))
        rows.append(("optimizer", f"lr {train.get('lr')} ({train.get('schedule')}, warmup "
                                  f"{train.get('warmup_steps')}), weight decay {train.get('weight_decay')}"))
        rows.append(("precision", f"{train.get('precision')} on {train.get('device')}"))
    if run.train:
        first, last = run.train[0], run.train[-1]
        rows.append(("last logged step", str(last["step"])))
        rows.append(("training loss", f"{first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
                                      f"(step {last['step']})"))
    else:
        rows.append(("training loss", "no training steps logged yet"))
    if run.val:
        first, last = run.val[0], run.val[-1]
        best = min(run.val, key=lambda r: r["val_loss"])
        rows.append(("validation loss", f"{first['val_loss']:.4f} (step {first['step']}) -> {last['val_loss']:.4f} "
                                        f"(step {last['step']}); best {best['val_loss']:.4f} (step {best['step']})"))
        if "val_bpb" in last:
            rows.append(("bits per byte", f"{first['val_bpb']:.4f} -> {last['val_bpb']:.4f}"))
        if "val_ppl" in last:
            rows.append(("perplexity", f"{first['val_ppl']:.2f} -> {last['val_ppl']:.2f}"))
    else:
        rows.append(("validation loss", "none logged (validation was off or had not run yet)"))
    if model.get("vocab_size"):
        # the loss of a model that knows nothing: the yardstick for "learned something"
        rows.append(("uniform guess", f"ln(vocab) = {math.log(model['vocab_size']):.4f}"))
    speeds = [r["tokens_per_s"] for r in run.train if "tokens_per_s" in r]
    if speeds:
        rows.append(("throughput", f"{statistics.median(speeds):,.0f} tokens/s (median of {len(speeds)} logs)"))
    skipped = run.train[-1].get("skipped_steps", 0) if run.train else 0
    if run.events or skipped:
        kinds = ", ".join(sorted({str(e["event"]) for e in run.events})) or "none"
        rows.append(("incidents", f"{skipped} skipped steps; events: {kinds}"))
    return rows


# ----------------------------------------------------------------------------------------------------------
# plots


def _matplotlib_figure():
    """matplotlib's Figure class, or None when matplotlib is not installed.

    Figure + savefig draws with the Agg canvas without going through pyplot, so no global backend is set
    and nothing tries to open a window (servers, CI, ssh sessions)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


def plot_run(run: RunMetrics, path: Path, Figure) -> Path:
    """Loss (training and validation) and learning rate against step, side by side, as one PNG."""
    fig = Figure(figsize=(10, 3.6), dpi=100)
    ax_loss, ax_lr = fig.subplots(1, 2)
    if run.train:
        ax_loss.plot([r["step"] for r in run.train], [r["loss"] for r in run.train], label="training loss",
                     color="tab:blue", linewidth=1.2)
    if run.val:
        ax_loss.plot([r["step"] for r in run.val], [r["val_loss"] for r in run.val], label="validation loss",
                     color="tab:orange", marker="o", markersize=3, linewidth=1.5)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.set_title(f"{run.name}: loss")
    ax_loss.grid(alpha=0.3)
    if run.train or run.val:
        ax_loss.legend()
    lr = [r for r in run.train if "lr" in r]
    if lr:
        ax_lr.plot([r["step"] for r in lr], [r["lr"] for r in lr], color="tab:green", linewidth=1.2)
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_title(f"{run.name}: learning rate")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


# ----------------------------------------------------------------------------------------------------------
# markdown


def _cell(value: Any) -> str:
    """Text safe inside a markdown table cell: one line, pipes escaped."""
    return " ".join(str(value).split()).replace("|", "\\|") or " "


def _samples_table(samples: list[dict]) -> list[str]:
    """Columns: question, reply, how it ended; plus the expected answer and whether the question was held
    out, when the samples carry them (the demo's do)."""
    extra = [("expected", "expected (docstring)"), ("held_out", "held out of SFT")]
    extra = [(k, title) for k, title in extra if any(k in s for s in samples)]
    header = ["question", "reply", "finish"] + [title for _, title in extra]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in samples:
        values = [s.get("question", ""), s.get("reply", ""), s.get("finish_reason", "")]
        for key, _ in extra:
            value = s.get(key, "")
            values.append(("yes" if value else "no") if isinstance(value, bool) else value)
        lines.append("| " + " | ".join(_cell(v) for v in values) + " |")
    return lines


def _unique_names(run_dirs: list[Path]) -> list[str]:
    names, seen = [], set()
    for i, run_dir in enumerate(run_dirs):
        name = run_dir.resolve().name or f"run{i}"
        if name in seen:
            name = f"{name}-{i}"
        seen.add(name)
        names.append(name)
    return names


def write_report(run_dirs: list[str | Path], out_path: str | Path, samples: list[dict] | None = None,
                 title: str = "nanoforge run report", preamble: str = "") -> Path:
    """Write a markdown report on the runs to out_path, with one PNG per run beside it
    (`<out stem>_<run name>.png`); return out_path.

    samples: replies to show in a table, each {"question", "reply", "finish_reason"} and optionally
    "expected" and "held_out". preamble: markdown placed under the title (the demo's summary)."""
    run_dirs = [Path(p) for p in run_dirs]
    if not run_dirs:
        raise NanoforgeError("no run directories given to report on")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    runs = [read_run(d, name) for d, name in zip(run_dirs, _unique_names(run_dirs))]
    Figure = _matplotlib_figure()

    lines = [f"# {title}", ""]
    if preamble:
        lines += [preamble.strip(), ""]
    if Figure is None:
        lines += [f"> {NO_MATPLOTLIB}", ""]
    for run in runs:
        lines += [f"## {run.name}", "", f"Run directory: `{run.run_dir}`", "", "| | |", "|---|---|"]
        lines += [f"| {label} | {_cell(value)} |" for label, value in summarize(run)]
        lines.append("")
        if Figure is not None and (run.train or run.val):
            png = plot_run(run, out_path.with_name(f"{out_path.stem}_{run.name}.png"), Figure)
            lines += [f"![{run.name}: loss and learning rate]({png.name})", ""]
    if samples:
        lines += ["## Sample replies", ""] + _samples_table(samples) + [""]
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text("\n".join(lines), encoding="utf-8")
    tmp.replace(out_path)  # a reader never sees half a report
    return out_path
