"""`nanoforge prepare`: JSONL or plain text -> token shards on disk (the layout data/shards.py reads), with a
manifest; data/chunks.py reads and tokenizes the input in parallel.

Everything is written into a temporary directory next to out_dir and renamed into place at the end: an error
or Ctrl-C leaves out_dir as it was and no temporary directory behind."""
import hashlib
import math
import os
import shutil
import time
from contextlib import closing, suppress
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

from nanoforge import __version__
from nanoforge.core import dirlock
from nanoforge.data.chunks import ChunkResult, SourceStats, chunk_tasks, run_chunks, token_dtype
from nanoforge.data.columnar import check_columnar, is_columnar
from nanoforge.data.jsonl import KINDS, DataError, check_given_once, check_input_file
from nanoforge.data.parts import plan_part
from nanoforge.data.sft_records import DROP_THINK_SEED
from nanoforge.data.shards import FORMAT, FORMAT_VERSION, MASKED_KINDS
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import (check_out_apart, check_out_dir, fsync_dir, fsync_file, replace_dir, temp_for,
                                 write_json, writing)
from nanoforge.core.interrupt import terminate_as_interrupt
from nanoforge.chat.tokenizer import Tokenizer, load_tokenizer

SPLITS = ("train", "val")
SHARD_FILES = ("bin", "idx", "mask")  # the files of one shard, {split}_{k:05d}.{suffix}, in SplitWriter._files
SHARD_TOKENS = 100_000_000  # start a new shard after this many tokens (200 MB of uint16)
CHUNK_BYTES = 2 << 20  # raw JSONL handed to a worker at a time


def prepare_dataset(kind: str, files, tokenizer, out_dir, val_fraction: float = 0.01, workers: int = 0,
                    skip_invalid: bool = False, force: bool = False, log: Callable[[str], None] = print, *,
                    chunk_bytes: int = CHUNK_BYTES, max_shard_tokens: int = SHARD_TOKENS,
                    drop_empty_think: float = 0.0, text_column: str = "text", part: str | None = None) -> dict:
    """Tokenize JSONL `files` of `kind` into shards in `out_dir`; return the manifest (also written there).

    pretrain: each document is encode(text) + [eos]. sft: tokenizer.render_chat's ids plus a loss mask on the
    assistant tokens (no eos: it ends with <|im_end|>\\n). dpo: chosen then rejected, masked on the final reply.
    Record i (0-based over the valid records in input order) goes to val iff floor((i+1)*val_fraction) >
    floor(i*val_fraction): deterministic, even, exactly ~fraction; a plain-text file's tail is one val document.
    workers=0 uses os.cpu_count() processes (at most one per chunk), 1 runs here; chunk_bytes and max_shard_tokens
    are for tests and tuning. drop_empty_think (sft): the share of records (a seeded hash of file and line,
    data/sft_records.py) rendered without empty think blocks. Parquet and HF datasets directories are read row by
    row (data/columnar.py; text_column: pretraining's column). part "I/N": only part I of N (data/parts.py)."""
    started = time.perf_counter()
    if kind not in KINDS:
        raise NanoforgeError(f"unknown data kind {kind!r}; expected one of {', '.join(KINDS)}")
    if drop_empty_think and kind != "sft":
        raise NanoforgeError(f"drop_empty_think applies to sft records only, not {kind}")
    tokenizer_path = None if isinstance(tokenizer, Tokenizer) else tokenizer
    tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    if kind == "pretrain" and tokenizer.eos_id is None:
        raise NanoforgeError("the tokenizer has no end-of-text token (<|endoftext|> or an eos_token in "
                             "tokenizer_config.json), which pretraining puts between documents")
    files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not files:
        raise NanoforgeError("no input files given to prepare")
    paths = [check_columnar(f) if is_columnar(f) else check_input_file(f) for f in files]  # data/columnar.py
    check_given_once(paths, "--data ")
    inputs, identity = plan_part(paths, part)  # data/parts.py
    out_dir = Path(out_dir)
    check_out_apart(out_dir, [*paths, tokenizer_path])
    check_out_dir(out_dir, force)
    # one prepare per --out at a time: a second one stops here, naming the first, before writing anything; a
    # SIGTERM cleans up as Ctrl-C does, and what a killed one left is removed (dirlock.output_lock)
    with writing(out_dir), terminate_as_interrupt(), dirlock.output_lock(out_dir, f"{out_dir} (being prepared)"):
        check_out_dir(out_dir, force)  # again: a prepare that held the lock until now may have filled it
        return _prepare_locked(kind, inputs, tokenizer, out_dir, val_fraction, workers, skip_invalid, force, log,
                               chunk_bytes, max_shard_tokens, started, drop_empty_think, text_column, identity)


