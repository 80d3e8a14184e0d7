"""Run reports: a markdown page with the numbers that say whether a run learned, and PNG plots of its curves.

Everything comes from what a run directory already holds (report/runs.py reads it) and the data directory's
`manifest.json`. A report never loads weights or torch, so it can be written while a run is still going, or long
after, on a machine without them. Every training command writes RUN/report.md when it finishes
(`write_run_report`); `nanoforge report RUN [RUN...] --out FILE.md` writes one on demand and compares runs.
matplotlib is optional (the `report` extra): without it the report is written all the same, with a line
saying how to get the plots, as a missing plotting library must never cost anyone their numbers."""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from nanoforge.core.config import MODEL_FIELDS, ModelConfig
from nanoforge.core.durations import format_duration
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import check_out_apart, write_atomic, writing
from nanoforge.report.plot import matplotlib_figure, plot_runs
from nanoforge.report.runs import RunMetrics, read_run
from nanoforge.train.world import is_main
from nanoforge.weights.layout import read_parts

NO_MATPLOTLIB = ("Plots were skipped: matplotlib is not installed. `pip install matplotlib` (or nanoforge's "
                 "`report` extra) and run `nanoforge report` again to get them.")

# Keys of the final-metrics table, in order; any other val_* a stage logs (DPO's accuracy...) follows.
FINAL_TRAIN_KEYS = ["loss", "lr", "grad_norm", "tokens_per_s", "supervised_tokens_per_s", "mfu", "peak_mem_gb",
                    "skipped_steps"]
FINAL_VAL_KEYS = ["val_loss", "val_ppl", "val_bpb"]


# -------------------------------------------------------------------------------------------------- numbers

def count_params(model_config: dict[str, Any], exclude_embeddings: bool = False) -> int | None:
    """Parameters of the model a config describes (ModelConfig.num_params: nothing is built)."""
    try:
        cfg = ModelConfig(**{k: v for k, v in model_config.items() if k in MODEL_FIELDS})
        cfg.validate()
        return cfg.num_params(exclude_embeddings=exclude_embeddings)
    except Exception:  # a config from another version: the report goes on without the count
        return None


def fmt_number(value: Any) -> str:
    """How the tables print a logged number: 6 significant digits (tests parse it back)."""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def tokens_per_step(run: RunMetrics) -> int:
    """Tokens in one optimizer step: from the checkpoint's count when there is one (it knows the number of
    processes), else batch x seq_len x grad_accum of the config."""
    seen, step = run.state.get("run_state", {}).get("tokens_seen"), run.state.get("run_state", {}).get("step")
    if seen and step:
        return round(seen / step)
    train = run.config.get("train", {})
    return train.get("batch_size", 0) * train.get("seq_len", 0) * train.get("grad_accum", 1)


def time_rows(run: RunMetrics) -> list[tuple[str, str]]:
    """Wall time, time spent in training steps, tokens seen."""
    rows: list[tuple[str, str]] = []
    last_step = max([r["step"] for r in run.train + run.val] or [0])
    per_step = tokens_per_step(run)
    # Each training record's tokens_per_s covers the steps since the previous record: their time is
    # tokens / (tokens/s). Summed, that is the time in training steps (no validation, samples or saving).
    step_time, previous = 0.0, 0
    for r in run.train:
        if r.get("tokens_per_s"):
            step_time += (r["step"] - previous) * per_step / r["tokens_per_s"]
        previous = r["step"]
    timed = [r for r in run.train + run.val + run.events if isinstance(r.get("time"), (int, float))]
    if len(timed) >= 2:
        first = min(timed, key=lambda r: r["time"])
        first_window = (first["step"] * per_step / first["tokens_per_s"]) if first.get("tokens_per_s") else 0.0
        wall = max(r["time"] for r in timed) - first["time"] + first_window
        rows.append(("wall time", f"{format_duration(wall)} (first to last log, including validation, samples "
                                  f"and checkpoints; a resumed run's pause counts too)"))
    else:
        rows.append(("wall time", "not recorded (metrics.jsonl has no \"time\" fields)"))
    if step_time:
        rows.append(("time in training steps", format_duration(step_time)))
    seen = run.state.get("run_state", {}).get("tokens_seen")
    if seen and run.state.get("run_state", {}).get("step") == last_step:
        rows.append(("tokens seen", f"{seen:,} ({last_step} steps)"))
    elif per_step and last_step:
        rows.append(("tokens seen", f"{last_step * per_step:,} ({last_step} steps x {per_step:,} tokens)"))
    speeds = [r["tokens_per_s"] for r in run.train if "tokens_per_s" in r]
    if speeds:
        rows.append(("throughput", f"{statistics.median(speeds):,.0f} tokens/s (median of {len(speeds)} logs)"))
    return rows


