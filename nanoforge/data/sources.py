"""What --data names: one directory made by `nanoforge prepare`, or raw files (JSONL, plain text) to prepare
on the fly; and the kind of data they hold. Training (train/rundir.py) and `nanoforge eval` both ask here."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from nanoforge.data.columnar import check_columnar, columnar_kind, is_columnar, is_hf_dataset_dir
from nanoforge.data.jsonl import check_input_file, detect_kind, iter_records
from nanoforge.data.shards import read_manifest
from nanoforge.errors import NanoforgeError
from nanoforge.tokenizer import PLAIN_TEXT_SUFFIXES


def is_plain_text(path) -> bool:
    return Path(path).suffix.lower() in PLAIN_TEXT_SUFFIXES


def is_prepared(path) -> bool:
    return Path(path).is_dir() and (Path(path) / "manifest.json").is_file()


def prepared_dir(data: Sequence) -> Path | None:
    """The prepared directory `data` names (one directory, alone, with a valid manifest.json), or None when
    it names raw files to prepare on the fly. No data, or a directory among files, is an error."""
    paths = [Path(p) for p in data]
    if not paths:
        raise NanoforgeError("--data is required: a prepared directory or one or more JSONL files")
    if len(paths) == 1 and paths[0].is_dir() and not is_hf_dataset_dir(paths[0]):
        read_manifest(paths[0])  # raises, naming the directory, when it is not prepared data
        return paths[0]
    if len(paths) > 1 and all(is_prepared(p) for p in paths):
        return None  # prepared parts: a training run merges them into RUN/data (data/parts.py), copying no token
    for p in paths:
        if p.is_dir() and not is_hf_dataset_dir(p):
            raise NanoforgeError(f"{p}: a directory; give JSONL files, or one directory made by "
                                 "`nanoforge prepare`")
    return None


def data_kind(data: Sequence[str]) -> str:
    """The kind of the given data: a prepared directory's manifest, or the first record of a JSONL file."""
    prepared = prepared_dir(data)
    if prepared is not None:
        return read_manifest(prepared)["kind"]
    first = Path(data[0])
    if is_prepared(first):  # one of several prepared parts
        return read_manifest(first)["kind"]
    if is_columnar(first):  # Parquet, a datasets directory: the columns say
        return columnar_kind(check_columnar(first))
    check_input_file(first)
    if is_plain_text(first):  # a .txt/.md file is one pretraining document
        return "pretrain"
    _, record = next(iter_records(first, None))  # checked like every record (file:line: field: errors)
    return detect_kind(record)
