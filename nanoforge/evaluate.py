"""Evaluation of a trained run: loss and bits per byte on data, multiple-choice benchmarks, and samples.

Three questions, one function each:

    evaluate_data     how well does the model predict this text?     loss, perplexity, bits per byte
    evaluate_choices  does it pick the right answer?                 accuracy per subject, 95% CI, chance
    generate_samples  what does it actually write?                   a few completions, samples.jsonl

Bits per byte (bpb) is the total negative log-likelihood in bits divided by the UTF-8 bytes of the text it
was measured on. Unlike loss per token it does not depend on the tokenizer, so two models with different
vocabularies can be compared on the same file (the measure of Gao et al. 2020, "The Pile", arXiv 2101.00027).

Multiple choice is scored the way small base models are usually scored (lm-evaluation-harness's
"acc"/"acc_norm"; GPT-3 paper, arXiv 2005.14165, sec. 2.4): each option's text is appended to a plain-text
prompt and its log-likelihood under the model is computed; the option with the highest one is the model's
answer. See docs/evaluation.md for the formats and why length-normalised scoring is the headline number.
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from nanoforge.data.batches import IGNORE
from nanoforge.data.jsonl import DataError
from nanoforge.errors import NanoforgeError

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
Z95 = 1.959963984540054  # two-sided 95% normal quantile


# ----------------------------------------------------------------------------------------------------------
# shared helpers


def own_validation_data(run) -> Path | None:
    """The prepared data directory a run trained on ([run] data of its config.toml) when it still exists, is
    pretraining or SFT data and its validation split holds tokens; None otherwise (a checkpoint of unknown
    origin, an HF directory, DPO pairs)."""
    from nanoforge.config import load_toml
    from nanoforge.data.shards import read_manifest
    path = Path(run)
    if path.parent.name == "checkpoints":  # a checkpoint directory: its run is two levels up
        path = path.parent.parent
    try:
        data = load_toml(path / "config.toml").get("run", {}).get("data")
        manifest = read_manifest(data) if data else None
        if manifest and manifest["kind"] in ("pretrain", "sft") and manifest["splits"]["val"]["tokens"] > 0:
            return Path(data)
    except (NanoforgeError, OSError, KeyError, TypeError):
        pass
    return None


def _load_run(run, device: str):
    """`run` is a run/checkpoint/HF directory, or an already loaded (model, tokenizer) pair (tests, training)."""
    from nanoforge.train.checkpoint import load_model
    from nanoforge.device import resolve_device

    dev = resolve_device(device)
    if isinstance(run, tuple):
        model, tokenizer = run
        return model.to(dev), tokenizer, dev, None
    model, tokenizer, ckpt = load_model(run, dev)
    return model, tokenizer, dev, ckpt


@contextlib.contextmanager
def _eval_mode(model):
    """model.eval() for the duration, then back to whatever mode it was in (a caller's training model)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def _check_precision(precision: str) -> None:
    if precision not in ("fp32", "bf16", "fp16"):
        raise NanoforgeError(f"--precision {precision!r} must be one of fp32, bf16, fp16")


def _context_length(model) -> int:
    """The most positions the model attends over (its trained max_seq_len)."""
    return int(model.cfg.max_seq_len)


def token_byte_lengths(tokenizer) -> np.ndarray | None:
    """UTF-8 bytes each token id stands for, (vocab,) int64; 0 for special tokens. None if the tokenizer is
    not byte-level BPE (then a token's bytes are not a property of the token alone).

    In byte-level BPE (GPT-2's scheme) every character of a token's string is one byte of the text mapped to
    a printable character, so the byte length is the string length. Summed over the tokens of a text this
    gives exactly the text's UTF-8 bytes, which is what bpb divides by."""
    from tokenizers import decoders, pre_tokenizers

    inner = tokenizer.backend
    if not isinstance(inner.decoder, decoders.ByteLevel):
        return None
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    specials = {i for i, t in inner.get_added_tokens_decoder().items() if t.special}
    out = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for i in range(tokenizer.vocab_size):
        piece = inner.id_to_token(i)
        if piece is None or i in specials:
            continue
        if not all(c in alphabet for c in piece):
            return None  # a non-special added token written as plain text: byte length unknown, don't guess
        out[i] = len(piece)
    return out


class _Progress:
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
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# loss, perplexity and bits per byte on data


@dataclass
class _Totals:
    nll: float = 0.0  # nats, summed over scored tokens
    tokens: int = 0
    bytes: int = 0  # from the token byte table (0 when there is none)


def _rows_pretrain(shards, eos_id: int, seq_len: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Non-overlapping windows over [eos] + the split's token stream: window k predicts stream tokens
    [k*T, k*T + T), so every token of the split (each document's first token included, as the continuation
    of an end-of-text, which is how the model saw it in training) is scored exactly once. The last window
    is shorter."""
    n = shards.num_tokens
    for start in range(0, n, seq_len):
        # stream position p (with the leading eos at p=0) is split token p-1
        lo, hi = start, min(start + seq_len, n)  # labels: split tokens [lo, hi)
        ctx_lo = lo - 1
        if ctx_lo < 0:
            inputs = np.concatenate([[eos_id], shards.read(0, hi - 1)]) if hi > 1 else np.array([eos_id])
        else:
            inputs = shards.read(ctx_lo, hi - ctx_lo - 1)  # (hi-lo,)
        labels = shards.read(lo, hi - lo)
        yield inputs.astype(np.int64), labels.astype(np.int64)


def _rows_sft(shards, seq_len: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each conversation on its own (never attending to another), labels only on assistant tokens; one
    longer than the window is cut into consecutive windows, so every assistant token is still scored."""
    for i in range(shards.num_docs):
        tokens, mask = shards.doc(i)
        tokens = tokens.astype(np.int64)
        labels = np.where(mask[1:] == 1, tokens[1:], IGNORE)  # (n-1,)
        inputs = tokens[:-1]
        for start in range(0, len(inputs), seq_len):
            lab = labels[start:start + seq_len]
            if (lab != IGNORE).any():
                yield inputs[start:start + seq_len], lab


def _score_rows(model, rows: Iterable[tuple[np.ndarray, np.ndarray]], batch_size: int, device, precision: str,
                byte_table: np.ndarray | None, max_tokens: int | None, progress: _Progress) -> tuple[_Totals, bool]:
    """Sum of next-token NLL over all labelled positions of `rows` (right-padded into batches; padding comes
    after the real tokens, so causal attention never sees it). Returns the totals and whether max_tokens cut
    the data short."""
    from nanoforge.device import autocast_context

    totals = _Totals()
    batch: list[tuple[np.ndarray, np.ndarray]] = []
    truncated = False

    def flush():
        T = max(len(x) for x, _ in batch)
        inputs = torch.zeros(len(batch), T, dtype=torch.long)
        labels = torch.full((len(batch), T), IGNORE, dtype=torch.long)
        for r, (x, y) in enumerate(batch):
            inputs[r, :len(x)] = torch.from_numpy(x)
            labels[r, :len(y)] = torch.from_numpy(y)
        inputs, labels = inputs.to(device), labels.to(device)
        with torch.no_grad(), autocast_context(device, precision):
            logits = model(inputs)  # (B, T, V)
        # float32 softmax: bf16 logits lose the small differences the loss is made of
        nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                              reduction="sum")
        totals.nll += float(nll.double())
        supervised = labels[labels != IGNORE].cpu().numpy()
        totals.tokens += int(supervised.size)
        if byte_table is not None:
            totals.bytes += int(byte_table[supervised].sum())
        batch.clear()
        progress.update(totals.tokens, f"loss {totals.nll / max(totals.tokens, 1):.4f}")

    for x, y in rows:
        if max_tokens is not None:
            room = max_tokens - totals.tokens - sum(int((b != IGNORE).sum()) for _, b in batch)
            if room <= 0:
                truncated = True
                break
            keep = np.flatnonzero(y != IGNORE)
            if len(keep) > room:  # cut the row after its room-th labelled token
                y = y[:keep[room - 1] + 1]
                x = x[:len(y)]
                truncated = True
        batch.append((x, y))
        if len(batch) == batch_size:
            flush()
        if truncated:
            break
    if batch:
        flush()
    return totals, truncated


def evaluate_data(run, data_paths, batch_size: int = 8, seq_len: int | None = None, max_tokens: int | None = None,
                  precision: str = "fp32", device: str = "auto", progress: bool = True, split: str = "all",
                  log: Callable[[str], None] = print) -> dict:
    """Loss, perplexity and bits per byte of `run` on JSONL files (pretrain or SFT) or a prepared directory.

    Raw JSONL is tokenized with the run's own tokenizer into a temporary prepared directory (val_fraction
    0: every record counts). Pretraining data: every token is scored once, in non-overlapping windows of
    seq_len (default: the model's max_seq_len) over the packed stream, as training validation does; bpb
    divides by the exact UTF-8 bytes of the texts (end-of-text tokens are scored, like any token, but have no
    bytes). SFT data: only assistant tokens (replies and their <|im_end|>) are scored, each conversation on
    its own; bpb divides by the bytes of those replies, counted from the tokens, which is exact for
    byte-level BPE (and left out for other tokenizers). A prepared directory is scored over `split`
    ("all", "train" or "val"). `run` may also be a loaded (model, tokenizer) pair. Prints a table through
    `log` and returns the numbers.
    """
    from nanoforge.data.prepare import prepare_dataset
    from nanoforge.data.shards import TokenShards, check_tokenizer, read_manifest
    from nanoforge.data.sources import data_kind

    _check_precision(precision)
    if batch_size < 1:
        raise NanoforgeError(f"--batch-size must be >= 1, got {batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise NanoforgeError(f"--max-tokens must be >= 1, got {max_tokens}")
    if split not in ("all", "train", "val"):
        raise NanoforgeError(f"split {split!r} must be all, train or val")
    paths = [data_paths] if isinstance(data_paths, (str, os.PathLike)) else list(data_paths)
    if not paths:
        raise NanoforgeError("--data: give one or more JSONL files or a prepared directory")
    model, tokenizer, dev, ckpt = _load_run(run, device)
    window = _context_length(model)
    seq_len = seq_len or window
    if not 1 <= seq_len <= window:
        raise NanoforgeError(f"--seq-len {seq_len} must be between 1 and the model's max_seq_len {window}")

    with tempfile.TemporaryDirectory(prefix="nanoforge-eval-") as tmp:
        if len(paths) == 1 and Path(paths[0]).is_dir():
            data_dir = Path(paths[0])
            read_manifest(data_dir)
            check_tokenizer(data_dir, tokenizer)
        else:
            for p in paths:
                if Path(p).is_dir():
                    raise NanoforgeError(f"{p}: a directory; give JSONL files, or one directory made by "
                                         "`nanoforge prepare`")
            kind = data_kind([str(p) for p in paths])
            if kind not in ("pretrain", "sft"):
                raise NanoforgeError(f"{paths[0]}: {kind} data; evaluate pretraining or SFT data "
                                     "(a DPO pair has no single reference text)")
            data_dir = Path(tmp) / "data"
            prepare_dataset(kind, paths, tokenizer, data_dir, val_fraction=0.0, workers=1,
                            log=log if progress else (lambda *a: None))
        manifest = read_manifest(data_dir)
        kind = manifest["kind"]
        if kind not in ("pretrain", "sft"):
            raise NanoforgeError(f"{data_dir}: prepared as {kind!r}; evaluate pretraining or SFT data")
        splits = [s for s in ("train", "val") if split in ("all", s) and manifest["splits"][s]["tokens"] > 0]
        if not splits:
            raise NanoforgeError(f"{data_dir}: split {split!r} holds no tokens")
        byte_table = token_byte_lengths(tokenizer)
        total_tokens = sum(manifest["splits"][s]["tokens"] for s in splits)
        bar = _Progress(progress, "eval tokens", total_tokens if kind == "pretrain" else None)
        totals, truncated = _Totals(), False
        for s in splits:
            shards = TokenShards(data_dir, s)
            if kind == "pretrain":
                if tokenizer.eos_id is None:
                    raise NanoforgeError("the tokenizer has no end-of-text token to start the stream with")
                rows = _rows_pretrain(shards, tokenizer.eos_id, seq_len)
            else:
                rows = _rows_sft(shards, seq_len)
            budget = None if max_tokens is None else max_tokens - totals.tokens
            with _eval_mode(model):
                part, truncated = _score_rows(model, rows, batch_size, dev, precision, byte_table, budget, bar)
            totals.nll += part.nll
            totals.tokens += part.tokens
            totals.bytes += part.bytes
            if truncated:
                break
        bar.close()
        text_bytes = sum(manifest["splits"][s]["bytes"] for s in splits)

    if totals.tokens == 0:
        raise NanoforgeError(f"{paths[0]}: nothing to score (no supervised tokens)")
    loss = totals.nll / totals.tokens
    result = {"kind": kind, "data": [str(p) for p in paths], "checkpoint": str(ckpt) if ckpt else None,
              "tokens": totals.tokens, "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
              "seq_len": seq_len, "precision": precision, "truncated": truncated}
    if kind == "pretrain" and not truncated:
        nbytes, how = text_bytes, "UTF-8 bytes of the texts"
    elif byte_table is not None:
        nbytes, how = totals.bytes, ("UTF-8 bytes of the scored tokens" if kind == "pretrain"
                                     else "UTF-8 bytes of the assistant replies")
    else:
        nbytes, how = 0, None
    if nbytes > 0:
        result.update(bytes=nbytes, bpb=totals.nll / math.log(2) / nbytes, bytes_counted=how)
    else:
        result["bpb_note"] = ("bits per byte left out: this tokenizer is not byte-level BPE, so the bytes of "
                              "the scored tokens cannot be counted exactly")
    rows_out = [["loss (nats/token)", f"{loss:.4f}"], ["perplexity", f"{result['perplexity']:.2f}"],
                ["bits per byte", f"{result['bpb']:.4f}" if "bpb" in result else "n/a"],
                ["tokens scored", f"{totals.tokens:,}"], ["bytes", f"{nbytes:,}" if nbytes else "n/a"]]
    log(format_table([f"{kind} data" + (" (cut at --max-tokens)" if truncated else ""), "value"], rows_out))
    return result


# ----------------------------------------------------------------------------------------------------------
# multiple-choice benchmarks


@dataclass
class Question:
    question: str
    choices: list[str]
    answer: int  # index into choices
    subject: str = "all"
    where: str = ""  # file:line, for messages


def _answer_index(value, n_choices: int, path, line: int, letters_only: bool, name: str = "answer") -> int:
    """An answer given as a 0-based index (JSONL only) or a letter A, B, ... -> index; else a DataError
    naming the field `name`."""
    if isinstance(value, bool):
        value = None
    if isinstance(value, int) and not letters_only:
        if not 0 <= value < n_choices:
            raise DataError(f"index {value} is out of range for {n_choices} choices (0..{n_choices - 1})",
                            path, line, name)
        return value
    if isinstance(value, str) and len(value.strip()) == 1 and value.strip().upper() in LETTERS[:n_choices]:
        return LETTERS.index(value.strip().upper())
    allowed = ", ".join(LETTERS[:n_choices])
    if letters_only and value == "":
        raise DataError(f"is empty; it must be one of {allowed} (C-Eval's test split has no public answers: "
                        "evaluate its val split)", path, line, name)
    raise DataError(f"{value!r} is not one of {allowed}" + ("" if letters_only else f" or an index 0..{n_choices - 1}"),
                    path, line, name)


def read_choices_jsonl(path) -> list[Question]:
    """`{"question": str, "choices": [str, ...], "answer": index or letter, "subject"?: str}` per line."""
    from nanoforge.data.jsonl import check_input_file

    path = check_input_file(path)
    out = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            raw = raw.removeprefix(b"\xef\xbb\xbf") if line_no == 1 else raw
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"not valid JSON: {e}", path, line_no) from None
            if not isinstance(obj, dict):
                raise DataError("a record must be a JSON object", path, line_no)
            q, choices = obj.get("question"), obj.get("choices")
            if not isinstance(q, str) or not q.strip():
                raise DataError("missing or not a non-empty string", path, line_no, '"question"')
            if not isinstance(choices, list) or len(choices) < 2:
                raise DataError("must be a list of at least 2 strings", path, line_no, '"choices"')
            for i, c in enumerate(choices):
                if not isinstance(c, str) or not c.strip():
                    raise DataError("must be a non-empty string", path, line_no, f'"choices"[{i}]')
            if "answer" not in obj:
                raise DataError("missing", path, line_no, '"answer"')
            answer = _answer_index(obj["answer"], len(choices), path, line_no, letters_only=False, name='"answer"')
            subject = obj.get("subject", "all")
            if not isinstance(subject, str) or not subject:
                raise DataError("must be a non-empty string", path, line_no, '"subject"')
            out.append(Question(q, list(choices), answer, subject, f"{path}:{line_no}"))
    if not out:
        raise DataError("has no questions", path)
    return out


def _subject_of(path: Path) -> str:
    stem = path.stem
    for suffix in ("_dev", "_val", "_test"):
        if stem.endswith(suffix):
            return stem[:-len(suffix)]
    return stem


def read_choices_csv(path) -> list[Question]:
    """One C-Eval / CMMLU subject file: a header naming question, A, B, C, D and answer (any case; other
    columns such as id or explanation are ignored), one question per row. Subject = file stem without a
    _dev/_val/_test suffix."""
    path = Path(path)
    subject = _subject_of(path)
    out = []
    try:
        f = open(path, encoding="utf-8-sig", newline="")
    except OSError as e:
        raise DataError(f"cannot be read: {e.strerror}", path) from None
    with f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None:
                raise DataError("is empty (expected a header row: id,question,A,B,C,D,answer)", path, 1)
            names = [h.strip().lower() for h in header]
            need = ["question", "a", "b", "c", "d", "answer"]
            missing = [n for n in need if n not in names]
            if missing:
                raise DataError(f"header {header} lacks column(s) {', '.join(missing)}; expected "
                                "id,question,A,B,C,D,answer", path, 1, "header")
            col = {n: names.index(n) for n in need}
            start = reader.line_num + 1
            for row in reader:
                line = start
                start = reader.line_num + 1
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != len(header):
                    raise DataError(f"has {len(row)} columns but the header has {len(header)} "
                                    f"({','.join(header)}); is a comma inside a field not quoted?",
                                    path, line, "columns")
                q = row[col["question"]].strip()
                if not q:
                    raise DataError("is empty", path, line, "question")
                choices = [row[col[k]].strip() for k in "abcd"]
                for k, c in zip("ABCD", choices):
                    if not c:
                        raise DataError("is empty", path, line, k)
                answer = _answer_index(row[col["answer"]].strip(), 4, path, line, letters_only=True)
                out.append(Question(q, choices, answer, subject, f"{path}:{line}"))
        except csv.Error as e:
            raise DataError(f"malformed CSV: {e}", path, reader.line_num) from None
        except UnicodeDecodeError as e:
            raise DataError(f"not UTF-8 text: {e}", path) from None
    if not out:
        raise DataError("has no questions", path)
    return out


def load_benchmark(bench_path, fmt: str = "auto", dev_path=None) -> tuple[list[Question], list[Question]]:
    """(questions, dev examples for k-shot) from a JSONL file, a CSV file, or a C-Eval/CMMLU directory.

    Directories: CSV files directly inside are one subject each; otherwise the benchmark's layout is used,
    C-Eval `val/` (its `test/` has no public answers) and CMMLU `test/`, with `dev/` beside them for shots."""
    bench_path = Path(bench_path)
    if fmt not in ("auto", "jsonl", "ceval", "cmmlu", "csv"):
        raise NanoforgeError(f"--format {fmt!r} must be one of auto, jsonl, ceval, cmmlu, csv")
    if not bench_path.exists():
        raise NanoforgeError(f"{bench_path}: no such benchmark file or directory")
    if fmt == "auto":
        fmt = "jsonl" if bench_path.is_file() and bench_path.suffix == ".jsonl" else "csv"

    def read_any(path: Path) -> list[Question]:
        if path.is_file():
            return read_choices_jsonl(path) if path.suffix == ".jsonl" else read_choices_csv(path)
        files = sorted(path.glob("*.csv"))
        if not files:
            raise NanoforgeError(f"{path}: no .csv files in this directory")
        return [q for p in files for q in read_choices_csv(p)]

    if fmt == "jsonl":
        if bench_path.is_dir():
            raise NanoforgeError(f"{bench_path}: a directory; --format jsonl takes one .jsonl file")
        questions = read_choices_jsonl(bench_path)
        dev = read_choices_jsonl(dev_path) if dev_path else []
        return questions, dev
    if bench_path.is_file() or any(bench_path.glob("*.csv")):
        questions_dir, dev_dir = bench_path, None
    else:
        wanted = {"ceval": ["val"], "cmmlu": ["test"]}.get(fmt, ["val", "test"])
        found = [bench_path / w for w in wanted if (bench_path / w).is_dir()]
        if not found:
            raise NanoforgeError(f"{bench_path}: no CSV files and no {' or '.join(w + '/' for w in wanted)} "
                                 f"subfolder (C-Eval: dev/ val/ test/; CMMLU: dev/ test/)")
        questions_dir = found[0]
        dev_dir = bench_path / "dev" if (bench_path / "dev").is_dir() else None
    questions = read_any(questions_dir)
    dev_source = Path(dev_path) if dev_path else dev_dir
    dev = read_any(dev_source) if dev_source else []
    return questions, dev


def build_prompt(question: str, shots: Sequence[Question] = ()) -> str:
    """Plain-text continuation prompt (no chat template: the format a base model can complete):

        Question: <shot question>
        Answer: <shot's correct option>

        Question: <question>
        Answer:

    The option being scored follows as " <option text>"."""
    parts = [f"Question: {s.question}\nAnswer: {s.choices[s.answer]}" for s in shots]
    parts.append(f"Question: {question}\nAnswer:")
    return "\n\n".join(parts)


def pick_shots(q: Question, dev: Sequence[Question], shots: int) -> list[Question]:
    """The first `shots` dev examples of the question's subject (or of any subject when the dev set has none
    for it), never the question itself."""
    if shots <= 0 or not dev:
        return []
    same = [d for d in dev if d.subject == q.subject and d.question != q.question]
    pool = same or [d for d in dev if d.question != q.question]
    return pool[:shots]


def _option_logprobs(model, sequences: list[tuple[list[int], list[int]]], batch_size: int, device,
                     precision: str, progress: _Progress) -> list[float]:
    """Sum of log p(option tokens | context) for each (context ids, option ids). Sequences longer than the
    model's window lose their oldest context tokens (the option is always kept whole when it fits)."""
    from nanoforge.device import autocast_context

    window = _context_length(model)
    prepared = []
    for ctx, opt in sequences:
        opt = opt[:window - 1]
        ctx = ctx[-(window - len(opt)):]
        prepared.append((ctx + opt, len(ctx)))
    order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0]))  # similar lengths together
    out = [0.0] * len(prepared)
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        T = len(prepared[idx[0]][0]) - 1
        inputs = torch.zeros(len(idx), T, dtype=torch.long)
        labels = torch.full((len(idx), T), IGNORE, dtype=torch.long)
        for r, i in enumerate(idx):
            ids, n_ctx = prepared[i]
            seq = torch.tensor(ids, dtype=torch.long)
            inputs[r, :len(ids) - 1] = seq[:-1]
            labels[r, n_ctx - 1:len(ids) - 1] = seq[n_ctx:]  # only the option's tokens are scored
        inputs, labels = inputs.to(device), labels.to(device)
        with torch.no_grad(), autocast_context(device, precision):
            logits = model(inputs)  # (B, T, V)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
        picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
        sums = (picked * (labels != IGNORE)).sum(dim=1).double().cpu().tolist()
        for r, i in enumerate(idx):
            out[i] = sums[r]
        progress.update(b + len(idx))
    return out


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927): unlike p +- z*sqrt(p(1-p)/n) it stays
    inside [0, 1] and is honest for small n and for p near 0 or 1, which small benchmarks often are."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _summary(items: list[dict]) -> dict:
    n = len(items)
    correct = sum(i["correct_norm"] for i in items)
    correct_sum = sum(i["correct_sum"] for i in items)
    return {"n": n, "acc": correct / n, "ci95": list(wilson_interval(correct, n)),
            "acc_sum": correct_sum / n, "ci95_sum": list(wilson_interval(correct_sum, n)),
            "chance": sum(1 / i["n_choices"] for i in items) / n}


