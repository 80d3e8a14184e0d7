"""The plot grid of a run report (report/markdown.py): one PNG of a run's curves, or several runs drawn over each other.

matplotlib is optional; `matplotlib_figure()` says whether it is there."""
import io
import math
from pathlib import Path
from typing import Any, Sequence

from nanoforge.core.fsutil import write_atomic

# What the plot grid shows, panel by panel: (title, y label, [(record list, key, label)]).
PANELS = [
    ("loss", "nats/token", [("train", "loss", "training"), ("val", "val_loss", "validation")]),
    ("learning rate", "lr", [("train", "lr", None)]),
    ("gradient norm", "before clipping", [("train", "grad_norm", None)]),
    ("throughput", "tokens/s", [("train", "tokens_per_s", None)]),
    ("peak memory", "GB", [("train", "peak_mem_gb", None)]),
    ("validation bits per byte", "bits/byte", [("val", "val_bpb", None)]),
]


def matplotlib_figure():
    """matplotlib's Figure class, or None when matplotlib is not installed.

    Figure + savefig draws with the Agg canvas without going through pyplot, so no global backend is set
    and nothing tries to open a window (servers, CI, ssh sessions)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


def plot_runs(runs: Sequence[Any], path: Path, Figure, title: str) -> Path:
    """One PNG, a 2 x 3 grid (PANELS): loss, learning rate, grad norm, tokens/s, memory, validation bits per
    byte, against step. Several runs (report.RunMetrics: name, train and val records) are drawn over each
    other, one colour per run."""
    fig = Figure(figsize=(13, 7), dpi=80)  # fixed margins: tight_layout would cost a whole extra draw
    axes = fig.subplots(2, 3, gridspec_kw=dict(left=.06, right=.98, bottom=.08, top=.9, wspace=.28, hspace=.38))
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray"]
    for ax, (panel, ylabel, series) in zip(axes.flatten(), PANELS):
        drawn = False
        for i, run in enumerate(runs):
            color = colors[i % len(colors)]
            for source, key, label in series:
                points = [(r["step"], r[key]) for r in getattr(run, source)
                          if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
                if not points:
                    continue
                name = " ".join(x for x in ((run.name if len(runs) > 1 else ""), label or "") if x) or None
                style = dict(marker="o", markersize=3, linestyle="--") if source == "val" else {}
                ax.plot([p[0] for p in points], [p[1] for p in points], color=color, linewidth=1.3, label=name, **style)
                drawn = True
        ax.set(title=panel, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if drawn and ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=8)
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(title)
    png = io.BytesIO()
    fig.savefig(png, format="png")
    write_atomic(path, png.getvalue())
    return path
