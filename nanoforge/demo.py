"""`nanoforge demo`: the whole pipeline, on the CPU, in a few minutes, on a corpus every machine already has.

The corpus is documentation that ships with Python and with nanoforge's own dependencies, written by their
authors, not by us: the docstrings of the standard library, numpy, jinja2 and torch (read with `ast` from
the .py files; nothing is imported, since importing runs code and would take longer than the whole walk), and
the language-reference topics in `pydoc_data/topics.py` (the text behind `help("assert")`). It becomes:

    pretraining  {"text": "json.dumps(obj, *, skipkeys=False, ...)\\n\\nSerialize ``obj`` to a JSON ..."}
    SFT          {"conversations": [{"role": "user", "content": "What does json.dumps do?"},
                                    {"role": "assistant", "content": "Serialize ``obj`` to a JSON ..."}]}

SFT answers are the first paragraph of a docstring, short enough for a small model to learn to finish them
with <|im_end|>. A fixed set of questions is kept out of SFT (their docstrings stay in pretraining) and asked
at the end, next to a few questions SFT did see.

Then: train a tokenizer, prepare both sets, pretrain, fine-tune, ask the questions, write the report. The
training steps are sized from a measured step time so the whole run fits `minutes` on the machine at hand.
"""
from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Iterator

from nanoforge.errors import NanoforgeError

# ----------------------------------------------------------------------------------------------------------
# the corpus

# Standard-library directories that are not library documentation: tests, the IDLE and turtle demo apps,
# pip's bundled wheels, installed third-party packages, build configuration.
STDLIB_SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "ensurepip", "site-packages", "lib-dynload",
                    "lib2to3", "__pycache__"}
# nanoforge's dependencies whose Python sources carry real docstrings, in the order they are read. Parsing
# costs about 1 s per MB of docstrings here (torch: 650 files, 2.6 MB, 3.5 s), so all of them fit in the
# corpus budget; tokenizers and safetensors are compiled and document themselves in .pyi stubs we skip.
DEPENDENCIES = ("numpy", "jinja2", "torch")
# numpy.distutils is numpy's deprecated build tooling, not numpy's documentation
DEPENDENCY_SKIP_DIRS = {"test", "tests", "testing", "benchmarks", "distutils", "__pycache__"}

MAX_ANSWER_CHARS = 240  # longer first paragraphs are cut at a sentence end, or left out of SFT
MIN_ANSWER_CHARS = 20
TOPIC_CHUNK_CHARS = 2000  # reference topics run to 30 KB; cut into documents of about this size

# Asked after fine-tuning. HELD_OUT are kept out of SFT (their docstrings are in pretraining only), so a right
# answer shows SFT taught the model to *use* what pretraining put there; SEEN were in the SFT set.
HELD_OUT = ("json.dumps", "textwrap.dedent", "shutil.copyfile", "heapq.nlargest", "statistics.median",
            "glob.glob")
SEEN = ("json.loads", "shutil.rmtree", "os.walk")


@dataclass(frozen=True)
class DocEntry:
    """One documented thing: `name` is qualified (json.JSONEncoder.encode), `signature` the unparsed
    arguments without self/cls ("" for modules, topics and properties), `doc` the cleaned docstring."""
    name: str
    kind: str  # module | class | function | topic
    signature: str
    doc: str


def python_files(root: Path, package: str, skip_dirs: set[str]) -> Iterator[tuple[str, Path]]:
    """(dotted module name, path) of every public .py file under root, in sorted order (deterministic)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith((".", "_"))
                             and not d.startswith("config-"))
        rel = Path(dirpath).relative_to(root).parts
        for filename in sorted(filenames):
            if not filename.endswith(".py") or (filename.startswith("_") and filename != "__init__.py"):
                continue
            stem = filename[:-3]
            parts = ([package] if package else []) + list(rel) + ([] if stem == "__init__" else [stem])
            if parts:
                yield ".".join(parts), Path(dirpath) / filename


def module_docs(module: str, source: str) -> list[DocEntry]:
    """Docstrings of a module, its public classes and functions, and their public methods (not nested
    functions: those are implementation details). Source that does not parse gives nothing."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # e.g. files written for another Python version
        return []
    out = []
    doc = ast.get_docstring(tree)
    if doc:
        out.append(DocEntry(module, "module", "", doc))
    for node in tree.body:
        out.extend(_definition_docs(node, module, in_class=False))
    return out


