"""The parallel half of `nanoforge prepare` (data/prepare.py): input files read in chunks, and each chunk
parsed, validated and tokenized in a worker process.

A plain-text file (.txt, .text, .md) is pretraining text, read in chunks cut where the pre-tokenizer would split
anyway (chat/pieces.py), and joined back into whole documents. With val_fraction f = 0 it is one train document; with
f > 0 its tail is held out, as nanoGPT does with one corpus file: the val document starts at the first line start
at or after byte size - floor(f*size), the head is the train one, each exactly its text tokenized plus eos (the
manifest's source says "val_from_byte", 2 records). With no line start in that tail it stays whole in train, and
the log says so. Text files do not count in JSONL's per-record split draw, so JSONL records get the same split
whatever .txt files come before them.

The parent reads each file in ~2 MB chunks of whole lines for worker processes to parse, validate and tokenize;
results are written in input order, so the output is byte-identical for any number of workers. At most 2 chunks
per worker are in flight, which bounds memory whatever the input size (`Pool.imap` would read ahead)."""
from __future__ import annotations

import hashlib
import math
import multiprocessing
import os
import signal
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from nanoforge.data.columnar import as_row_error, check_row, hash_source, is_columnar, row_chunks
from nanoforge.data.parts import range_line_chunks
from nanoforge.data.jsonl import MAX_RECORD_BYTES, UTF8_BOM, DataError, SkipCounter, parse_lines
from nanoforge.data.sft_records import drops_empty_think, render_sft_record
from nanoforge.data.sources import is_plain_text
from nanoforge.chat.pieces import PIECE_CHARS, text_cut
from nanoforge.chat.tokenizer import ChatTemplateError
from nanoforge.core.interrupt import exit_with_parent

@dataclass
class SourceStats:
    """What the manifest records about one input file; filled in as its chunks are read and processed."""

    path: Path
    records: int = 0
    size: int = 0
    hasher: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    skips: SkipCounter = field(default_factory=SkipCounter)
    # plain text with val_fraction > 0: the byte offset and line where its val document starts, or why
    # the file stays whole in train
    val_start: int | None = None
    val_line: int = 0
    kept_whole: str = ""
    # prepare --part (data/parts.py): the byte range of the file this part reads, the line it starts at, and
    # the records before it in the whole input (where this part's val draw starts counting)
    byte_range: tuple[int, int] | None = None
    first_line: int = 1
    records_before: int = 0

    def to_json(self) -> dict:
        return {"path": str(self.path.resolve()), "bytes": self.size, "sha256": self.hasher.hexdigest(),
                "records": self.records, "skipped": self.skips.skipped,
                **({"val_from_byte": self.val_start} if self.val_start is not None else {}),
                **({"byte_range": list(self.byte_range)} if self.byte_range is not None else {})}


# ---- reading chunks

@dataclass
class ChunkTask:
    kind: str
    file_index: int
    path: str
    first_line: int
    data: bytes
    skip_invalid: bool
    rows: list | None = None  # Parquet / datasets rows as records (data/columnar.py); first_line is a row number
    # plain text: the chunk is a piece of one of the file's documents (its head, or its held-out tail when
    # `text_val`); `text_end` says it is the last piece of that document
    plain_text: bool = False
    text_end: bool = True
    text_val: bool = False
    drop_empty_think: float = 0.0  # sft: the seeded share of records rendered without empty think blocks


def chunk_tasks(kind: str, sources: list[SourceStats], chunk_bytes: int, skip_invalid: bool,
                 val_fraction: float = 0.0, split_pattern: str | None = "gpt-2",
                 drop_empty_think: float = 0.0, text_column: str = "text") -> Iterator[ChunkTask]:
    for index, source in enumerate(sources):
        if is_columnar(source.path):
            source.size = hash_source(source.path, source.hasher)
            for first_row, rows in row_chunks(source.path, kind, text_column):
                yield ChunkTask(kind, index, str(source.path), first_row, b"", skip_invalid, rows,
                                drop_empty_think=drop_empty_think)
            continue
        if is_plain_text(source.path):
            if kind != "pretrain":
                raise DataError(f"plain text is pretraining data; {kind} needs JSONL records", source.path)
            for first_line, data, last, val in _text_chunks(source, chunk_bytes, val_fraction, split_pattern):
                yield ChunkTask(kind, index, str(source.path), first_line, data, skip_invalid,
                                plain_text=True, text_end=last, text_val=val)
            continue
        for first_line, data in range_line_chunks(source, chunk_bytes):
            yield ChunkTask(kind, index, str(source.path), first_line, data, skip_invalid,
                            drop_empty_think=drop_empty_think)


