"""What --data names: one directory made by `nanoforge prepare`, or raw files (JSONL, plain text) to prepare
on the fly; and the kind of data they hold. Training (train/rundir.py) and `nanoforge eval` both ask here."""
import codecs
import os
from pathlib import Path
from typing import Iterator, Sequence

from nanoforge.data.columnar import check_columnar, columnar_kind, is_columnar
from nanoforge.data.jsonl import DataError, check_given_once, check_input_file, detect_kind, iter_records
from nanoforge.data.shards import read_manifest
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.dirlock import staged_dir
from nanoforge.core.fsutil import check_out_apart, check_out_dir, writing
from nanoforge.chat.tokenizer import PLAIN_TEXT_SUFFIXES, Tokenizer, train_bpe

_TEXT_BLOCK_BYTES = 1 << 20  # plain-text files are fed to the trainer in ~1 MB blocks cut at newlines


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
    if len(paths) == 1 and paths[0].is_dir() and not is_columnar(paths[0]):
        read_manifest(paths[0])  # raises, naming the directory, when it is not prepared data
        return paths[0]
    if len(paths) > 1 and all(is_prepared(p) for p in paths):
        return None  # prepared parts: a training run merges them into RUN/data (data/parts.py), copying no token
    for p in paths:
        if p.is_dir() and not is_columnar(p):
            raise NanoforgeError(f"{p}: a directory; give JSONL files, or one directory made by " "`nanoforge prepare`")
    return None


def data_kind(data: Sequence[str]) -> str:
    """The kind of the given data: a prepared directory's manifest, or the first record of a JSONL file."""
    prepared_dir(data)  # raises for no data, or a directory among files
    first = Path(data[0])
    if is_prepared(first):  # the prepared directory, or one of several prepared parts
        return read_manifest(first)["kind"]
    if is_columnar(first):  # Parquet, a datasets directory: the columns say
        return columnar_kind(check_columnar(first))
    check_input_file(first)
    if is_plain_text(first):  # a .txt/.md file is one pretraining document
        return "pretrain"
    _, record = next(iter_records(first, None))  # checked like every record (file:line: field: errors)
    return detect_kind(record)


def train_tokenizer(files, vocab_size: int = 6400, out_dir: str | os.PathLike | None = None,
                    min_frequency: int = 2, force: bool = False) -> Tokenizer:
    """`nanoforge tokenizer train`: a byte-level BPE tokenizer (tokenizer.train_bpe) on JSONL (pretrain/SFT/DPO,
    detected per line) or plain-text files, each checked and given once before training starts, and so is `out_dir`:
    apart from the files, and new or empty unless `force`. Written there under a temporary name, renamed into
    place."""
    files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not files:
        raise NanoforgeError("no training files given for the tokenizer")
    paths = [check_input_file(f) for f in files]
    check_given_once(paths, "--data ")
    if out_dir is not None:
        out_dir = Path(out_dir)
        check_out_apart(out_dir, paths)
        check_out_dir(out_dir, force)
    tokenizer = train_bpe(_training_texts(paths), vocab_size, None, min_frequency)
    if out_dir is not None:
        with writing(out_dir), staged_dir(out_dir) as tmp:
            tokenizer.save(tmp)
    return tokenizer


def _training_texts(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        yield from (_plain_text_blocks if path.suffix.lower() in PLAIN_TEXT_SUFFIXES else _jsonl_texts)(path)


def _jsonl_texts(path: Path) -> Iterator[str]:
    """Every text a model will see in this file: pretrain text, message contents of SFT and DPO records."""
    for _, record in iter_records(path, None):
        kind = detect_kind(record)
        if kind == "pretrain":
            yield record["text"]
        elif kind == "sft":
            for message in record["conversations"]:
                yield from (message.get(k) for k in ("content", "reasoning_content") if isinstance(message.get(k), str))
        else:  # dpo: the shared prefix once, then both final answers
            yield from (message["content"] for message in record["chosen"])
            yield record["rejected"][-1]["content"]


def _plain_text_blocks(path: Path) -> Iterator[str]:
    """~1 MB blocks of a text file, cut after a newline, decoded incrementally (never the whole file)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry, line_no = "", 1
    with open(path, "rb") as f:
        while True:
            raw = f.read(_TEXT_BLOCK_BYTES)
            try:
                text = carry + decoder.decode(raw, final=not raw)
            except UnicodeDecodeError:
                raise DataError("invalid UTF-8; re-encode the file as UTF-8", path, line_no) from None
            if not raw:
                if text:
                    yield text
                return
            cut = text.rfind("\n") + 1
            if cut == 0 and len(text) < 4 * _TEXT_BLOCK_BYTES:
                carry = text  # no newline yet: keep reading, up to a bound for one-line files
                continue
            cut = cut or len(text)
            line_no += text.count("\n", 0, cut)
            yield text[:cut]
            carry = text[cut:]
