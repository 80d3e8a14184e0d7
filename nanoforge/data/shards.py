"""JSONL -> token shards on disk, in parallel, with a manifest; and memmap readers over them.

Layout of a prepared directory (everything a training run needs, nothing else):

    manifest.json               format version, kind, tokenizer hash, sources, per-split counts
    tokenizer/                  a copy of the tokenizer, so the directory is self-contained
    {split}_{k:05d}.bin         flat token ids (uint16 when the vocabulary fits, else uint32)
    {split}_{k:05d}.idx         int64 document start offsets within the shard, plus the final end offset
    {split}_{k:05d}.mask        (sft, dpo) uint8 loss mask, one per token: 1 on assistant tokens

dpo data is stored as documents in pairs: document 2i of a split is the chosen conversation of pair i and
document 2i+1 its rejected one (manifest "layout": "pairs"); the mask covers only the FINAL assistant reply
and its <|im_end|> (the prefix is shared, so only the two answers differ). The train/val split is drawn per
pair, so a pair is never cut in two.

Why flat binary shards read by memmap (as nanoGPT's train.bin): the OS pages data in and out, so training
memory stays flat however large the corpus, and any window is one slice away.

A plain-text file (.txt, .text, .md) is pretraining text, read in chunks cut where the pre-tokenizer would
split anyway (see _text_cut), tokenized like the rest, and joined back into whole documents. With
val_fraction f = 0 the file is one train document. With f > 0 its tail is held out, as nanoGPT does with one
corpus file (a per-document draw would leave one file with no validation split at all): the val split gets a
document that starts at the first line start at or after byte size - floor(f*size), and the head is one
train document; each is exactly its own text tokenized, plus eos. The manifest's source entry then says
"val_from_byte" and counts 2 records. A file with no line start in that tail (too short, or one long last
line) stays whole in train, and the log says so. Text documents are not counted by the per-record rule for
JSONL, so JSONL records go to the same split whatever .txt files come before them in the input (before plain
text was split, a .txt file counted as one record there).

Preparing is parallel: the parent reads each file in ~2 MB chunks of whole lines and hands them to worker
processes, which parse, validate and tokenize; results come back and are written in input order, so the
output is byte-identical for any number of workers. At most 2 chunks per worker are in flight, which bounds
memory whatever the input size (`Pool.imap` would read the whole input ahead). Everything is written into a
temporary directory next to out_dir and renamed into place at the end: an error or Ctrl-C leaves out_dir as it
was and no temporary directory behind.
"""
from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import time
from collections import deque
from contextlib import closing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from nanoforge import dirlock
from nanoforge.data.jsonl import DataError, SkipCounter, check_input_file, parse_line
from nanoforge.errors import NanoforgeError
from nanoforge.fsutil import fsync_dir

FORMAT = "nanoforge-token-shards"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
SHARD_TOKENS = 100_000_000  # start a new shard after this many tokens (200 MB of uint16)
CHUNK_BYTES = 2 << 20  # raw JSONL handed to a worker at a time
ENCODE_BATCH_CHARS = 1 << 18  # texts per encode_batch call, bounds the Rust-side memory of one call
PREPARED_KINDS = ("pretrain", "sft", "dpo")
MASKED_KINDS = ("sft", "dpo")  # kinds stored with a loss mask


# ---------------------------------------------------------------------------------------------- prepare