def _definition_docs(node: ast.AST, prefix: str, in_class: bool) -> list[DocEntry]:
    if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
        return []
    name = f"{prefix}.{node.name}"
    out = []
    doc = ast.get_docstring(node)
    if isinstance(node, ast.ClassDef):
        if doc:
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            out.append(DocEntry(name, "class", _signature(init, True) if init else "", doc))
        for child in node.body:
            out.extend(_definition_docs(child, name, in_class=True))
    elif doc:
        out.append(DocEntry(name, "function", _signature(node, in_class), doc))
    return out


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> str:
    decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
    if "property" in decorators:
        return ""
    args = node.args
    if in_class and "staticmethod" not in decorators:
        positional = args.posonlyargs + args.args
        if positional and positional[0].arg in ("self", "cls", "mcls", "metacls"):
            args = ast.arguments(posonlyargs=args.posonlyargs[1:],
                                 args=args.args[1:] if not args.posonlyargs else args.args,
                                 vararg=args.vararg, kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults,
                                 kwarg=args.kwarg, defaults=args.defaults)
    return f"({ast.unparse(args)})"


def reference_topics(stdlib: Path) -> list[DocEntry]:
    """The language reference topics in pydoc_data/topics.py (a dict literal: read with ast, not imported).
    Each becomes one or more entries named by its heading, cut at paragraph ends into ~2 KB pieces."""
    path = stdlib / "pydoc_data" / "topics.py"
    if not path.is_file():
        return []  # some distributions strip it; the docstrings alone are still a corpus
    topics = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
    out = []
    for key in sorted(topics):
        text = topics[key].strip()
        title = text.split("\n", 1)[0].strip()
        for piece in _paragraph_chunks(text, TOPIC_CHUNK_CHARS):
            out.append(DocEntry(title, "topic", "", piece))
    return out


def _paragraph_chunks(text: str, size: int) -> list[str]:
    chunks, current = [], ""
    for paragraph in text.split("\n\n"):
        if current and len(current) + len(paragraph) > size:
            chunks.append(current.strip())
            current = ""
        current += paragraph + "\n\n"
    if current.strip():
        chunks.append(current.strip())
    return chunks


