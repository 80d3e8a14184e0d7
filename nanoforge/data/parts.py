"""Preparing in parts, so N jobs or N machines share the work, and merging the parts without copying tokens.

`prepare --part I/N` (I from 1 to N) prepares, of several input files, every N-th starting at the I-th; of one
JSONL file, its I-th of N byte ranges, each cut at a line start (errors still give the whole file's line
numbers). Each record goes to the split one prepare of all the input would give it: a part starts its record
count (data/prepare.py's val draw) at the records before its input, counted as non-blank lines (or Parquet
rows); with --skip-invalid, skipped records before a part count there but not in one prepare.

`prepare merge PART... --out DIR` writes a directory whose manifest lists the parts' shards by relative path
(`../part1/train_00000`): no token is copied, and data/shards.py reads it as any prepared directory (a training
command given several prepared directories as --data merges them so into RUN/data). The parts must agree on
format, kind, dtype, tokenizer, layout and validation share, hold the shards their manifests list, and be parts
of one I/N splitting of their input (known by its files' names and sizes), all N unless --allow-incomplete;
--out is apart from them. Merged order is part by part: splits and tokens are one prepare's; the document order
is one prepare's only for byte-range parts of one file. Keep the parts where they are, next to the merged one."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from nanoforge.data.columnar import arrow_files, is_columnar, num_rows
from nanoforge.data.jsonl import MAX_RECORD_BYTES, record_too_long
from nanoforge.data.shards import TokenShards, read_manifest
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.dirlock import staged_dir
from nanoforge.core.fsutil import check_out_apart, check_out_dir, fsync_dir, write_json, writing
from nanoforge.core.interrupt import terminate_as_interrupt
from nanoforge.chat.tokenizer import PLAIN_TEXT_SUFFIXES

SCAN_BYTES = 8 << 20
AGREE = ("format", "format_version", "kind", "dtype", "layout", "val_fraction", "drop_empty_think")


@dataclass
class PartInput:
    """One input of a part: a file (or a byte range of one), where its lines start, records before it."""
    path: Path
    byte_range: tuple[int, int] | None = None
    first_line: int = 1
    records_before: int = 0


def parse_part(text: str) -> tuple[int, int]:
    """"I/N" -> (I, N), 1 <= I <= N."""
    i, _, n = str(text).partition("/")
    if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise NanoforgeError(f"--part {text!r}: expected I/N with 1 <= I <= N, e.g. --part 2/8")
    return int(i), int(n)


def plan_part(paths: list[Path], part: str | None) -> tuple[list[PartInput], dict]:
    """The inputs of part I of N (all of them without a part), each with the count of records before it in the
    whole input; and the part's identity, which `prepare merge` checks: I, N and the whole input's files."""
    index, count = parse_part(part or "1/1")
    identity = {"index": index, "count": count, "inputs": _inputs_id(paths)}
    if not part:
        return [PartInput(p) for p in paths], identity
    if len(paths) > 1:
        before, planned = 0, []
        for k, path in enumerate(paths):
            if k % count == index - 1:
                planned.append(PartInput(path, records_before=before))
            before += _records_in(path)
        if not planned:
            raise NanoforgeError(f"--part {index}/{count}: only {len(paths)} input files, so part {index} has none; "
                                 f"use at most {len(paths)} parts, or split the files")
        return planned, identity
    path = paths[0]
    if is_columnar(path) or path.suffix.lower() in PLAIN_TEXT_SUFFIXES:
        raise NanoforgeError(f"--part with one input file splits it by lines: JSONL only, not {path.name}; "
                             "give several files (one part prepares every N-th)")
    size = path.stat().st_size
    start, end = (_line_start_at(path, size * k // count) for k in (index - 1, index))
    lines, records = _count_lines(path, start)
    return [PartInput(path, (start, end), lines + 1, records)], identity


def _inputs_id(paths: list[Path]) -> str:
    """The input's files by name and size, in order: not by path, as N machines may hold copies elsewhere."""
    files = [(p.name, sum(f.stat().st_size for f in (arrow_files(p) if p.is_dir() else [p]))) for p in paths]
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]