def prepare_dataset(kind: str, files, tokenizer, out_dir, val_fraction: float = 0.01, workers: int = 0,
                    skip_invalid: bool = False, force: bool = False, log: Callable[[str], None] = print, *,
                    chunk_bytes: int = CHUNK_BYTES, max_shard_tokens: int = SHARD_TOKENS) -> dict:
    """Tokenize JSONL `files` of `kind` into shards in `out_dir`; return the manifest (also written there).

    pretrain: each document is encode(text) + [eos].  sft: each conversation is tokenizer.render_chat(...),
    ids plus a loss mask on the assistant tokens (no eos: the rendered conversation ends with <|im_end|>\\n).
    dpo: each record is two documents, chosen then rejected, masked on the final assistant reply only.
    Record i (0-based over all valid JSONL records in input order) goes to val iff
    floor((i+1)*val_fraction) > floor(i*val_fraction): deterministic, spread evenly, exactly ~fraction.
    A plain-text file is split by bytes instead: its tail (from a line start) is one val document.
    workers=0 uses os.cpu_count() processes (never more than there are chunks); workers=1 runs in this
    process. Keyword-only chunk_bytes and max_shard_tokens exist for tests and tuning.
    """
    from nanoforge.tokenizer import Tokenizer, load_tokenizer

    started = time.perf_counter()
    _check_kind(kind)
    if not 0.0 <= val_fraction < 1.0:
        raise NanoforgeError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if workers < 0:
        raise NanoforgeError(f"workers must be >= 0 (0: one per core), got {workers}")
    tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    if kind == "pretrain" and tokenizer.eos_id is None:
        raise NanoforgeError("the tokenizer has no end-of-text token (<|endoftext|> or an eos_token in "
                             "tokenizer_config.json), which pretraining puts between documents")
    files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not files:
        raise NanoforgeError("no input files given to prepare")
    paths = [check_input_file(f) for f in files]
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, force)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # one prepare per --out at a time: a second one stops here, naming the first, before writing anything
    with dirlock.acquire(out_dir.parent / f".{out_dir.name}.lock", f"{out_dir} (being prepared)",
                         unlink_on_release=True):
        _check_out_dir(out_dir, force)  # again: a prepare that held the lock until now may have filled it
        return _prepare_locked(kind, paths, tokenizer, out_dir, val_fraction, workers, skip_invalid, force, log,
                               chunk_bytes, max_shard_tokens, started)


def _prepare_locked(kind, paths, tokenizer, out_dir: Path, val_fraction, workers, skip_invalid, force, log,
                    chunk_bytes, max_shard_tokens, started) -> dict:
    workers = workers or os.cpu_count() or 1
    # no more processes than chunks: starting a worker costs ~0.5 s, more than a small input takes
    workers = max(1, min(workers, math.ceil(sum(p.stat().st_size for p in paths) / chunk_bytes)))
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)

    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    writers = {}
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        writers = {split: SplitWriter(tmp, split, dtype, with_mask=kind in MASKED_KINDS,
                                      max_shard_tokens=max_shard_tokens) for split in SPLITS}
        sources = [SourceStats(path) for path in paths]
        tasks = _chunk_tasks(kind, sources, chunk_bytes, skip_invalid, val_fraction)
        docs_seen = 0
        with closing(_run_chunks(tasks, tokenizer, workers)) as results:  # closing stops the workers
            for result in results:
                source = sources[result.file_index]
                source.records += (len(result.doc_lens) - result.continues) // _docs_per_record(kind)
                source.skips.merge(result.skips)
                docs_seen = _write_result(result, writers, docs_seen, val_fraction, _docs_per_record(kind))
        for source in sources:
            if source.records == 0:
                raise DataError(f"has no valid {kind} records" +
                                (f" ({source.skips.skipped} skipped)" if source.skips.skipped else ""), source.path)
            _log_source(source, log)
        splits = {split: writer.close() for split, writer in writers.items()}
        tokenizer.save(tmp / "tokenizer")
        manifest = _manifest(kind, tokenizer, dtype, val_fraction, sources, splits, workers,
                             time.perf_counter() - started)
        _write_json(tmp / "manifest.json", manifest)
        _swap_into_place(tmp, out_dir, force)
    except BaseException:  # KeyboardInterrupt too: never leave a half-written directory behind
        for writer in writers.values():
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log_summary(manifest, out_dir, log)
    return manifest


def _check_kind(kind: str) -> None:
    if kind not in PREPARED_KINDS:
        raise NanoforgeError(f"unknown data kind {kind!r}; expected one of pretrain, sft, dpo")


def _docs_per_record(kind: str) -> int:
    """A dpo record is stored as two documents (chosen, rejected); every other kind as one."""
    return 2 if kind == "dpo" else 1