def evaluate_choices(run, bench_path, fmt: str = "auto", shots: int = 0, dev_path=None, batch_size: int = 16,
                     limit: int | None = None, precision: str = "fp32", device: str = "auto",
                     progress: bool = True, log: Callable[[str], None] = print, return_items: bool = False) -> dict:
    """Accuracy of `run` on a multiple-choice benchmark, per subject and overall, with 95% Wilson intervals.

    Each option is scored by its log-likelihood after `build_prompt(question, shots)`; two decision rules
    are reported: "acc" (the primary one) picks the highest log-likelihood per UTF-8 byte of the option
    text, "acc_sum" the highest total. Per byte, because a total favours short options (every extra token
    costs probability) and bytes, unlike tokens, do not depend on the tokenizer (lm-evaluation-harness's
    acc_norm). shots > 0 prepends that many solved examples of the same subject from the dev split (C-Eval/
    CMMLU dev/, or `dev_path`). limit keeps the first N questions (a quick look). `run` may be a loaded
    (model, tokenizer) pair.
    """
    _check_precision(precision)
    if shots < 0:
        raise NanoforgeError(f"--shots must be >= 0, got {shots}")
    questions, dev = load_benchmark(bench_path, fmt, dev_path)
    if shots and not dev:
        raise NanoforgeError(f"--shots {shots} needs solved examples: a dev/ folder beside the benchmark's "
                             f"questions, or --dev FILE")
    if limit is not None:
        questions = questions[:limit]
    model, tokenizer, dev_device, ckpt = _load_run(run, device)

    sequences, spans, prompts = [], [], []
    for q in questions:
        prompt = build_prompt(q.question, pick_shots(q, dev, shots))
        prompts.append(prompt)
        ctx = tokenizer.encode(prompt)
        start = len(sequences)
        for c in q.choices:
            # the separating space goes with the option: byte-level BPE attaches a space to the following
            # word, so "Answer:" + " Paris" tokenizes as the model saw such text in training
            sequences.append((ctx, tokenizer.encode(" " + c)))
        spans.append((start, len(sequences)))
    bar = _Progress(progress, "options scored", len(sequences))
    with _eval_mode(model):
        logprobs = _option_logprobs(model, sequences, batch_size, dev_device, precision, bar)
    bar.close()

    items = []
    for q, (a, b), prompt in zip(questions, spans, prompts):
        lp = logprobs[a:b]
        per_byte = [v / max(len(c.encode("utf-8")), 1) for v, c in zip(lp, q.choices)]
        pred_norm, pred_sum = int(np.argmax(per_byte)), int(np.argmax(lp))
        items.append({"where": q.where, "subject": q.subject, "answer": q.answer, "n_choices": len(q.choices),
                      "logprob": lp, "pred": pred_norm, "pred_sum": pred_sum,
                      "correct_norm": pred_norm == q.answer, "correct_sum": pred_sum == q.answer})
    subjects = {}
    for s in sorted({i["subject"] for i in items}):
        subjects[s] = _summary([i for i in items if i["subject"] == s])
    overall = _summary(items)
    result = {"benchmark": str(bench_path), "format": fmt, "shots": shots, "primary": "acc (log-likelihood per byte)",
              "checkpoint": str(ckpt) if ckpt else None, "overall": overall, "subjects": subjects,
              "prompt_example": prompts[0] + " " + questions[0].choices[questions[0].answer]}
    if return_items:
        result["items"] = items

    def row(name, s):
        return [name, s["n"], f"{s['acc']:.3f}", f"[{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]",
                f"{s['acc_sum']:.3f}", f"{s['chance']:.3f}"]
    table = [row(k, v) for k, v in subjects.items()]
    if len(subjects) > 1:
        table.append(row("overall", overall))
    log(format_table(["subject", "n", "acc", "95% CI", "acc_sum", "chance"], table))
    return result


