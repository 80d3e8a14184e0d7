"""What the evaluations (eval/run.py, eval/) share: the model to score, the lines of a JSONL benchmark, the
records whose prompt fits, a progress line and the printed table."""
import sys
import time
from typing import Iterable, Iterator, Sequence

from nanoforge.data.jsonl import line_json, line_text
from nanoforge.core.device import resolve_device
from nanoforge.core.errors import NanoforgeError
from nanoforge.weights.load import load_model


def load_run(run, device: str):
    """`run` is a run/checkpoint/HF directory, or an already loaded (model, tokenizer) pair (tests, training)."""
    dev = resolve_device(device)
    if isinstance(run, tuple):
        model, tokenizer, ckpt = (*run, None)
    else:  # loaded to be read only: frozen, so its linears may read packed weights (model/linear.py)
        model, tokenizer, ckpt = load_model(run, dev)
        model.requires_grad_(False)
    return model.to(dev), tokenizer, dev, ckpt


def json_lines(path) -> Iterator[tuple[int, object]]:
    """(line number, JSON value) of each non-blank line of a benchmark's JSONL file, read as every JSONL file is
    (data/jsonl.py: line 1's BOM dropped, strict UTF-8, Unicode strings); DataError naming file:line otherwise."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            text = line_text(raw, path, line_no)
            if text is not None:
                yield line_no, line_json(text, path, line_no)


def fitting(items: list, wheres: list[str], conversations: list, what: str, model, max_new_tokens: int, log):
    """(items, conversations) of the conversations (infer/turns.py) whose prompt fit the model's context, and the
    file:line of those that did not: nothing was generated for them, so they are reported through `log`, never
    scored."""
    fit = [bool(r.replies) or r.end != "context" for r in conversations]
    skipped = [w for w, ok in zip(wheres, fit) if not ok]
    why = (f"the prompt and --max-new-tokens {max_new_tokens} do not fit the model's context "
           f"({model.context_length} tokens)")
    if len(skipped) == len(conversations):
        raise NanoforgeError(f"none of the {len(conversations):,} {what} can be scored: {why}")
    if skipped:
        log(f"{len(skipped):,} of {len(conversations):,} {what} skipped, not scored: {why}; first: "
            f"{', '.join(skipped[:3])}")
    return [x for x, ok in zip(items, fit) if ok], [r for r, ok in zip(conversations, fit) if ok], skipped


class Progress:
    """One updating line on stderr (only when asked for and stderr is the place for it)."""

    def __init__(self, enabled: bool, what: str, total: int | None = None):
        self.enabled, self.what, self.total = enabled, what, total
        self.started = time.perf_counter()
        self.last = 0.0

    def update(self, done: int, extra: str = "") -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < 0.5:
            return
        self.last = now
        rate = done / max(now - self.started, 1e-9)
        total = f"/{self.total:,}" if self.total else ""
        print(f"\r{self.what}: {done:,}{total} ({rate:,.0f}/s) {extra}   ", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.last:
            print(file=sys.stderr, flush=True)


def format_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A plain aligned text table (what `nanoforge eval` prints)."""
    cells = [[str(h) for h in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