def collect_docs(max_chars: int) -> list[DocEntry]:
    """Every entry, in a fixed order (stdlib, reference topics, dependencies), until max_chars of docstrings."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    roots: list[tuple[Path, str, set[str]]] = [(stdlib, "", STDLIB_SKIP_DIRS)]
    for package in DEPENDENCIES:
        spec = find_spec(package)  # locates the package without running its __init__
        if spec is not None and spec.submodule_search_locations:
            roots.append((Path(list(spec.submodule_search_locations)[0]), package, DEPENDENCY_SKIP_DIRS))
    entries: list[DocEntry] = []
    total = 0
    seen: set[tuple[str, str]] = set()

    def add(items: list[DocEntry]) -> bool:
        nonlocal total
        for entry in items:
            if (entry.name, entry.doc) in seen:  # a module found twice (os.path = posixpath) etc.
                continue
            seen.add((entry.name, entry.doc))
            entries.append(entry)
            total += len(entry.doc)
            if total >= max_chars:
                return False
        return True

    for i, (root, package, skip) in enumerate(roots):
        for module, path in python_files(root, package, skip):
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if not add(module_docs(module, source)):
                return entries
        if i == 0 and not add(reference_topics(stdlib)):
            return entries
    return entries


def pretrain_text(entry: DocEntry) -> str:
    """How an entry reads in pretraining: the name as one would call it, a blank line, the documentation."""
    if entry.kind == "topic":
        return entry.doc
    head = {"module": f"module {entry.name}", "class": f"class {entry.name}{entry.signature}"}.get(
        entry.kind, f"{entry.name}{entry.signature}")
    return f"{head}\n\n{entry.doc}"


def first_paragraph(doc: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """The docstring's first paragraph on one line, if it makes a short prose answer; else None.

    Cut at the last sentence end within max_chars rather than mid-sentence: the model is to learn that an
    answer ends, and an answer cut off mid-word teaches the opposite. Paragraphs that are a signature, a
    doctest or reST markup are left out; they are not answers to "what does it do?"."""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    if len(paragraph) > max_chars:
        cut = paragraph.rfind(". ", 0, max_chars)
        paragraph = paragraph[:cut + 1] if cut > 0 else ""
    if len(paragraph) < MIN_ANSWER_CHARS or not paragraph[0].isalpha() or not paragraph.endswith((".", ")")):
        return None
    if any(mark in paragraph for mark in (">>>", "->", "::", "..", "|", "{", "==")):
        return None
    if re.match(r"[\w.]+\(", paragraph):  # "makedirs(name [, mode=0o777])": a signature, not prose
        return None
    return paragraph


_QUESTIONS = {
    "function": ("What does {} do?", "What is {} used for?", "Explain the function {}."),
    "class": ("What is {}?", "What is the class {} for?", "Explain the class {}."),
    "module": ("What is the {} module?", "What is the Python module {} for?"),
    "topic": ("Explain {} in Python.",),
}


def _pick(options: tuple[str, ...], key: str) -> str:
    # crc32, not hash(): str hashes are salted per process, and the corpus must be the same every run
    return options[zlib.crc32(key.encode("utf-8")) % len(options)]


def sft_conversations(entry: DocEntry) -> list[list[dict]]:
    """Questions about one entry with its documentation's first paragraph as the answer; functions with a
    short signature also get "How do I call X?" answered by the signature (recalled from pretraining)."""
    doc = entry.doc
    if entry.kind == "topic":
        # only a topic's first piece is asked about (the rest continue it); its answer follows the heading
        heading, _, doc = doc.partition("\n\n")
        if not heading.startswith(entry.name):
            return []
    answer = first_paragraph(doc)
    if answer is None:
        return []
    subject = _topic_subject(entry.name) if entry.kind == "topic" else entry.name
    out = [_conversation(_pick(_QUESTIONS[entry.kind], entry.name).format(subject), answer)]
    if entry.kind == "function" and 2 < len(entry.signature) <= 80 and zlib.crc32(entry.name.encode()) % 3 == 0:
        out.append(_conversation(f"How do I call {entry.name}?", f"{entry.name}{entry.signature}"))
    return out


def _topic_subject(title: str) -> str:
    return title[0].lower() + title[1:] if title.startswith(("The ", "A ", "An ")) else title


def _conversation(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def build_demo_corpus(out_dir: str | os.PathLike, max_mb: float = 8.0) -> tuple[Path, Path, list[dict]]:
    """Write pretrain.jsonl and sft.jsonl into out_dir; return their paths and the questions to ask at the end.

    max_mb caps the docstring text read (in the fixed order stdlib, reference topics, numpy, jinja2, torch).
    Each question is {"name", "question", "expected", "held_out"}; held-out names appear in pretraining only.
    The output is identical on every run on the same machine (sorted walk, no randomness).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = collect_docs(int(max_mb * 1e6))
    if not entries:
        raise NanoforgeError(f"found no documentation in {sysconfig.get_paths()['stdlib']}; the demo needs the "
                             "Python standard library sources (.py files), which this installation lacks")
    by_name = {e.name: e for e in entries if e.kind != "topic"}
    questions = []
    for name in HELD_OUT + SEEN:
        entry = by_name.get(name)
        for user, assistant in sft_conversations(entry) if entry else []:
            questions.append({"name": name, "question": user["content"], "expected": assistant["content"],
                              "held_out": name in HELD_OUT})
    held_out = {q["name"] for q in questions if q["held_out"]}

    pretrain_path, sft_path = out_dir / "pretrain.jsonl", out_dir / "sft.jsonl"
    with open(pretrain_path, "w", encoding="utf-8") as f:
        for entry in entries:
            f.write(json.dumps({"text": pretrain_text(entry)}, ensure_ascii=False) + "\n")
    with open(sft_path, "w", encoding="utf-8") as f:
        for entry in entries:
            if entry.name in held_out:
                continue
            for conversation in sft_conversations(entry):
                f.write(json.dumps({"conversations": conversation}, ensure_ascii=False) + "\n")
    return pretrain_path, sft_path, questions