def _prepare_locked(kind, inputs, tokenizer, out_dir: Path, val_fraction, workers, skip_invalid, force, log,
                    chunk_bytes, max_shard_tokens, started, drop_empty_think, text_column, identity) -> dict:
    paths = [i.path for i in inputs]
    workers = workers or os.cpu_count() or 1
    # no more processes than chunks: starting a worker costs ~0.5 s, more than a small input takes
    workers = max(1, min(workers, math.ceil(sum(p.stat().st_size for p in paths) / chunk_bytes)))
    dtype = np.dtype(token_dtype(tokenizer))

    tmp = temp_for(out_dir)
    writers = {}
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        writers = {split: SplitWriter(tmp, split, dtype, with_mask=kind in MASKED_KINDS,
                                      max_shard_tokens=max_shard_tokens) for split in SPLITS}
        sources = [SourceStats(i.path, byte_range=i.byte_range, first_line=i.first_line,
                               records_before=i.records_before) for i in inputs]
        tasks = chunk_tasks(kind, sources, chunk_bytes, skip_invalid, val_fraction, tokenizer.split_pattern,
                            drop_empty_think, text_column)
        docs_seen, per_record = 0, 2 if kind == "dpo" else 1  # a dpo record is two documents (chosen, rejected)
        with closing(run_chunks(tasks, tokenizer, workers)) as results:  # closing stops the workers
            current = None
            for result in results:
                source = sources[result.file_index]
                if identity["count"] > 1 and result.file_index != current:  # the whole input's count here
                    current, docs_seen = result.file_index, source.records_before
                source.records += (len(result.doc_lens) - result.continues) // per_record
                source.skips.merge(result.skips)
                docs_seen = _write_result(result, writers, docs_seen, val_fraction, per_record)
        for source in sources:
            if source.records == 0:
                raise DataError(f"has no valid {kind} records" +
                                (f" ({source.skips.skipped} skipped)" if source.skips.skipped else ""), source.path)
            _log_source(source, log)
        splits = {split: writer.close() for split, writer in writers.items()}
        tokenizer.save(tmp / "tokenizer")
        manifest = _manifest(kind, tokenizer, dtype, val_fraction, sources, splits, workers,
                             time.perf_counter() - started, drop_empty_think)
        manifest["part"] = identity  # which part of which input (data/parts.py), for `prepare merge`
        write_json(tmp / "manifest.json", manifest)
        _swap_into_place(tmp, out_dir, force)
    except BaseException:  # KeyboardInterrupt too: never leave a half-written directory behind
        for writer in writers.values():
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log_summary(manifest, out_dir, log)
    return manifest


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
            writers[split].write(result.tokens[tok_sel], result.doc_lens[doc_sel], int(result.doc_bytes[doc_sel].sum()),
                                 mask, open_last=result.continues and bool(doc_sel[-1]))
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
            self._put(0, np.ascontiguousarray(tokens[:ntok], dtype=self.dtype).tobytes())
            ends = shard["tokens"] + np.cumsum(doc_lens[:ends_here], dtype=np.int64)
            self._put(1, ends.astype(np.int64).tobytes())
            if self.with_mask:
                self._put(2, np.ascontiguousarray(mask[:ntok], dtype=np.uint8).tobytes())
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
        self._files = files
        self._hashers = {suffix: hashlib.sha256() for suffix, f in zip(SHARD_FILES, files) if f is not None}
        self._put(1, np.zeros(1, dtype=np.int64).tobytes())  # the first document starts at 0

    def _put(self, i: int, data: bytes) -> None:
        """Append to file i (bin, idx, mask) of the open shard, hashing it: the shard's sha256 in the manifest
        is its content's identity (a resumed run checks its data by it, data/shards.py data_identity)."""
        self._files[i].write(data)
        self._hashers[SHARD_FILES[i]].update(data)

    def _close_shard(self, sync: bool = True) -> None:
        self.shards[-1]["sha256"] = {suffix: h.hexdigest() for suffix, h in self._hashers.items()}
        for f in filter(None, self._files):
            if sync:
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
        """Close the open shard, dropping what is still buffered (its directory is deleted next): on a full disk
        flushing it fails again, and must not stop the clean-up."""
        for f in filter(None, self._files or ()):
            with suppress(OSError):
                f.close()
        self._files = None