# ----------------------------------------------------------------------------------------------------------
# samples


DEFAULT_PROMPTS = [
    "春天来了，",
    "从前有一座山，山里有",
    "中国的首都是",
    "Once upon a time, there was a",
    "The most important thing about learning is",
    "Water boils at",
]


def load_prompts(path) -> list[str]:
    """Prompts from a file: .jsonl with {"prompt": str} per line, or plain text, one prompt per line
    (a literal \\n in a text line stands for a newline)."""
    from nanoforge.data.jsonl import check_input_file

    path = check_input_file(path)
    prompts = []
    with open(path, encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"not valid JSON: {e}", path, line_no) from None
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
                    raise DataError("must be a non-empty string", path, line_no, '"prompt"')
                prompts.append(obj["prompt"])
            else:
                prompts.append(line.rstrip("\r\n").replace("\\n", "\n"))
    if not prompts:
        raise DataError("has no prompts", path)
    return prompts


def generate_samples(model, tokenizer, prompts: Sequence[str] | None = None, sampling=None, chat: bool = False,
                     precision: str = "fp32") -> list[dict]:
    """Complete each prompt; return [{"prompt", "text", "finish_reason", "new_tokens"}].

    chat=False continues the prompt as plain text (a base model); chat=True sends it as a user message
    through the chat template and stops at <|im_end|> (an SFT model). sampling defaults to temperature 0.8,
    top_p 0.95, 64 new tokens, seed 0, so samples from successive checkpoints are comparable."""
    from nanoforge.infer.generate import SamplingConfig, complete

    prompts = list(DEFAULT_PROMPTS if prompts is None else prompts)
    sampling = sampling or SamplingConfig(temperature=0.8, top_p=0.95, max_new_tokens=64, seed=0)
    if chat:
        ids = [tokenizer.render_chat([{"role": "user", "content": p}], add_generation_prompt=True)[0]
               for p in prompts]
        stops = [t for t in (tokenizer.im_end_id, tokenizer.eos_id) if t is not None]
    else:
        ids = [tokenizer.encode(p) for p in prompts]
        stops = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    with _eval_mode(model):
        done = complete(model, tokenizer, ids, sampling, stop_ids=stops, precision=precision)
    return [{"prompt": p, "text": c.text, "finish_reason": c.finish_reason, "new_tokens": len(c.token_ids)}
            for p, c in zip(prompts, done)]


