"""Columnar inputs for `prepare` and on-the-fly preparing: Parquet files and HF `datasets` directories (what
`Dataset.save_to_disk` writes: `state.json`, `dataset_info.json` and `data-*.arrow` files in Arrow's IPC
stream format), read locally with pyarrow (the optional `parquet` extra; `datasets` itself is never needed and
no hub is ever asked). A `DatasetDict.save_to_disk` folder (what `load_dataset(...).save_to_disk()` gives:
`dataset_dict.json` and one such directory per split) stands for one of its splits (`--split`, `dataset_split`).

A row is a record, as a JSONL line is: pretraining takes one string column (`text`, or --text-column), SFT
and DPO take the whole row (`conversations`, optionally `tools`; `chosen` and `rejected`). Arrow's structs
hold every key of every message, with nulls where a message lacks one: null-valued keys are dropped, so a
row equals the JSONL record it was made from; a column holding JSON text is parsed. Rows are numbered from
1, and errors say `file.parquet:row 17: "conversations"[1].role: ...`.

Memory stays flat: rows are read a batch at a time (Parquet row group by row group, Arrow's stored record
batches), never the whole file."""
import hashlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from nanoforge.core import safejson
from nanoforge.chat.messages import RecordError
from nanoforge.data.jsonl import DataError, check_unicode, validate_record
from nanoforge.core.errors import NanoforgeError

ROWS_PER_CHUNK = 1024  # rows handed to a tokenizer worker at a time
HF_STATE = "state.json"
HF_INFO = "dataset_info.json"
HF_DICT = "dataset_dict.json"  # a DatasetDict's: {"splits": ["train", "test", ...]}, a Dataset directory per split