def _manifest(kind, tokenizer, dtype, val_fraction, sources, splits, workers, seconds, drop_empty_think) -> dict:
    input_bytes = sum(s.size for s in sources)
    tokens = sum(s["tokens"] for s in splits.values())
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind,
        "tokenizer": {"sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id},
        "dtype": dtype.name,
        **({"layout": "pairs"} if kind == "dpo" else {}),  # doc 2i chosen, 2i+1 rejected
        "val_fraction": val_fraction,
        # sft: the seeded share of records rendered without empty think blocks (data/sft_records.py)
        **({"drop_empty_think": {"share": drop_empty_think, "seed": DROP_THINK_SEED}} if kind == "sft" else {}),
        "sources": [s.to_json() for s in sources],
        "splits": splits,
        "stats": {"seconds": round(seconds, 3), "workers": workers,
                  "tokens_per_s": round(tokens / max(seconds, 1e-9)),
                  "mb_per_s": round(input_bytes / 1e6 / max(seconds, 1e-9), 3)},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "nanoforge_version": __version__,
    }


def _swap_into_place(tmp: Path, out_dir: Path, force: bool) -> None:
    """Flush every file and directory under the finished temp dir to disk, then rename it onto out_dir
    (fsutil.replace_dir: an old out_dir is deleted only once the new one is in place)."""
    for root, _, names in os.walk(tmp):
        for name in names:
            fsync_file(os.path.join(root, name))
        fsync_dir(Path(root))
    check_out_dir(out_dir, force)  # checked at the start too; someone may have written there since
    replace_dir(tmp, out_dir)
    fsync_dir(out_dir.parent)


def _log_source(source: SourceStats, log) -> None:
    if source.val_start is not None:
        log(f"{source.path}: plain text, {source.size:,} bytes: train the first {source.val_start:,}, "
            f"val the last {source.size - source.val_start:,} (from line {source.val_line:,})")
    elif source.kept_whole:
        log(f"{source.path}: plain text, kept whole in train: {source.kept_whole}")
    elif source.skips.skipped:
        log(f"{source.path}: {source.records} records, skipped {source.skips.skipped} invalid")
        log(source.skips.summary())
    else:
        log(f"{source.path}: {source.records} records")


def _log_summary(manifest: dict, out_dir: Path, log) -> None:
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    stats = manifest["stats"]
    log(f"prepared {out_dir}: train {train['tokens']:,} tokens / {train['docs']:,} docs, "
        f"val {val['tokens']:,} tokens / {val['docs']:,} docs ({manifest['dtype']}); "
        f"{stats['seconds']:.1f} s, {stats['mb_per_s']:.2f} MB/s, {stats['tokens_per_s']:,} tokens/s")