def _text_val_target(size: int, val_fraction: float) -> int | None:
    """The byte offset from which a plain-text file of `size` bytes is held out: its val document starts at
    the first line start at or after it. None when there is nothing to hold out (val_fraction*size < 1)."""
    held_out = math.floor(val_fraction * size)
    return size - held_out if held_out > 0 else None


def _text_chunks(source: SourceStats, chunk_bytes: int, val_fraction: float = 0.0,
                 split_pattern: str | None = "gpt-2") -> Iterator[tuple[int, bytes, bool, bool]]:
    """(first line number, bytes, ends its document, is in the val document) pieces of a plain-text file, each cut
    by text_cut (chat/pieces.py); hashes and sizes the file on the way, holding at most a chunk (plus one unbroken
    stretch).

    With val_fraction > 0 the head ends with the first line break at or after byte target - 1 (_text_val_target,
    from the file's stat), so the tail starts at a line start; no other piece of the head reaches past it. Head and
    tail are tokenized as two texts (each exactly encode(its text) + eos), so this cut may go after the line break."""
    target = _text_val_target(source.path.stat().st_size, val_fraction)
    line_no, pending, offset, in_val = 1, b"", 0, False  # offset: where `pending` starts in the file
    with open(source.path, "rb") as f:
        block = f.read(chunk_bytes)
        while block:
            source.hasher.update(block)
            source.size += len(block)
            data = pending + block
            block = f.read(chunk_bytes)
            if target is not None and not in_val:  # the head: look for the line break that ends it
                newline = data.find(b"\n", max(target - 1 - offset, 0))
                if newline >= 0 and (newline + 1 < len(data) or block):  # the tail is not empty
                    yield line_no, data[:newline + 1], True, False
                    line_no += data.count(b"\n", 0, newline + 1)
                    source.val_start, source.val_line = offset + newline + 1, line_no
                    data, offset, in_val = data[newline + 1:], offset + newline + 1, True
                elif not block:
                    source.kept_whole = (f"no line starts in its last {source.size - target:,} bytes "
                                         f"({val_fraction:g} of the file) to hold out for validation")
                    target = None
            cut = text_cut(data, split_pattern) if block else len(data)
            if cut == 0:  # no place to cut yet: keep reading, but not without bound
                if len(data) > MAX_RECORD_BYTES:
                    raise DataError(f"no line break in {len(data) / 1e6:.0f} MB; plain text is read in pieces "
                                    "cut at line breaks", source.path, line_no)
                pending = data
                continue
            yield line_no, data[:cut], not block, in_val
            line_no += data.count(b"\n", 0, cut)
            pending, offset = data[cut:], offset + cut
    if val_fraction > 0 and target is None and not source.kept_whole and source.size:
        source.kept_whole = (f"{source.size:,} bytes are too few to hold out {val_fraction:g} of them "
                             "for validation")


# ---- encoding chunks (runs in the workers)

@dataclass
class ChunkResult:
    file_index: int
    tokens: np.ndarray  # (N,) all documents of the chunk, concatenated
    doc_lens: np.ndarray  # (D,) int64 tokens per document
    doc_bytes: np.ndarray  # (D,) int64 UTF-8 bytes of each document's source text
    mask: np.ndarray | None  # (N,) uint8 loss mask for sft and dpo
    skips: SkipCounter
    continues: bool = False  # the last document goes on in the next chunk (a piece of a plain-text file)
    text_split: str = ""  # plain text: the split its document goes to (JSONL: "", drawn per record)


_worker_tokenizer = None