def _check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise NanoforgeError(f"{out_dir}: exists and is not a directory; choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise NanoforgeError(f"{out_dir}: already exists and is not empty; pass --force to replace it")


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

    def to_json(self) -> dict:
        entry = {"path": str(self.path.resolve()), "bytes": self.size, "sha256": self.hasher.hexdigest(),
                 "records": self.records, "skipped": self.skips.skipped}
        if self.val_start is not None:
            entry["val_from_byte"] = self.val_start
        return entry


# ---- reading chunks


@dataclass
class ChunkTask:
    kind: str
    file_index: int
    path: str
    first_line: int
    data: bytes
    skip_invalid: bool
    # plain text: the chunk is a piece of one of the file's documents (its head, or its held-out tail when
    # `text_val`); `text_end` says it is the last piece of that document
    plain_text: bool = False
    text_end: bool = True
    text_val: bool = False


def _chunk_tasks(kind: str, sources: list[SourceStats], chunk_bytes: int, skip_invalid: bool,
                 val_fraction: float = 0.0) -> Iterator[ChunkTask]:
    for index, source in enumerate(sources):
        if is_plain_text(source.path):
            if kind != "pretrain":
                raise DataError(f"plain text is pretraining data; {kind} needs JSONL records", source.path)
            for first_line, data, last, val in _text_chunks(source, chunk_bytes, val_fraction):
                yield ChunkTask(kind, index, str(source.path), first_line, data, skip_invalid, True, last, val)
            continue
        for first_line, data in _line_chunks(source, chunk_bytes):
            yield ChunkTask(kind, index, str(source.path), first_line, data, skip_invalid)


def is_plain_text(path) -> bool:
    from nanoforge.tokenizer import PLAIN_TEXT_SUFFIXES
    return Path(path).suffix.lower() in PLAIN_TEXT_SUFFIXES


# ASCII whitespace; the pre-tokenizer's \s also matches a few non-ASCII spaces (U+00A0, U+3000, ...)
_WHITESPACE = b" \t\n\r\x0b\x0c"


def _text_cut(data: bytes) -> int:
    """Where to cut `data` (bytes of UTF-8 text) so that tokenizing the two parts gives the same tokens as
    tokenizing the whole: just before the last whitespace run that holds a line break and follows a
    non-space character; 0 if there is no such place.

    Why there: BPE merges never cross pre-tokens, so equal pre-tokens mean equal tokens. The byte-level
    pre-tokenizer (GPT-2's regex) ends a word, number or punctuation run at whitespace, and starts a new
    match at the first whitespace character after one; it looks ahead, never behind. Cut before the whole
    run, the first part ends with the same pre-token as in the whole text, and the second part is matched
    from the same position with the same look-ahead. Cutting after the newline instead would change things:
    "a  \n" at the end of a part makes one pre-token of "  \n", where the whole text has "  " and "\n". A
    non-ASCII space just before the run (rare) can change how that one run is split, never the text:
    decoding stays exact. The cut is at an ASCII byte, so never inside a UTF-8 character."""
    newline = data.rfind(b"\n")
    while newline > 0:
        cut = len(data[:newline].rstrip(_WHITESPACE))
        if cut > 0:
            return cut
        newline = -1  # everything before is whitespace
    return 0


def _text_val_target(size: int, val_fraction: float) -> int | None:
    """The byte offset from which a plain-text file of `size` bytes is held out: its val document starts at
    the first line start at or after it. None when there is nothing to hold out (val_fraction*size < 1)."""
    held_out = math.floor(val_fraction * size)
    return size - held_out if held_out > 0 else None


def _text_chunks(source: SourceStats, chunk_bytes: int,
                 val_fraction: float = 0.0) -> Iterator[tuple[int, bytes, bool, bool]]:
    """(first line number, bytes, ends its document, is in the val document) pieces of a plain-text file,
    each cut by _text_cut; hashes and sizes the file on the way. Never holds more than a chunk (plus one
    unbroken stretch).

    With val_fraction > 0 the head ends with the first line break at or after byte target - 1 (see
    _text_val_target; the file size is its stat, known before reading), so the tail starts at a line start
    and the two are separate documents. No other piece of the head reaches past that line break: _text_cut
    cuts before the last line break of what has been read, and what holds that one is cut there first. Head
    and tail are tokenized as two texts (each document is exactly encode(its own text) + eos), so unlike a
    cut inside a document this one may go after the line break."""
    from nanoforge.data.jsonl import MAX_RECORD_BYTES
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
            cut = _text_cut(data) if block else len(data)
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


def _line_chunks(source: SourceStats, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(first line number, bytes) chunks of whole lines; hashes and sizes the file on the way."""
    from nanoforge.data.jsonl import MAX_RECORD_BYTES, record_too_long
    line_no, pending = 1, []  # pending: blocks of a line longer than one block, joined once it ends
    with open(source.path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:
                break
            source.hasher.update(block)
            source.size += len(block)
            cut = block.rfind(b"\n") + 1
            if cut == 0:  # no line ends in this block: keep reading, but not without bound
                pending.append(block)
                size = sum(map(len, pending))
                if size > MAX_RECORD_BYTES:
                    raise record_too_long(size, source.path, line_no)
                continue
            data = b"".join(pending) + block[:cut]
            pending = [block[cut:]] if cut < len(block) else []
            yield line_no, data
            line_no += data.count(b"\n")
    if pending:
        yield line_no, b"".join(pending)


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


def _init_worker(tokenizer) -> None:
    """Pool initializer: one tokenizer per process; no Rust threads (the processes are the parallelism)."""
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C reaches the whole process group; the parent handles it (and terminates us), so the workers
    # must not print a traceback each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_tokenizer = tokenizer


def _encode_chunk_in_worker(task: ChunkTask) -> ChunkResult:
    return encode_chunk(task, _worker_tokenizer)


def encode_chunk(task: ChunkTask, tokenizer) -> ChunkResult:
    """Parse, validate and tokenize the lines of one chunk. Raises the DataError of its first bad line."""
    if task.plain_text:
        return _encode_text(task, tokenizer)
    skips = SkipCounter()
    records = []
    for offset, raw in enumerate(task.data.split(b"\n")):
        line_no = task.first_line + offset
        try:
            record = parse_line(raw, task.kind, task.path, line_no)
        except DataError as e:
            if not task.skip_invalid:
                raise
            skips.add(e)
            continue
        if record is not None:
            records.append((line_no, record))
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    encode = {"pretrain": _encode_pretrain, "sft": _encode_sft, "dpo": _encode_dpo}[task.kind]
    tokens, lens, nbytes, mask = encode(records, tokenizer, dtype, task, skips)
    return ChunkResult(task.file_index, tokens, lens, nbytes, mask, skips)


def _encode_pretrain(records, tokenizer, dtype, task: ChunkTask, skips: SkipCounter):
    """Each document is encode(text) + [eos]. Texts go through the batch encoder a few hundred KB at a time
    (bounds the Rust-side memory of one call) and are collected into one flat list: one numpy conversion per
    chunk is much cheaper than one per document."""
    flat, lens, nbytes, batch, batch_chars = [], [], [], [], 0
    eos = tokenizer.eos_id

    def flush():
        for ids in tokenizer.encode_batch(batch):
            flat.extend(ids)
            flat.append(eos)
            lens.append(len(ids) + 1)
        batch.clear()

    for _, record in records:
        text = record["text"]
        nbytes.append(len(text.encode("utf-8")))
        batch.append(text)
        batch_chars += len(text)
        if batch_chars >= ENCODE_BATCH_CHARS:
            flush()
            batch_chars = 0
    if batch:
        flush()
    return (np.array(flat, dtype=dtype), np.array(lens, dtype=np.int64), np.array(nbytes, dtype=np.int64), None)


def _encode_text(task: ChunkTask, tokenizer) -> ChunkResult:
    """A piece of one document of a plain-text file (the whole file, or its head or held-out tail): its
    tokens, plus eos if the document ends here. The result holds that one document, left open (`continues`)
    unless this is its last piece, and names the split it goes to."""
    from nanoforge.data.jsonl import UTF8_BOM
    data = task.data[len(UTF8_BOM):] if task.first_line == 1 and task.data.startswith(UTF8_BOM) else task.data
    if b"\x00" in data:
        line = task.first_line + data.count(b"\n", 0, data.index(b"\x00"))
        raise DataError("contains NUL bytes; is this a binary file?", task.path, line)
    pieces = []  # sub-pieces cut the same way, so one encode call never holds the whole chunk
    while len(data) > ENCODE_BATCH_CHARS:
        cut = _text_cut(data[:ENCODE_BATCH_CHARS]) or len(data)
        pieces.append(data[:cut])
        data = data[cut:]
    pieces.append(data)
    texts, line = [], task.first_line
    for piece in pieces:
        try:
            texts.append(piece.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"invalid UTF-8 (byte 0x{piece[e.start]:02x}); re-encode the file as UTF-8",
                            task.path, line + piece.count(b"\n", 0, e.start)) from None
        line += piece.count(b"\n")
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    flat = [i for ids in tokenizer.encode_batch(texts) for i in ids]
    if task.text_end:
        flat.append(tokenizer.eos_id)
    nbytes = sum(len(p) for p in pieces)
    return ChunkResult(task.file_index, np.array(flat, dtype=dtype), np.array([len(flat)], dtype=np.int64),
                       np.array([nbytes], dtype=np.int64), None, SkipCounter(), continues=not task.text_end,
                       text_split="val" if task.text_val else "train")


def _encode_sft(records, tokenizer, dtype, task: ChunkTask, skips: SkipCounter):
    """Each conversation is rendered with the chat template; the mask marks the assistant tokens.
    A conversation whose mask cannot be computed is a DataError at its line (or skipped)."""
    from nanoforge.tokenizer import ChatTemplateError

    flat, flat_mask, lens, nbytes = [], [], [], []
    for line_no, record in records:
        try:
            ids, mask, text = tokenizer.render_chat_with_text(record["conversations"])
        except ChatTemplateError as e:
            error = DataError(str(e), task.path, line_no, '"conversations"')
            if not task.skip_invalid:
                raise error from None
            skips.add(error)
            continue
        flat.extend(ids)
        flat_mask.extend(mask)
        lens.append(len(ids))
        nbytes.append(len(text.encode("utf-8")))
    return (np.array(flat, dtype=dtype), np.array(lens, dtype=np.int64), np.array(nbytes, dtype=np.int64),
            np.array(flat_mask, dtype=np.uint8))


def final_reply_mask(mask: list[int]) -> list[int]:
    """Keep only the last run of 1s of an assistant mask: the final reply and its <|im_end|>."""
    out = [0] * len(mask)
    i = len(mask) - 1
    while i >= 0 and not mask[i]:
        i -= 1
    while i >= 0 and mask[i]:
        out[i] = 1
        i -= 1
    return out


def _encode_dpo(records, tokenizer, dtype, task: ChunkTask, skips: SkipCounter):
    """Each record becomes two documents, chosen then rejected, each rendered with the chat template and
    masked on its final assistant reply only (Rafailov et al. 2023, arXiv 2305.18290: the DPO log-ratio is
    over the answer given the shared prompt). A record whose template fails is a DataError (or skipped)."""
    from nanoforge.tokenizer import ChatTemplateError

    flat, flat_mask, lens, nbytes = [], [], [], []
    for line_no, record in records:
        try:
            sides = [tokenizer.render_chat_with_text(record[name]) for name in ("chosen", "rejected")]
        except ChatTemplateError as e:
            error = DataError(str(e), task.path, line_no, '"chosen"/"rejected"')
            if not task.skip_invalid:
                raise error from None
            skips.add(error)
            continue
        for ids, mask, text in sides:
            flat.extend(ids)
            flat_mask.extend(final_reply_mask(mask))
            lens.append(len(ids))
            nbytes.append(len(text.encode("utf-8")))
    return (np.array(flat, dtype=dtype), np.array(lens, dtype=np.int64), np.array(nbytes, dtype=np.int64),
            np.array(flat_mask, dtype=np.uint8))


def _run_chunks(tasks: Iterator[ChunkTask], tokenizer, workers: int) -> Iterator[ChunkResult]:
    """Results of `tasks` in input order, computed by `workers` processes with bounded read-ahead."""
    if workers <= 1:
        for task in tasks:
            yield encode_chunk(task, tokenizer)
        return
    # spawn: a fresh interpreter per worker, so no Rust thread pool or lock is inherited through fork
    # (the deadlock tokenizers warns about); its start-up cost (~0.5 s) is paid once per run.
    context = multiprocessing.get_context("spawn")
    max_in_flight = 2 * workers
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        pending = deque()
        for task in tasks:
            pending.append(pool.apply_async(_encode_chunk_in_worker, (task,)))
            if len(pending) >= max_in_flight:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    # leaving the `with` block terminates the workers, also when an error or Ctrl-C unwinds through here


def _write_result(result: ChunkResult, writers: dict, docs_seen: int, val_fraction: float,
                  docs_per_record: int = 1) -> int:
    """Send each record of the chunk (1 document, or 2 for a dpo pair) to train or val; return the running
    record count. A piece of plain text goes to the split it was read for and is not counted."""
    if result.text_split:
        writers[result.text_split].write(result.tokens, result.doc_lens, int(result.doc_bytes.sum()), None,
                                         open_last=result.continues)
        return docs_seen
    n = len(result.doc_lens) // docs_per_record  # an unfinished document (result.continues) counts here...
    index = np.arange(docs_seen, docs_seen + n, dtype=np.float64)
    is_val = np.repeat(np.floor((index + 1) * val_fraction) > np.floor(index * val_fraction),
                       docs_per_record)  # (D,)
    token_is_val = np.repeat(is_val, result.doc_lens)  # (N,)
    for split, doc_sel, tok_sel in (("train", ~is_val, ~token_is_val), ("val", is_val, token_is_val)):
        if doc_sel.any():
            mask = None if result.mask is None else result.mask[tok_sel]
            writers[split].write(result.tokens[tok_sel], result.doc_lens[doc_sel],
                                 int(result.doc_bytes[doc_sel].sum()), mask,
                                 open_last=result.continues and bool(doc_sel[-1]))
    return docs_seen + n - result.continues  # ...but is counted once, by the chunk that ends it


# ---- writing


class SplitWriter:
    """Appends documents to the shards of one split, starting a new shard after max_shard_tokens."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, with_mask: bool, max_shard_tokens: int):
        self.directory, self.split, self.dtype = directory, split, dtype
        self.with_mask, self.max_shard_tokens = with_mask, max_shard_tokens
        self.shards: list[dict] = []
        self.bytes = 0
        self._files = None  # (bin, idx, mask) of the open shard; opened on the first document
        self._doc_open = False  # the last document written goes on in the next write (plain text)

    def write(self, tokens: np.ndarray, doc_lens: np.ndarray, nbytes: int, mask: np.ndarray | None,
              open_last: bool = False) -> None:
        """Append documents; with open_last the last one goes on in the next write (its end is not yet
        recorded, and its shard stays open however full: documents never span shards)."""
        self.bytes += nbytes
        while len(doc_lens):
            if self._files is None:
                self._open_shard()
            shard = self.shards[-1]
            # documents never span shards: take those that start before the shard is full
            starts = np.cumsum(doc_lens) - doc_lens
            take = max(1, int(np.searchsorted(starts, self.max_shard_tokens - shard["tokens"], side="left")))
            ntok = int(doc_lens[:take].sum())
            ends_here = take - (open_last and take == len(doc_lens))  # documents whose end is written now
            bin_f, idx_f, mask_f = self._files
            bin_f.write(np.ascontiguousarray(tokens[:ntok], dtype=self.dtype).tobytes())
            ends = shard["tokens"] + np.cumsum(doc_lens[:ends_here], dtype=np.int64)
            idx_f.write(ends.astype(np.int64).tobytes())
            if mask_f is not None:
                mask_f.write(np.ascontiguousarray(mask[:ntok], dtype=np.uint8).tobytes())
                mask = mask[ntok:]
            shard["tokens"] += ntok
            shard["docs"] += ends_here
            tokens, doc_lens = tokens[ntok:], doc_lens[take:]
            self._doc_open = ends_here < take
            if shard["tokens"] >= self.max_shard_tokens and not self._doc_open:
                self._close_shard()

    def _open_shard(self) -> None:
        name = f"{self.split}_{len(self.shards):05d}"
        self.shards.append({"name": name, "tokens": 0, "docs": 0})
        files = [open(self.directory / f"{name}.bin", "wb"), open(self.directory / f"{name}.idx", "wb")]
        files.append(open(self.directory / f"{name}.mask", "wb") if self.with_mask else None)
        files[1].write(np.zeros(1, dtype=np.int64).tobytes())  # the first document starts at 0
        self._files = files

    def _close_shard(self) -> None:
        for f in self._files:
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()
        self._files = None

    def close(self) -> dict:
        """Finish the split; return its manifest entry."""
        if self._files is not None:
            self._close_shard()
        return {"shards": self.shards, "tokens": sum(s["tokens"] for s in self.shards),
                "docs": sum(s["docs"] for s in self.shards), "bytes": self.bytes}

    def abort(self) -> None:
        if self._files is not None:
            for f in self._files:
                if f is not None:
                    f.close()
            self._files = None


def _manifest(kind, tokenizer, dtype, val_fraction, sources, splits, workers, seconds) -> dict:
    from nanoforge import __version__

    input_bytes = sum(s.size for s in sources)
    tokens = sum(s["tokens"] for s in splits.values())
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "tokenizer": {"sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id},
        "dtype": dtype.name,
        **({"layout": "pairs"} if kind == "dpo" else {}),  # doc 2i chosen, 2i+1 rejected
        "val_fraction": val_fraction,
        "sources": [s.to_json() for s in sources],
        "splits": splits,
        "stats": {"seconds": round(seconds, 3), "workers": workers,
                  "tokens_per_s": round(tokens / max(seconds, 1e-9)),
                  "mb_per_s": round(input_bytes / 1e6 / max(seconds, 1e-9), 3)},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "nanoforge_version": __version__,
    }


def _write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(directory: Path) -> None:
    """Flush every file and directory under `directory` to disk before it is renamed into place."""
    for root, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))