def write_samples(run_dir, samples: Sequence[dict], step: int | None = None) -> Path:
    """Append samples to RUN/samples.jsonl, one object per sample (with the step, when given)."""
    path = Path(run_dir) / "samples.jsonl"
    with open(path, "a", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps({**({"step": step} if step is not None else {}), **s}, ensure_ascii=False) + "\n")
    return path


# ----------------------------------------------------------------------------------------------------------
# what `nanoforge eval` calls


def run_eval(run, data=None, bench=None, fmt: str = "auto", shots: int = 0, dev=None, samples: bool = False,
             prompts_file=None, chat: bool = False, batch_size: int = 8, seq_len: int | None = None,
             max_tokens: int | None = None, limit: int | None = None, precision: str = "fp32",
             device: str = "auto", write: bool = True, json_out=None, progress: bool = True,
             split: str | None = None, log: Callable[[str], None] = print) -> dict:
    """`nanoforge eval RUN [--data F ...] [--bench PATH] [--samples]`: any of the three, loading the model
    once; writes RUN/samples.jsonl for --samples (unless write=False) and the whole result to --json.
    With none of them, the run's own held-out data: the whole validation split of the prepared directory it
    trained on (every token, whatever the batch size, unlike the capped validation during training).
    `split` picks the split of a prepared directory (default: all of --data; val of the run's own data)."""
    from nanoforge.infer.generate import SamplingConfig

    if not data and not bench and not samples:
        own = None if isinstance(run, tuple) else own_validation_data(run)
        if own is None:
            raise NanoforgeError("nothing to evaluate: give --data FILE..., --bench PATH and/or --samples "
                                 f"({run} has no prepared data with a validation split to default to)")
        data, split = [str(own)], split or "val"
        log(f"evaluating on the {split} split of {own}, the data the run trained on")
    model, tokenizer, dev_device, ckpt = _load_run(run, device)
    loaded = (model, tokenizer)
    out: dict = {"checkpoint": str(ckpt) if ckpt else None}
    if data:
        out["data"] = evaluate_data(loaded, data, batch_size=batch_size, seq_len=seq_len, max_tokens=max_tokens,
                                    precision=precision, device=str(dev_device), progress=progress,
                                    split=split or "all", log=log)
    if bench:
        out["bench"] = evaluate_choices(loaded, bench, fmt=fmt, shots=shots, dev_path=dev, batch_size=batch_size,
                                        limit=limit, precision=precision, device=str(dev_device),
                                        progress=progress, log=log)
    if samples:
        prompts = load_prompts(prompts_file) if prompts_file else None
        got = generate_samples(model, tokenizer, prompts, SamplingConfig(temperature=0.8, top_p=0.95,
                               max_new_tokens=64, seed=0), chat=chat, precision=precision)
        for s in got:
            log(f"--- {s['prompt']!r}\n{s['prompt']}{s['text']}")
        out["samples"] = got
        if write and ckpt is not None and not isinstance(run, tuple):
            step = None
            try:
                from nanoforge.train.checkpoint import load_state
                step = load_state(ckpt).get("step")
            except NanoforgeError:
                pass
            run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else Path(run)
            out["samples_file"] = str(write_samples(run_dir, got, step))
    if json_out:
        Path(json_out).write_text(json.dumps(out, ensure_ascii=False, indent=1), encoding="utf-8")
    return out