def _pyarrow():
    """pyarrow, the optional `parquet` extra (imported here: JSONL users need not install it)."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401  (registers pyarrow.parquet)
    except ImportError:
        raise NanoforgeError("reading Parquet or Arrow data needs pyarrow: pip install 'nanoforge[parquet]'") from None
    return pyarrow


def is_hf_dataset_dir(path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / HF_STATE).is_file() and (path / HF_INFO).is_file()


def is_hf_dataset_dict(path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / HF_DICT).is_file()


def is_columnar(path) -> bool:
    return Path(path).suffix.lower() == ".parquet" or is_hf_dataset_dir(path) or is_hf_dataset_dict(path)


def dataset_dict_splits(path: Path) -> list[str]:
    """The split names a DatasetDict directory's dataset_dict.json lists."""
    try:
        splits = safejson.loads((path / HF_DICT).read_text(encoding="utf-8"))["splits"]
        if not (isinstance(splits, list) and all(isinstance(name, str) for name in splits)):
            raise TypeError("not a list of names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"does not list the splits (\"splits\"): {e}", path / HF_DICT) from None
    return splits


def dataset_split(path, split: str) -> Path:
    """`path`, or where it is a DatasetDict directory the directory of its split `split` (a Dataset directory, read
    as any); a split it has not is an error naming those it has."""
    path = Path(path)
    if not is_hf_dataset_dict(path):
        return path
    splits = dataset_dict_splits(path)
    if split not in splits:
        raise DataError(f"a datasets DatasetDict with the splits {', '.join(splits)}, and no {split!r}: choose one "
                        "with --split NAME", path)
    if not is_hf_dataset_dir(path / split):
        raise DataError(f"{HF_DICT} lists the split {split!r}, whose directory (with {HF_STATE} and {HF_INFO}) is "
                        "missing", path)
    return path / split


def arrow_files(path: Path) -> list[Path]:
    """The data files of a save_to_disk directory, in order (state.json's `_data_files`)."""
    try:
        state = safejson.loads((path / HF_STATE).read_text(encoding="utf-8"))
        files = [path / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"does not list the data files (_data_files): {e}", path / HF_STATE) from None
    for f in files:
        if not f.is_file():
            raise DataError(f"{HF_STATE} lists {f.name}, which is missing", path)
    return files


def check_columnar(path) -> Path:
    """Fail early, naming the path: missing, or a file not readable as Parquet / an Arrow stream (each of whose
    batches is looked at: memory-mapped, only their headers are read, so a truncated file fails here)."""
    path = Path(path)
    if not path.exists():
        raise DataError("no such file", path)
    if is_hf_dataset_dict(path):  # never read whole: one split is (dataset_split)
        splits = dataset_dict_splits(path)
        raise DataError(f"a datasets DatasetDict with the splits {', '.join(splits)}: give one split's directory "
                        f"({path / (splits or ['train'])[0]}), or to a command that takes it --split NAME", path)
    num_rows(path) if path.is_dir() else _schema(path)
    return path


@contextmanager
def _reading(f: Path):
    """Every pyarrow read goes through here: a truncated, empty or foreign file is a DataError naming it."""
    pa = _pyarrow()
    try:
        yield pa
    except (pa.ArrowException, OSError) as e:
        what = "Parquet" if f.suffix.lower() == ".parquet" else "an Arrow stream (datasets save_to_disk)"
        raise DataError(f"cannot be read as {what}: {e}", f) from None


def _open(pa, f: Path, columns: list[str] | None = None) -> tuple[list[str], Iterator[Any]]:
    """(column names, record batches as stored, read lazily: Parquet row group by row group, an Arrow stream's
    batches) of a Parquet file or one Arrow stream file of a datasets directory."""
    if f.suffix.lower() != ".parquet":
        reader = pa.ipc.open_stream(pa.memory_map(str(f)))
        return reader.schema.names, (batch.select(columns) if columns else batch for batch in reader)
    pf = pa.parquet.ParquetFile(f)
    return pf.schema_arrow.names, (batch for group in range(pf.num_row_groups) for batch in
                                   pf.iter_batches(batch_size=ROWS_PER_CHUNK, row_groups=[group], columns=columns))


def _schema(f: Path) -> list[str]:
    with _reading(f) as pa:
        return _open(pa, f)[0]


def columnar_kind(path: Path) -> str:
    """The kind of data a Parquet file or datasets directory holds, from its columns."""
    names = _schema(arrow_files(path)[0] if path.is_dir() else path)
    if "conversations" in names:
        return "sft"
    if "chosen" in names or "rejected" in names:
        return "dpo"
    return "pretrain"


def num_rows(path: Path) -> int:
    """Rows in a Parquet file (reading no column) or a datasets directory (its record batches' lengths)."""
    return sum(batch.num_rows for batch in _batches(path, []))


def _batches(path: Path, columns: list[str] | None) -> Iterator[Any]:
    """Arrow record batches of every file, read as they are stored (never the whole file); each file must have
    `columns`."""
    for f in arrow_files(path) if path.is_dir() else [path]:
        with _reading(f) as pa:
            names, batches = _open(pa, f, columns)
            if missing := [c for c in columns or () if c not in names]:
                raise DataError(f"has no column {missing[0]!r} (its columns: {', '.join(names)}); choose the text "
                                "column with --text-column", f)
            yield from batches


def row_chunks(path: Path, kind: str, text_column: str = "text") -> Iterator[tuple[int, list[dict]]]:
    """(first row number, rows as plain records) chunks of at most ROWS_PER_CHUNK rows. Pretraining reads only
    `text_column`, renamed `text`; the other kinds read every column."""
    row = 1
    for batch in _batches(path, [text_column] if kind == "pretrain" else None):
        for start in range(0, batch.num_rows, ROWS_PER_CHUNK):
            rows = batch.slice(start, ROWS_PER_CHUNK).to_pylist()
            if kind == "pretrain":
                rows = [{"text": r[text_column]} for r in rows]
            yield row, [_plain(r) for r in rows]
            row += len(rows)


def _plain(value: Any) -> Any:
    """A row as the JSONL record it stands for: Arrow's null struct fields dropped."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def check_row(kind: str, record: dict, path: str, row: int) -> dict:
    """One row validated as a JSONL record is (data/jsonl.py's rules); a JSON-text column is parsed first."""
    for key in ("conversations", "chosen", "rejected", "tools"):
        if kind != "pretrain" and isinstance(record.get(key), str):
            try:
                record[key] = safejson.loads(record[key])
            except json.JSONDecodeError as e:
                raise DataError(f"invalid JSON text: {e.msg} at column {e.colno}", path, f"row {row}",
                                json.dumps(key)) from None
    try:
        if kind != "pretrain":  # a JSON-text column's escapes may be lone surrogates; Arrow's strings are UTF-8
            check_unicode(record)
        validate_record(kind, record)
    except RecordError as e:
        raise DataError(e.message, path, f"row {row}", e.field) from None
    return record


def as_row_error(error: DataError) -> DataError:
    """A DataError raised with a row's number as its line, relabelled `row N`."""
    if isinstance(error.line, int):
        return DataError(error.message, error.path, f"row {error.line}", error.field)
    return error


def hash_source(path: Path, hasher: "hashlib._Hash") -> int:
    """Feed the file (or a directory's Arrow files, in order) to `hasher`; return the bytes read."""
    size = 0
    for f in arrow_files(path) if path.is_dir() else [path]:
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                hasher.update(block)
                size += len(block)
    return size