def _swap_into_place(tmp: Path, out_dir: Path, force: bool) -> None:
    """Rename the finished temp dir onto out_dir. An existing out_dir is moved aside first and deleted only
    once the new one is in place (two renames: a crash in between leaves the old data under .NAME.old-PID)."""
    _fsync_tree(tmp)
    if out_dir.is_dir():
        if any(out_dir.iterdir()):
            if not force:  # checked at the start too; someone may have written there since
                raise NanoforgeError(f"{out_dir}: already exists and is not empty; pass --force to replace it")
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            os.rename(out_dir, old)
            try:
                os.rename(tmp, out_dir)
            except BaseException:
                os.rename(old, out_dir)
                raise
            shutil.rmtree(old)
        else:
            out_dir.rmdir()
            os.rename(tmp, out_dir)
    else:
        os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)


def _log_source(source: SourceStats, log) -> None:
    if source.val_start is not None:
        log(f"{source.path}: plain text, {source.size:,} bytes: train the first {source.val_start:,}, "
            f"val the last {source.size - source.val_start:,} (from line {source.val_line:,})")
        return
    if source.kept_whole:
        log(f"{source.path}: plain text, kept whole in train: {source.kept_whole}")
        return
    log(f"{source.path}: {source.records} records" +
        (f", skipped {source.skips.skipped} invalid" if source.skips.skipped else ""))
    if source.skips.skipped:
        log(source.skips.summary())