# ----------------------------------------------------------------------------------------------------------
# the run

# How big each part of a run is. "full" is what `nanoforge demo` runs; "test" is the same pipeline shrunk to
# finish in well under a minute (the end-to-end test). Steps of None are sized from the time budget.
SCALES = {
    "full": dict(max_mb=8.0, vocab_size=4096, preset="demo", precision=None, pretrain_steps=None,
                 sft_steps=None, sft_lr=1e-3, max_new_tokens=96),
    "test": dict(max_mb=0.4, vocab_size=512, preset="tiny", precision="fp32", pretrain_steps=60, sft_steps=30,
                 sft_lr=3e-3, max_new_tokens=24),
}
VAL_FRACTION = 0.02  # of documents and of conversations: ~200 each, enough for a steady validation loss
# Share of the training time for pretraining. SFT needs a couple of hundred steps to move from one generic
# reply for every question ("Return the given value.", what 50 steps gave) to replies about the question.
PRETRAIN_SHARE = 0.65
# A step inside the training loop costs more than the bare step measure_step_seconds times: batches read from
# the shards, gradient clipping, logging, the start-up of the stage. Measured here: 0.40 s vs 0.32 s.
LOOP_OVERHEAD = 1.25
# Seconds kept back from the budget for what follows training: loading, the chat replies, the report, and
# each stage's start-up (TensorBoard, the MFU matmul probe, the final checkpoint). Measured: ~20 s here.
RESERVE_S = 20.0
MIN_STEPS, MAX_PRETRAIN_STEPS, MAX_SFT_STEPS = 50, 4000, 1500
DEMO_MARKER = ".nanoforge-demo"  # marks a directory the demo made, and may therefore wipe


def _say(text: str, quiet: bool) -> None:
    if not quiet:
        print(text, flush=True)


class _Clock:
    """Stage headers and timings: `[4/7] pretraining ...`, then `done in 171.3 s (total 3m30s)`."""

    def __init__(self, total_stages: int, quiet: bool):
        self.start = self.stage_start = time.perf_counter()
        self.total, self.index, self.quiet = total_stages, 0, quiet
        self.key = ""
        self.timings: dict[str, float] = {}  # seconds per stage, by short name

    def stage(self, key: str, title: str) -> None:
        self.index += 1
        self.key, self.stage_start = key, time.perf_counter()
        _say(f"\n[{self.index}/{self.total}] {title}", self.quiet)

    def done(self, note: str = "") -> None:
        from nanoforge.train.metrics import format_duration
        now = time.perf_counter()
        self.timings[self.key] = now - self.stage_start
        _say(f"    done in {now - self.stage_start:.1f} s (total {format_duration(now - self.start)})"
             + (f": {note}" if note else ""), self.quiet)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def fresh_work_dir(work_dir: Path, quiet: bool) -> None:
    """Start from an empty work_dir. A previous demo's directory is wiped; anything else is left alone."""
    if work_dir.exists() and any(work_dir.iterdir()):
        if not (work_dir / DEMO_MARKER).is_file():
            raise NanoforgeError(f"{work_dir} exists and was not made by `nanoforge demo`; remove it or pass "
                                 "another directory (--out)")
        _say(f"removing the previous demo in {work_dir}", quiet)
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / DEMO_MARKER).write_text("made by `nanoforge demo`; the next demo run wipes this directory\n")


def measure_step_seconds(mcfg, tcfg, precision: str, steps: int = 5, warmup: int = 2) -> float:
    """Seconds per optimizer step of this model shape on this machine: the fastest of `steps` after `warmup`
    untimed ones (the first steps allocate and pick kernels). The fastest, not the median: another program
    busy for a moment is noise, and sizing the run to it would shrink the model's training for nothing (a run
    slowed down for real is caught after pretraining, where SFT takes whatever time is left)."""
    import torch

    from nanoforge.model.gpt import GPT
    from nanoforge.train.loop import autocast_context
    from nanoforge.train.objectives import causal_lm_loss
    from nanoforge.train.optim import build_optimizer

    device = torch.device("cpu")
    model = GPT(mcfg)
    optimizer = build_optimizer(model, tcfg, device)
    ids = torch.randint(0, mcfg.vocab_size, (tcfg.batch_size, tcfg.seq_len))
    batch = {"input_ids": ids, "labels": ids}
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        with autocast_context(device, precision):
            loss_sum, n, _ = causal_lm_loss(model, batch)
        (loss_sum.float() / n).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return min(times[warmup:])