def _init_worker(tokenizer, parent: int) -> None:
    """Pool initializer: one tokenizer per process; no Rust threads (the processes are the parallelism); gone
    with the parent (a prepare killed with SIGKILL)."""
    global _worker_tokenizer
    exit_with_parent(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C reaches the whole process group; the parent handles it (and terminates us), so the workers
    # must not print a traceback each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_tokenizer = tokenizer


def _encode_chunk_in_worker(task: ChunkTask) -> ChunkResult:
    return encode_chunk(task, _worker_tokenizer)


def token_dtype(tokenizer) -> type:
    """How prepared tokens are stored: uint16 when the vocabulary fits, else uint32."""
    return np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32


def encode_chunk(task: ChunkTask, tokenizer) -> ChunkResult:
    """Parse, validate and tokenize the lines (or Parquet / datasets rows) of one chunk. Raises the DataError of
    its first bad line; a row's errors say `row N`."""
    if task.plain_text:
        return _encode_text(task, tokenizer)
    skips = SkipCounter()
    records = (list(parse_lines(task.data.split(b"\n"), task.kind, task.path, task.first_line, task.skip_invalid,
                                skips)) if task.rows is None else _checked_rows(task, skips))
    encode = {"pretrain": _encode_pretrain, "sft": _encode_sft, "dpo": _encode_dpo}[task.kind]
    try:
        tokens, lens, nbytes, mask = encode(records, tokenizer, token_dtype(tokenizer), task, skips)
    except DataError as e:
        raise (e if task.rows is None else as_row_error(e)) from None
    return ChunkResult(task.file_index, tokens, lens, nbytes, mask, skips)


def _checked_rows(task: ChunkTask, skips: SkipCounter) -> list[tuple[int, dict]]:
    """(row number, record) of each row that passes the checks of a JSONL record."""
    records = []
    for row, record in enumerate(task.rows, start=task.first_line):
        try:
            records.append((row, check_row(task.kind, record, task.path, row)))
        except DataError as e:
            if not task.skip_invalid:
                raise
            skips.add(e)
    return records


def _encode_pretrain(records, tokenizer, dtype, task: ChunkTask, skips: SkipCounter):
    """Each document is encode(text) + [eos]. The tokenizer encodes the texts PIECE_CHARS at a time, a long one in
    pieces (chat/pieces.py: the same ids, memory bounded by the piece); their ids are collected in flat lists
    turned into arrays now and then (one numpy conversion per document would cost more than the encoding)."""
    texts = [record["text"] for _, record in records]
    arrays, flat, lens, previous = [], [], [1] * len(texts), None  # each document's length counts its eos
    for index, ids in tokenizer.encode_pieces(texts):
        if previous is not None and index != previous:
            flat.append(tokenizer.eos_id)
        flat.extend(ids)
        lens[index] += len(ids)
        previous = index
        if len(flat) >= PIECE_CHARS:
            arrays.append(np.array(flat, dtype=dtype))
            flat = []
    flat += [tokenizer.eos_id] if texts else []
    tokens = np.concatenate(arrays + [np.array(flat, dtype=dtype)])
    nbytes = [len(text.encode("utf-8")) for text in texts]
    return tokens, np.array(lens, dtype=np.int64), np.array(nbytes, dtype=np.int64), None


def _encode_text(task: ChunkTask, tokenizer) -> ChunkResult:
    """A piece of one document of a plain-text file (the whole file, or its head or held-out tail): its
    tokens, plus eos if the document ends here. The result holds that one document, left open (`continues`)
    unless this is its last piece, and names the split it goes to."""
    data = task.data[len(UTF8_BOM):] if task.first_line == 1 and task.data.startswith(UTF8_BOM) else task.data
    if b"\x00" in data:
        line = task.first_line + data.count(b"\n", 0, data.index(b"\x00"))
        raise DataError("contains NUL bytes; is this a binary file?", task.path, line)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"invalid UTF-8 (byte 0x{data[e.start]:02x}); re-encode the file as UTF-8", task.path,
                        task.first_line + data.count(b"\n", 0, e.start)) from None
    # in pieces (chat/pieces.py), so one encode call never holds the whole chunk
    flat = [i for _, ids in tokenizer.encode_pieces([text]) for i in ids]
    flat += [tokenizer.eos_id] if task.text_end else []
    nbytes = len(data)
    return ChunkResult(task.file_index, np.array(flat, dtype=token_dtype(tokenizer)),
                       np.array([len(flat)], dtype=np.int64), np.array([nbytes], dtype=np.int64), None, SkipCounter(),
                       continues=not task.text_end, text_split="val" if task.text_val else "train")