def _log_summary(manifest: dict, out_dir: Path, log) -> None:
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    stats = manifest["stats"]
    log(f"prepared {out_dir}: train {train['tokens']:,} tokens / {train['docs']:,} docs, "
        f"val {val['tokens']:,} tokens / {val['docs']:,} docs ({manifest['dtype']}); "
        f"{stats['seconds']:.1f} s, {stats['mb_per_s']:.2f} MB/s, {stats['tokens_per_s']:,} tokens/s")


# ---------------------------------------------------------------------------------------------- read


def read_manifest(directory) -> dict:
    """The manifest of a prepared directory, checked for format and version."""
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        raise NanoforgeError(f"{directory}: not a prepared dataset (no manifest.json); "
                             "create it with `nanoforge prepare`")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NanoforgeError(f"{path}: unreadable manifest ({e}); re-run `nanoforge prepare`") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise NanoforgeError(f"{path}: not a nanoforge token-shard manifest; re-run `nanoforge prepare`")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise NanoforgeError(f"{path}: format version {manifest.get('format_version')} but this nanoforge "
                             f"reads version {FORMAT_VERSION}; re-run `nanoforge prepare`")
    return manifest


def check_tokenizer(directory, tokenizer) -> None:
    """Raise if the data in `directory` was tokenized by a different tokenizer than `tokenizer`."""
    expected = read_manifest(directory)["tokenizer"]
    if expected["sha256"] != tokenizer.sha256:
        raise NanoforgeError(
            f"{directory} was prepared with a different tokenizer (sha256 {expected['sha256'][:12]}, vocab "
            f"{expected['vocab_size']}) than the one in use (sha256 {tokenizer.sha256[:12]}, vocab "
            f"{tokenizer.vocab_size}); re-run `nanoforge prepare` with this tokenizer, or train with "
            f"{Path(directory) / 'tokenizer'}")