def final_metrics(run: RunMetrics) -> list[tuple[str, Any, int]]:
    """(key, value, step) of the last training record's and the last validation record's numbers."""
    rows: list[tuple[str, Any, int]] = []
    if run.train:
        last = run.train[-1]
        extra = sorted(k for k in last if k not in FINAL_TRAIN_KEYS and k not in ("step", "time")
                       and isinstance(last[k], (int, float)) and not isinstance(last[k], bool))
        rows += [(k, last[k], last["step"]) for k in FINAL_TRAIN_KEYS + extra if k in last]
    if run.val:
        last = run.val[-1]
        extra = sorted(k for k in last if k.startswith("val_") and k not in FINAL_VAL_KEYS)
        rows += [(k, last[k], last["step"]) for k in FINAL_VAL_KEYS + extra if k in last]
        best = min(run.val, key=lambda r: r["val_loss"])
        rows.append(("best val_loss", best["val_loss"], best["step"]))
    return rows


def summarize(run: RunMetrics) -> list[tuple[str, str]]:
    """(label, value) rows for one run's table."""
    model, train, info = run.config.get("model", {}), run.config.get("train", {}), run.config.get("run", {})
    rows = [(label, str(info[key])) for key, label in (("stage", "stage"), ("init", "initialised from"))
            if info.get(key)]
    if model:
        if (params := count_params(model)) is not None:
            rows.append(("parameters", _millions(params)))
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
                                        f"(step {last['step']}); best {best['val_loss']:.4f} (step {best['step']})"
                     + (f"; each over {last['val_count']:,} {_val_unit(run)}" if "val_count" in last else "")))
        if "val_bpb" in last:
            rows.append(("bits per byte", f"{first['val_bpb']:.4f} -> {last['val_bpb']:.4f}"))
        if "val_ppl" in last:
            rows.append(("perplexity", f"{first['val_ppl']:.2f} -> {last['val_ppl']:.2f}"))
    else:
        rows.append(("validation loss", "none logged (validation was off or had not run yet)"))
    if model.get("vocab_size"):
        # the loss of a model that knows nothing: the yardstick for "learned something"
        rows.append(("uniform guess", f"ln(vocab) = {math.log(model['vocab_size']):.4f}"))
    skipped = run.train[-1].get("skipped_steps", 0) if run.train else 0
    if run.events or skipped:
        kinds = ", ".join(sorted({str(e["event"]) for e in run.events})) or "none"
        rows.append(("incidents", f"{skipped} skipped steps; events: {kinds}"))
    return rows


def parameter_rows(run: RunMetrics) -> list[tuple[str, str]]:
    model, info = run.config.get("model", {}), run.config.get("run", {})
    total = count_params(model) if model else None
    if total is None:
        return []
    body = count_params(model, exclude_embeddings=True)
    rows = [("total", f"{total:,}")]
    if body is not None:
        tied = "tied with the output layer" if model.get("tie_embeddings", True) else "input only"
        rows += [("token embedding", f"{total - body:,} ({tied})"), ("everything else", f"{body:,}")]
    if model.get("n_experts"):
        rows.append(("experts", f"{model['n_experts']} per layer, {model.get('experts_per_token')} active per token"))
    if info.get("stage") == "lora":
        rows.append(("trained", f"LoRA adapters only: rank {info.get('rank')}, alpha {info.get('alpha')}, "
                                f"on {info.get('targets')}"))
    return rows