def _encode_sft(records, tokenizer, dtype, task: ChunkTask, skips: SkipCounter):
    """Each conversation is rendered with the chat template (data/sft_records.py: its tools, a seeded share
    without empty think blocks); the mask marks the assistant tokens."""
    def render(line_no: int, record: dict) -> list[tuple]:
        drop = drops_empty_think(task.drop_empty_think, task.file_index, line_no)
        return [render_sft_record(tokenizer, record["conversations"], drop)]
    return _encode_rendered(records, render, '"conversations"', dtype, task, skips)


def final_reply_mask(mask: np.ndarray) -> np.ndarray:
    """Keep only the last run of 1s of an assistant mask: the final reply and its <|im_end|>."""
    out = np.zeros_like(mask)
    ones = np.flatnonzero(mask)
    if len(ones):
        zeros = np.flatnonzero(mask[:ones[-1]] == 0)
        out[zeros[-1] + 1 if len(zeros) else 0:ones[-1] + 1] = 1
    return out


def _encode_dpo(records, tokenizer, dtype, task: ChunkTask, skips: SkipCounter):
    """Each record becomes two documents, chosen then rejected, each rendered with the chat template and
    masked on its final assistant reply only (Rafailov et al. 2023, arXiv 2305.18290: the DPO log-ratio is
    over the answer given the shared prompt)."""
    def render(line_no: int, record: dict) -> list[tuple]:
        sides = [tokenizer.render_chat_arrays(record[name]) for name in ("chosen", "rejected")]
        return [(ids, final_reply_mask(mask), text) for ids, mask, text in sides]
    return _encode_rendered(records, render, '"chosen"/"rejected"', dtype, task, skips)


def _encode_rendered(records, render, field: str, dtype, task: ChunkTask, skips: SkipCounter):
    """The documents `render(line_no, record)` makes of each record, (ids, mask, text) each, concatenated. A
    record the template cannot render, or not faithfully, is a DataError at its line naming `field` (or skipped)."""
    tokens, masks, lens, nbytes = [], [], [], []
    for line_no, record in records:
        try:
            documents = render(line_no, record)
        except ChatTemplateError as e:
            error = DataError(str(e), task.path, line_no, field)
            if not task.skip_invalid:
                raise error from None
            skips.add(error)
            continue
        for ids, mask, text in documents:
            tokens.append(ids.astype(dtype))
            masks.append(mask)
            lens.append(len(ids))
            nbytes.append(len(text.encode("utf-8")))
    return (np.concatenate(tokens) if tokens else np.zeros(0, dtype), np.array(lens, dtype=np.int64),
            np.array(nbytes, dtype=np.int64), np.concatenate(masks) if masks else np.zeros(0, np.uint8))


def run_chunks(tasks: Iterator[ChunkTask], tokenizer, workers: int) -> Iterator[ChunkResult]:
    """Results of `tasks` in input order, computed by `workers` processes with bounded read-ahead."""
    if workers <= 1:
        yield from (encode_chunk(task, tokenizer) for task in tasks)
        return
    # spawn: a fresh interpreter per worker, so no Rust thread pool or lock is inherited through fork
    # (the deadlock tokenizers warns about); its start-up cost (~0.5 s) is paid once per run.
    context = multiprocessing.get_context("spawn")
    max_in_flight = 2 * workers
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer, os.getpid())) as pool:
        pending = deque()
        for task in tasks:
            pending.append(pool.apply_async(_encode_chunk_in_worker, (task,)))
            if len(pending) >= max_in_flight:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    # leaving the `with` block terminates the workers, also when an error or Ctrl-C unwinds through here