class TokenShards:
    """Read-only memmap view of one split of a prepared directory, as one flat token stream."""

    def __init__(self, directory, split: str):
        self.directory = Path(directory)
        self.split = split
        self.manifest = read_manifest(self.directory)
        splits = self.manifest.get("splits", {})
        if split not in splits:
            raise NanoforgeError(f"{self.directory}: no split {split!r} (have {', '.join(splits)})")
        entry = splits[split]
        self.dtype = np.dtype(self.manifest["dtype"])
        self.kind = self.manifest["kind"]
        self.num_tokens = int(entry["tokens"])
        self.num_docs = int(entry["docs"])
        self.num_bytes = int(entry["bytes"])
        self._tokens, self._idx, self._masks = [], [], []
        for shard in entry["shards"]:
            self._open_shard(shard)
        self._token_starts = np.cumsum([0] + [len(t) for t in self._tokens])  # (S+1,)
        self._doc_starts = np.cumsum([0] + [len(i) - 1 for i in self._idx])  # (S+1,)
        if self._token_starts[-1] != self.num_tokens or self._doc_starts[-1] != self.num_docs:
            raise NanoforgeError(f"{self.directory / 'manifest.json'}: split {split} totals do not match its "
                                 "shards; re-run `nanoforge prepare`")

    def _open_shard(self, shard: dict) -> None:
        base = self.directory / shard["name"]
        tokens, docs = int(shard["tokens"]), int(shard["docs"])
        self._tokens.append(self._map(base.with_suffix(".bin"), self.dtype, tokens))
        idx = self._map(base.with_suffix(".idx"), np.dtype(np.int64), docs + 1)
        if idx[0] != 0 or idx[-1] != tokens:
            raise NanoforgeError(f"{base.with_suffix('.idx')}: offsets do not match the manifest; "
                                 "the file is corrupt, re-run `nanoforge prepare`")
        self._idx.append(idx)
        if self.kind in MASKED_KINDS:
            self._masks.append(self._map(base.with_suffix(".mask"), np.dtype(np.uint8), tokens))

    @staticmethod
    def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
        if not path.is_file():
            raise NanoforgeError(f"{path}: missing; the prepared directory is incomplete, re-run `nanoforge prepare`")
        expected = count * dtype.itemsize
        actual = path.stat().st_size
        if actual != expected:
            raise NanoforgeError(f"{path}: {actual} bytes but the manifest says {expected}; the file is corrupt "
                                 "or truncated, re-run `nanoforge prepare`")
        if count == 0:
            return np.zeros(0, dtype=dtype)  # numpy cannot memmap an empty file
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,))

    @property
    def has_mask(self) -> bool:
        return bool(self._masks)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the split's stream, across shard boundaries; a copy."""
        return self._gather(self._tokens, start, length)

    def read_mask(self, start: int, length: int) -> np.ndarray:
        """Loss mask [start, start+length) for sft and dpo data."""
        if not self._masks:
            raise NanoforgeError(f"{self.directory}: {self.kind} data has no loss mask")
        return self._gather(self._masks, start, length)

    def _gather(self, arrays: list, start: int, length: int) -> np.ndarray:
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) out of range for {self.num_tokens} tokens")
        parts = []
        shard = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        while length > 0:
            local = start - int(self._token_starts[shard])
            take = min(length, len(arrays[shard]) - local)
            parts.append(arrays[shard][local:local + take])
            start, length, shard = start + take, length - take, shard + 1
        if not parts:
            return np.zeros(0, dtype=arrays[0].dtype if arrays else self.dtype)
        return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])

    def doc_offsets(self) -> np.ndarray:
        """Start offset of every document in the split's flat stream, plus the end: (num_docs + 1,) int64."""
        parts = [idx[:-1] + int(start) for idx, start in zip(self._idx, self._token_starts[:-1])]
        return np.concatenate(parts + [np.array([self.num_tokens], dtype=np.int64)]).astype(np.int64)

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens (and the loss mask for sft/dpo, else None) of document i of the split."""
        if not 0 <= i < self.num_docs:
            raise IndexError(f"document {i} out of range for {self.num_docs} documents")
        shard = int(np.searchsorted(self._doc_starts, i, side="right")) - 1
        local = i - int(self._doc_starts[shard])
        start, end = int(self._idx[shard][local]), int(self._idx[shard][local + 1])
        tokens = np.array(self._tokens[shard][start:end])
        mask = np.array(self._masks[shard][start:end]) if self._masks else None
        return tokens, mask

    def __len__(self) -> int:
        return self.num_tokens