def _records_in(path: Path) -> int:
    """Records a file adds to the val draw's count: rows, non-blank JSONL lines, none for plain text."""
    if is_columnar(path):
        return num_rows(path)
    if path.suffix.lower() in PLAIN_TEXT_SUFFIXES:
        return 0
    return _count_lines(path, path.stat().st_size)[1]


def _count_lines(path: Path, end: int) -> tuple[int, int]:
    """(line breaks, non-blank lines) in bytes [0, end) of a file that has a line start at `end`."""
    breaks, records, tail, left = 0, 0, b"", end
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(min(SCAN_BYTES, left))
            left -= len(block)
            lines = (tail + block).split(b"\n")
            tail = lines.pop()
            breaks += len(lines)
            records += sum(1 for line in lines if line.strip())
    return breaks, records + (1 if tail.strip() else 0)


def _line_start_at(path: Path, offset: int) -> int:
    """The first line start at or after `offset` (the file's size if none)."""
    size = path.stat().st_size
    if offset <= 0 or offset >= size:
        return min(max(offset, 0), size)
    with open(path, "rb") as f:
        f.seek(offset - 1)
        pos = offset - 1
        while block := f.read(SCAN_BYTES):
            newline = block.find(b"\n")
            if newline >= 0:
                return pos + newline + 1
            pos += len(block)
            if pos - offset > MAX_RECORD_BYTES:
                raise record_too_long(path, None)
    return size