def data_rows(run: RunMetrics) -> list[tuple[str, str]]:
    """The data directory the run read, from its manifest.json."""
    data = run.config.get("run", {}).get("data")
    if not data:
        return []
    rows = [("directory", f"`{data}`")]
    try:
        manifest = json.loads((Path(data) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return rows + [("manifest", "not readable here (the data directory has moved or was deleted)")]
    rows.append(("kind", str(manifest.get("kind"))))
    for split in ("train", "val"):
        if s := manifest.get("splits", {}).get(split):
            rows.append((split, f"{s.get('tokens', 0):,} tokens, {s.get('docs', 0):,} documents, "
                                f"{s.get('bytes', 0):,} bytes"))
    for src in manifest.get("sources", []):
        rows.append(("source", f"{Path(src.get('path', '?')).name}: {src.get('records', '?'):,} records, "
                               f"{src.get('bytes', 0):,} bytes"))
    if tok := manifest.get("tokenizer", {}):
        rows.append(("tokenizer", f"vocab {tok.get('vocab_size')}, sha256 {str(tok.get('sha256', ''))[:12]}"))
    return rows


# ------------------------------------------------------------------------------------------------- markdown

def _cell(value: Any) -> str:
    """Text safe inside a markdown table cell: one line, pipes escaped."""
    return " ".join(str(value).split()).replace("|", "\\|") or " "


def _table(rows: list[tuple[str, str]]) -> list[str]:
    return ["| | |", "|---|---|"] + [f"| {label} | {_cell(value)} |" for label, value in rows] + [""]


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


def _run_section(run: RunMetrics, out_path: Path, Figure, png_name: str) -> list[str]:
    lines = [f"## {run.name}", "", f"Run directory: `{run.run_dir}`", ""] + _table(summarize(run))
    if Figure is not None and (run.train or run.val):
        png = plot_runs([run], out_path.with_name(png_name), Figure, run.name)
        lines += [f"![{run.name}: loss, learning rate, grad norm, tokens/s, memory, bits per byte]({png.name})", ""]
    if final := final_metrics(run):
        lines += ["### Final metrics", "", "| metric | value | step |", "|---|---|---|"]
        lines += [f"| {key} | {fmt_number(value)} | {step} |" for key, value, step in final] + [""]
    lines += ["### Time", ""] + _table(time_rows(run))
    for heading, rows in (("Parameters", parameter_rows(run)), ("Data", data_rows(run))):
        if rows:
            lines += [f"### {heading}", ""] + _table(rows)
    if run.samples:  # the latest step's
        step = max(s["step"] for s in run.samples)
        lines += [f"### Samples (step {step})", "", "| prompt | completion | finish |", "|---|---|---|"]
        lines += [f"| {_cell(s.get('prompt', ''))} | {_cell(s.get('text', ''))} | {_cell(s.get('finish_reason', ''))} |"
                  for s in run.samples if s["step"] == step] + [""]
    if (run.run_dir / "config.toml").is_file():
        lines += ["### Config", "", "<details><summary>config.toml as used</summary>", "", "```toml",
                  (run.run_dir / "config.toml").read_text(encoding="utf-8").strip(), "```", "", "</details>", ""]
    return lines


def _comparison(runs: list[RunMetrics], out_path: Path, Figure) -> list[str]:
    """One column per run: the numbers to compare at a glance, and all curves on one grid."""
    def last(records, key):
        values = [r[key] for r in records if key in r]
        return fmt_number(values[-1]) if values else "-"

    rows = [
        ("stage", [str(r.config.get("run", {}).get("stage", "-")) for r in runs]),
        ("parameters", [_millions(count_params(r.config["model"])) if r.config.get("model") else "-"
                        for r in runs]),
        ("last step", [str(max([x["step"] for x in r.train + r.val] or [0])) for r in runs]),
        ("final training loss", [last(r.train, "loss") for r in runs]),
        ("final validation loss", [last(r.val, "val_loss") for r in runs]),
        ("best validation loss", [fmt_number(min(x["val_loss"] for x in r.val)) if r.val else "-" for r in runs]),
        ("final val bits per byte", [last(r.val, "val_bpb") for r in runs]),
        ("tokens/s (last log)", [last(r.train, "tokens_per_s") for r in runs]),
        ("peak memory GB", [last(r.train, "peak_mem_gb") for r in runs]),
    ]
    counts = [r.val[-1].get("val_count") if r.val else None for r in runs]
    rows.insert(5, ("validation scored on", [f"{c:,} {_val_unit(r)}" if c else "-" for c, r in zip(counts, runs)]))
    lines = ["## Comparison", "", "| | " + " | ".join(_cell(r.name) for r in runs) + " |", "|---|" + "---|" * len(runs)]
    lines += [f"| {label} | " + " | ".join(_cell(v) for v in values) + " |" for label, values in rows] + [""]
    if len({c for c in counts if c}) > 1:
        lines += ["Note: the validation losses above are means over different amounts of validation data "
                  "(validation takes eval_batches x batch_size windows, and the data may differ): compare them "
                  "with care, or evaluate every run on the same file with `nanoforge eval RUN --data FILE`.", ""]
    if Figure is not None and any(r.train or r.val for r in runs):
        png = plot_runs(runs, out_path.with_name(f"{out_path.stem}_comparison.png"), Figure,
                        " vs ".join(r.name for r in runs))
        lines += [f"![comparison of {', '.join(r.name for r in runs)}]({png.name})", ""]
    return lines


def _val_unit(run: RunMetrics) -> str:
    return "pairs" if run.config.get("run", {}).get("stage") == "dpo" else "tokens"


def _millions(n: int | None) -> str:
    return f"{n / 1e6:.2f}M" if n else "-"


def _unique_names(run_dirs: list[Path]) -> list[str]:
    """The directory names; where two are the same (runs/zh/run, runs/en/run), the parent's name is put in front
    (zh-run, en-run), and a number after it if that is not enough."""
    paths = [d.resolve() for d in run_dirs]
    base = [p.name or f"run{i}" for i, p in enumerate(paths)]
    names, seen = [], set()
    for i, (path, name) in enumerate(zip(paths, base)):
        if base.count(name) > 1 and path.parent.name:
            name = f"{path.parent.name}-{name}"
        if name in seen:
            name = f"{name}-{i}"
        seen.add(name)
        names.append(name)
    return names


def write_report(run_dirs: list[str | Path], out_path: str | Path, samples: list[dict] | None = None,
                 title: str = "nanoforge run report", preamble: str = "") -> Path:
    """Write a markdown report on the runs to out_path, with PNGs beside it: `<out stem>.png` for one run;
    for several, `<out stem>_<run name>.png` per run and `<out stem>_comparison.png`. Return out_path.

    samples: replies to show in a table, each {"question", "reply", "finish_reason"} and optionally
    "expected" and "held_out". preamble: markdown placed under the title (the demo's summary)."""
    run_dirs = [Path(p) for p in run_dirs]
    if not run_dirs:
        raise NanoforgeError("no run directories given to report on")
    out_path = Path(out_path)
    runs = [read_run(d, name) for d, name in zip(run_dirs, _unique_names(run_dirs))]
    check_out_apart(out_path, [part for d in run_dirs for part in read_parts(d)])  # a run's report.md: beside them
    with writing(out_path):  # each file whole or not there (fsutil.write_atomic), a failure one line
        out_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out_path, "\n".join(_report_lines(runs, out_path, title, preamble, samples)))
    return out_path


def _report_lines(runs: list[RunMetrics], out_path: Path, title: str, preamble: str,
                  samples: list[dict] | None) -> list[str]:
    """The report's markdown lines; its PNGs are written beside out_path as they are drawn."""
    Figure = matplotlib_figure()
    lines = [f"# {title}", ""]
    if preamble:
        lines += [preamble.strip(), ""]
    if Figure is None:
        lines += [f"> {NO_MATPLOTLIB}", ""]
    if len(runs) > 1:
        lines += _comparison(runs, out_path, Figure)
    for run in runs:
        png_name = f"{out_path.stem}.png" if len(runs) == 1 else f"{out_path.stem}_{run.name}.png"
        lines += _run_section(run, out_path, Figure, png_name)
    if samples:
        lines += ["## Sample replies", ""] + _samples_table(samples) + [""]
    return lines


def write_run_report(run_dir: str | Path, quiet: bool = False, stopped: str = "") -> Path | None:
    """RUN/report.md at the end of a training command, on rank 0 only. A failure here must never fail or
    lose a finished run (its checkpoint is already written): it is a warning on stderr, and None. `stopped`:
    why a run ended early (the interruption's message), shown under the title."""
    if not is_main():
        return None
    run_dir = Path(run_dir)
    try:
        stage = read_run(run_dir).config.get("run", {}).get("stage")
        path = write_report([run_dir], run_dir / "report.md",
                            title=f"nanoforge {stage or 'run'} report: {run_dir.resolve().name}",
                            preamble=f"> Stopped early: {stopped}" if stopped else "")
    except Exception as e:  # noqa: BLE001 (anything: a full disk, a plotting bug, a half-written file)
        print(f"warning: the run {'stopped' if stopped else 'finished'}, but its report could not be written: "
              f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return None
    if not quiet:
        print(f"report: {path}", file=sys.stderr, flush=True)
    return path