@dataclass
class Plan:
    precision: str
    pretrain_steps: int
    note: str  # what was measured, for the log and the report


def plan_pretraining(mcfg, tcfg, budget_s: float, precision: str | None, steps: int | None) -> Plan:
    """Pick the faster precision by measurement (bf16 autocast wins on CPUs with AVX512-BF16 or AMX and loses
    badly on older ones) and size pretraining to its share of budget_s. What the scale fixes is kept."""
    if precision and steps:
        return Plan(precision, steps, "steps and precision fixed by the scale")
    candidates = (precision,) if precision else ("fp32", "bf16")
    timings = {p: measure_step_seconds(mcfg, tcfg, p) for p in candidates}
    precision = min(timings, key=timings.get)
    # validation costs about a third of a training step per batch (forward only), every eval_every steps
    eval_share = tcfg.eval_batches / (3 * tcfg.eval_every)
    step_s = timings[precision] * LOOP_OVERHEAD * (1 + eval_share)
    if steps is None:
        steps = _round_steps(PRETRAIN_SHARE * budget_s / step_s, MAX_PRETRAIN_STEPS)
    note = ", ".join(f"{t:.2f} s/step in {p}" for p, t in timings.items()) + f" -> {precision}"
    return Plan(precision, steps, note)


def _round_steps(steps: float, most: int) -> int:
    return int(min(most, max(MIN_STEPS, steps // 10 * 10)))


def initial_val_loss(data_dir: Path, mcfg, tcfg, precision: str) -> float:
    """Validation loss of the weights pretraining starts from (same seed, so the same initial weights): the
    "before" that pretraining's validation losses are measured against."""
    import torch

    from nanoforge.data.batches import eval_batches
    from nanoforge.data.shards import TokenShards
    from nanoforge.model.gpt import GPT

    torch.manual_seed(tcfg.seed)
    model = GPT(mcfg)
    batches = eval_batches(TokenShards(data_dir, "val"), tcfg.batch_size, tcfg.seq_len, tcfg.eval_batches)
    return _mean_loss(model, batches, precision)


def sft_val_loss_before(pre_run: Path, data_dir: Path, tcfg, precision: str) -> float:
    """Loss on the held-out conversations' answers of the pretrained model, before any fine-tuning: the
    "before" of SFT's validation losses (the same batches the SFT stage evaluates on)."""
    from nanoforge.data.batches import SFTBatches
    from nanoforge.data.shards import TokenShards
    from nanoforge.train.checkpoint import load_model

    model, tokenizer, _ = load_model(pre_run)
    val = SFTBatches(TokenShards(data_dir, "val"), tcfg.batch_size, tcfg.seq_len, shuffle=False,
                     pad_id=tokenizer.pad_id)
    return _mean_loss(model, val.eval_batches(tcfg.eval_batches), precision)


def _mean_loss(model, batches, precision: str) -> float:
    import torch

    from nanoforge.train.loop import evaluate
    from nanoforge.train.objectives import causal_lm_loss

    loss, _, _ = evaluate(model, batches, causal_lm_loss, torch.device("cpu"), precision)
    return loss


def ask(run_dir: Path, questions: list[dict], max_new_tokens: int) -> list[dict]:
    """Greedy replies of the fine-tuned model to each question, rendered with the chat template it was
    trained on. Generation stops only at <|im_end|>, so finish_reason "stop" means the reply closed the way
    the template says and "length" that it ran on."""
    from nanoforge.infer.generate import SamplingConfig, complete
    from nanoforge.train.checkpoint import load_model

    model, tokenizer, _ = load_model(run_dir)
    prompts = [tokenizer.render_chat([{"role": "user", "content": q["question"]}], add_generation_prompt=True)[0]
               for q in questions]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens)
    completions = complete(model, tokenizer, prompts, cfg, stop_ids=[tokenizer.im_end_id])
    return [{**q, "reply": c.text.strip(), "finish_reason": c.finish_reason, "tokens": len(c.token_ids)}
            for q, c in zip(questions, completions)]


def _print_replies(samples: list[dict], quiet: bool) -> None:
    for s in samples:
        origin = "held out of SFT" if s["held_out"] else "in the SFT set"
        _say(f"\n  Q ({origin}): {s['question']}\n  A: {s['reply']}\n     [{s['finish_reason']}, "
             f"{s['tokens']} tokens]  docstring: {s['expected']}", quiet)


def _val_losses(run_dir: Path) -> list[float]:
    out = []
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if "val_loss" in record:
                out.append(record["val_loss"])
    return out


def run_demo(work_dir: str | os.PathLike = "runs/demo", minutes: float = 5.0, quiet: bool = False,
             scale: str = "full") -> Path:
    """`nanoforge demo`: corpus -> tokenizer -> prepare -> pretrain -> SFT -> chat replies -> report.

    work_dir is wiped first if an earlier demo made it (a marker file says so); any other non-empty
    directory is an error. `minutes` is the budget for the whole run: the training steps are sized from a
    measured step time to fit it. scale="test" shrinks everything to run in well under a minute. Returns the
    path of report.md."""
    from nanoforge.config import build_config
    from nanoforge.data.shards import prepare_dataset
    from nanoforge.report import write_report
    from nanoforge.tokenizer import train_tokenizer
    from nanoforge.train.metrics import format_duration
    from nanoforge.train.stages import pretrain, sft

    if scale not in SCALES:
        raise NanoforgeError(f"unknown demo scale {scale!r}; choose one of {', '.join(SCALES)}")
    if minutes <= 0:
        raise NanoforgeError(f"minutes={minutes} must be > 0")
    s = SCALES[scale]
    work_dir = Path(work_dir)
    deadline = time.perf_counter() + minutes * 60
    clock = _Clock(7, quiet)
    log = (lambda *a: None) if quiet else (lambda text: print(f"    {text}", flush=True))
    fresh_work_dir(work_dir, quiet)
    _say(f"nanoforge demo in {work_dir}: budget {minutes:g} min, CPU only, nothing downloaded", quiet)

    clock.stage("corpus", f"building the corpus from the documentation installed with Python "
                          f"{sys.version.split()[0]}, {', '.join(DEPENDENCIES)}")
    pretrain_jsonl, sft_jsonl, questions = build_demo_corpus(work_dir / "corpus", max_mb=s["max_mb"])
    n_docs, n_convs = _count_lines(pretrain_jsonl), _count_lines(sft_jsonl)
    corpus_mb = pretrain_jsonl.stat().st_size / 1e6
    clock.done(f"{n_docs} documents ({corpus_mb:.1f} MB), {n_convs} question/answer conversations")

    clock.stage("tokenizer", f"training a {s['vocab_size']}-token byte-level BPE tokenizer on the documents")
    tokenizer = train_tokenizer([pretrain_jsonl], vocab_size=s["vocab_size"], out_dir=work_dir / "tokenizer")
    clock.done()

    clock.stage("prepare", "tokenizing both sets into shards (2% of each held out for validation), then timing "
                           "a few training steps to size the run")
    pre_data, sft_data = work_dir / "data" / "pretrain", work_dir / "data" / "sft"
    prepare_dataset("pretrain", [pretrain_jsonl], tokenizer, pre_data, val_fraction=VAL_FRACTION, log=log)
    prepare_dataset("sft", [sft_jsonl], tokenizer, sft_data, val_fraction=VAL_FRACTION, log=log)
    mcfg, tcfg = build_config(s["preset"], overrides={"vocab_size": tokenizer.vocab_size, "device": "cpu"})
    budget = deadline - time.perf_counter() - RESERVE_S
    plan = plan_pretraining(mcfg, tcfg, budget, s["precision"], s["pretrain_steps"])
    start_loss = initial_val_loss(pre_data, mcfg, tcfg, plan.precision)
    clock.done(f"measured {plan.note}")

    clock.stage("pretrain", f"pretraining a {s['preset']}-preset GPT for {plan.pretrain_steps} steps "
                            f"(validation loss before training: {start_loss:.3f})")
    pre_run, sft_run = work_dir / "pretrain", work_dir / "sft"
    common = {"device": "cpu", "precision": plan.precision}
    pretrain([str(pre_data)], pre_run, preset=s["preset"], quiet=quiet,
             overrides={**common, "vocab_size": tokenizer.vocab_size, "max_steps": plan.pretrain_steps})
    end_loss = _val_losses(pre_run)[-1]
    clock.done(f"validation loss {start_loss:.3f} -> {end_loss:.3f}")

    sft_start = sft_val_loss_before(pre_run, sft_data, tcfg, plan.precision)
    sft_steps = s["sft_steps"]
    if sft_steps is None:
        # Pretraining took what it took (a busy machine is slower than the measurement, an idle one faster):
        # SFT gets the time that is left, at pretraining's real pace (evaluations included), so the run ends on
        # time. Its steps cost about what pretraining's do: measured 0.37 s against 0.34-0.40 s here.
        left = deadline - time.perf_counter() - RESERVE_S
        sft_steps = _round_steps(left / (clock.timings["pretrain"] / plan.pretrain_steps), MAX_SFT_STEPS)
    clock.stage("sft", f"fine-tuning on the question/answer conversations for {sft_steps} steps (validation "
                       f"loss on the answers before fine-tuning: {sft_start:.3f})")
    sft(str(pre_run), [str(sft_data)], sft_run, quiet=quiet,
        overrides={**common, "max_steps": sft_steps, "lr": s["sft_lr"], "warmup_steps": min(20, sft_steps // 5),
                   "eval_every": tcfg.eval_every, "eval_batches": tcfg.eval_batches,
                   "batch_size": tcfg.batch_size, "save_every": 0, "keep_last": 1})
    sft_end = _val_losses(sft_run)[-1]
    clock.done(f"validation loss on the answers {sft_start:.3f} -> {sft_end:.3f}")

    clock.stage("chat", f"asking {len(questions)} questions (greedy decoding, stop at <|im_end|>)")
    samples = ask(sft_run, questions, s["max_new_tokens"])
    _print_replies(samples, quiet)
    closed = sum(x["finish_reason"] == "stop" for x in samples)
    clock.done(f"{closed}/{len(samples)} replies ended with <|im_end|>")

    clock.stage("report", "writing the report")
    summary = (f"The whole pipeline on this machine's CPU: {n_docs} documents ({corpus_mb:.1f} MB) of "
               f"docstrings and reference text installed with Python {sys.version.split()[0]} and "
               f"{', '.join(DEPENDENCIES)}, and {n_convs} question/answer conversations made from them.\n\n"
               f"- Pretraining validation loss: **{start_loss:.3f}** before training (ln(vocab) = "
               f"{math.log(mcfg.vocab_size):.3f} is a uniform guess) -> **{end_loss:.3f}** after "
               f"{plan.pretrain_steps} steps.\n"
               f"- SFT validation loss (answer tokens of held-out conversations): **{sft_start:.3f}** for the "
               f"pretrained model -> **{sft_end:.3f}** after {sft_steps} steps of fine-tuning.\n"
               f"- Replies that closed with <|im_end|> (greedy, at most {s['max_new_tokens']} tokens): "
               f"**{closed}/{len(samples)}**.\n"
               f"- Precision {plan.precision}: {plan.note}.\n"
               f"- Stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in clock.timings.items()) +
               f"; total {format_duration(clock.elapsed())}.")
    report = write_report([pre_run, sft_run], work_dir / "report.md", samples=samples, title="nanoforge demo",
                          preamble=summary)
    clock.done()
    _say(f"\npretraining validation loss {start_loss:.3f} -> {end_loss:.3f}; SFT {sft_start:.3f} -> {sft_end:.3f}; "
         f"{closed}/{len(samples)} replies closed with "
         f"<|im_end|>; whole demo {format_duration(clock.elapsed())}\nreport: {report}", quiet)
    return report


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)