def range_line_chunks(source, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(first line number, bytes) chunks of whole lines of `source.byte_range` (without one, the whole file);
    hashes and sizes what it reads."""
    start, end = source.byte_range or (0, source.path.stat().st_size)
    line_no = source.first_line
    with open(source.path, "rb") as f:
        f.seek(start)
        left, pending = end - start, b""
        while left > 0 and (block := f.read(min(chunk_bytes, left))):
            left -= len(block)
            source.hasher.update(block)
            source.size += len(block)
            data = pending + block
            cut = data.rfind(b"\n") + 1 if left > 0 else len(data)
            if cut == 0:
                if len(data) > MAX_RECORD_BYTES:
                    raise record_too_long(source.path, line_no)
                pending = data
                continue
            yield line_no, data[:cut]
            line_no += data.count(b"\n", 0, cut)
            pending = data[cut:]


def merge_prepared(dirs: list, out_dir, force: bool = False, log: Callable[[str], None] = print,
                   allow_incomplete: bool = False) -> dict:
    """Write `out_dir` (a manifest over the prepared `dirs` and a copy of their tokenizer); returns the manifest.
    Written under a temporary name and renamed into place, as `prepare` does."""
    dirs, out_dir = [Path(d) for d in dirs], Path(out_dir)
    if len(dirs) < 2:
        raise NanoforgeError("prepare merge needs two or more prepared directories")
    check_out_apart(out_dir, dirs)
    check_out_dir(out_dir, force)
    manifests = [read_manifest(d) for d in dirs]
    first = manifests[0]
    for d, m in zip(dirs[1:], manifests[1:]):
        diffs = [f"{key} {first.get(key)!r} vs {m.get(key)!r}" for key in AGREE if m.get(key) != first.get(key)]
        if m["tokenizer"]["sha256"] != first["tokenizer"]["sha256"]:
            diffs.append("another tokenizer (sha256 "
                         f"{first['tokenizer']['sha256'][:12]} vs {m['tokenizer']['sha256'][:12]})")
        if set(m["splits"]) != set(first["splits"]):
            diffs.append(f"splits {sorted(first['splits'])} vs {sorted(m['splits'])}")
        if diffs:
            raise NanoforgeError(f"prepare merge: {d} does not match {dirs[0]}: {'; '.join(diffs)}")
    whole = _check_parts(dirs, manifests, allow_incomplete)
    merged = {**{k: v for k, v in first.items() if k not in ("stats", "part")}, **({"part": whole} if whole else {}),
              "sources": [s for m in manifests for s in m["sources"]],
              "parts": [os.path.relpath(d.resolve(), out_dir.resolve()) for d in dirs],
              "splits": {split: _merged_split(dirs, manifests, split, out_dir) for split in first["splits"]},
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    _write_merged(out_dir, merged, dirs[0] / "tokenizer", force)
    log(f"merged {len(dirs)} parts into {out_dir}: " + ", ".join(
        f"{split} {entry['tokens']:,} tokens / {entry['docs']:,} docs" for split, entry in merged["splits"].items()))
    return merged


def _check_parts(dirs: list[Path], manifests: list[dict], allow_incomplete: bool) -> dict | None:
    """Every part's shards as its manifest lists them; no part twice, one splitting of each input, every part
    (unless allow_incomplete). Returns the merge's identity when it is all of one input (so it merges on)."""
    given: dict[str, tuple[int, dict[int, Path]]] = {}  # input -> (N, {I: directory})
    for d, m in zip(dirs, manifests):
        part = m.get("part")
        if not isinstance(part, dict):
            raise NanoforgeError(f"prepare merge: {d}: its manifest does not say which part of which input it holds "
                                 "(prepared by an older nanoforge, or a merge of several inputs); prepare it again")
        for split in m["splits"]:
            TokenShards(d, split)  # raises, naming the file, for a shard missing or of the wrong size
        count, group = given.setdefault(part["inputs"], (part["count"], {}))
        where = f"prepare merge: {d}: part {part['index']}/{part['count']}"
        if part["count"] != count:
            index, other = next(iter(group.items()))
            raise NanoforgeError(f"{where}, but {other} is part {index}/{count} of the same input: their records "
                                 "overlap; merge the parts of one --part I/N splitting")
        if part["index"] in group:
            raise NanoforgeError(f"{where} of its input is given twice (as {group[part['index']]} too); its tokens "
                                 "would be counted twice")
        group[part["index"]] = d
    for count, group in given.values():
        missing = [f"{i}/{count}" for i in range(1, count + 1) if i not in group]
        if missing and not allow_incomplete:
            raise NanoforgeError(f"prepare merge: {', '.join(map(str, group.values()))}: part(s) {', '.join(missing)} "
                                 "of the same input are not given; merge every part, or only these with "
                                 "`prepare merge --allow-incomplete`")
    return {"index": 1, "count": 1, "inputs": next(iter(given))} if len(given) == 1 and not missing else None


def _merged_split(dirs: list[Path], manifests: list[dict], split: str, out_dir: Path) -> dict:
    entries = [m["splits"][split] for m in manifests]
    shards = [{**shard, "name": os.path.relpath((d / shard["name"]).resolve(), out_dir.resolve())}
              for d, entry in zip(dirs, entries) for shard in entry["shards"]]
    return {"shards": shards, **{key: sum(int(e[key]) for e in entries) for key in ("tokens", "docs", "bytes")}}


def _write_merged(out_dir: Path, manifest: dict, tokenizer_dir: Path, force: bool) -> None:
    """Under `prepare`'s lock of out_dir (dirlock.staged_dir): one writer, and what a killed one left removed."""
    with writing(out_dir), terminate_as_interrupt(), staged_dir(out_dir, "being prepared") as tmp:
        check_out_dir(out_dir, force)  # again: a prepare that held the lock until now may have filled it
        shutil.copytree(tokenizer_dir, tmp / "tokenizer")
        write_json(tmp / "manifest.json", manifest)
        fsync_dir(tmp)
    fsync_dir(out_dir.parent)  # the rename (an old out_dir is deleted only once the new one is in place)
