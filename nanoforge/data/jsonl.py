"""Strict, streaming reading of MiniMind-format JSONL.

Every record is checked against its kind's schema before anything else sees it, every problem reported as
`path:line: field: message`. Reading is line by line in binary (flat memory whatever the file size) and takes
what editors commonly write: a UTF-8 byte-order mark on line 1, CRLF line ends, blank lines. Formats (docs/data.md):
    pretrain  {"text": "..."}
    sft       {"conversations": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
              also MiniMind-3's tool use: "tools" on the system message, an assistant's "tool_calls" and
              "reasoning_content", role "tool" for results (chat/messages.py: check_messages)
    dpo       {"chosen": [messages], "rejected": [messages]}  same prefix, different final assistant turn"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from typing import Any, Iterable, Iterator

from nanoforge.core import safejson
from nanoforge.chat.messages import RecordError, _keys, _type_name, check_messages
from nanoforge.core.errors import NanoforgeError

KINDS = ("pretrain", "sft", "dpo")
UTF8_BOM = b"\xef\xbb\xbf"
# Bytes read at the start of a file to tell JSONL text from a binary file.
_SNIFF_BYTES = 8192


class DataError(NanoforgeError):
    """A problem with one input file, located by path, line (1-based) and field, which is written the way a
    person would index into the record, e.g. `"conversations"[3].role`."""

    def __init__(self, message: str, path: str | os.PathLike | None = None, line: int | None = None,
                 field: str | None = None):
        self.message, self.line, self.field = message, line, field
        self.path = None if path is None else str(path)
        where = (self.path if self.path is not None else "<record>") + (f":{line}" if line is not None else "")
        super().__init__(f"{where}:{f' {field}:' if field is not None else ''} {message}")

    def __reduce__(self):
        # Errors raised in worker processes are pickled back to the parent; keep every attribute.
        return (DataError, (self.message, self.path, self.line, self.field))


@dataclass
class SkipCounter:
    """Collects records skipped with skip_invalid=True so the caller can report them: the count and the first
    `keep` messages (enough to see what is wrong, bounded for huge files)."""

    skipped: int = 0
    examples: list[str] = dataclass_field(default_factory=list)
    keep: int = 5

    def add(self, error: DataError) -> None:
        self.skipped += 1
        if len(self.examples) < self.keep:
            self.examples.append(str(error))

    def merge(self, other: "SkipCounter") -> None:
        self.skipped += other.skipped
        self.examples += other.examples[:max(0, self.keep - len(self.examples))]

    def summary(self) -> str:
        if not self.skipped:
            return "no invalid records"
        return "\n".join([f"skipped {self.skipped} invalid record(s); first ones:"] +
                         [f"  {message}" for message in self.examples])


# ---------------------------------------------------------------------------------------------- schema

def _check_pretrain(obj: dict) -> None:
    if "text" not in obj:
        raise RecordError(f'missing "text" (pretrain records look like {{"text": "..."}}); keys: {_keys(obj)}')
    text = obj["text"]
    if not isinstance(text, str):
        raise RecordError(f"must be a string, got {_type_name(text)}", '"text"')
    if not text:
        raise RecordError("is empty", '"text"')


def _check_sft(obj: dict) -> None:
    if "conversations" not in obj:
        raise RecordError('missing "conversations" (SFT records look like {"conversations": [{"role": ..., '
                          f'"content": ...}}, ...]}}); keys: {_keys(obj)}')
    check_messages(obj["conversations"], "conversations", tools=True)


def _check_dpo(obj: dict) -> None:
    for name in ("chosen", "rejected"):
        if name not in obj:
            raise RecordError(f'missing "{name}" (DPO records look like {{"chosen": [messages], '
                              f'"rejected": [messages]}}); keys: {_keys(obj)}')
        check_messages(obj[name], name)
    chosen, rejected = obj["chosen"], obj["rejected"]
    if len(chosen) != len(rejected):
        raise RecordError(f'has {len(rejected)} messages but "chosen" has {len(chosen)}; the two must share '
                          "every message but the final assistant turn", '"rejected"')
    for i in range(len(chosen) - 1):
        if (chosen[i]["role"], chosen[i]["content"]) != (rejected[i]["role"], rejected[i]["content"]):
            raise RecordError(f'differs from "chosen"[{i}]; chosen and rejected must share every message but '
                              "the final assistant turn", f'"rejected"[{i}]')
    if chosen[-1]["content"] == rejected[-1]["content"]:
        raise RecordError('is identical to the final "chosen" answer; a preference pair needs two different '
                          "answers", f'"rejected"[{len(rejected) - 1}].content')


_CHECKS = {"pretrain": _check_pretrain, "sft": _check_sft, "dpo": _check_dpo}


def validate_record(kind: str, obj: Any) -> None:
    """Raise RecordError (with .field) if `obj` is not a valid record of `kind`; return None if it is."""
    if kind not in _CHECKS:
        raise NanoforgeError(f"unknown data kind {kind!r}; expected one of {', '.join(KINDS)}")
    if not isinstance(obj, dict):
        raise RecordError(f"each line must be a JSON object, got {_type_name(obj)}")
    _CHECKS[kind](obj)


# ---------------------------------------------------------------------------------------------- lines

# One record over this is almost surely a file that is not JSONL (or a whole corpus on one line); tokenizing it
# as one document would need gigabytes. Split such documents into several records.
MAX_RECORD_BYTES = 32 << 20


def record_too_long(path, line_no) -> DataError:
    """A line longer than the limit, said as such: a reader stops at the limit, so how long the line is, is unknown."""
    return DataError(f"the line is over {MAX_RECORD_BYTES >> 20} MB, the limit for one record; split the document "
                     "into several records", path, line_no)


def line_text(raw: bytes, path: str | os.PathLike, line_no: int) -> str | None:
    """One raw line's text (line 1's BOM dropped), None for a blank line; DataError for one that is too long,
    binary or not UTF-8."""
    if line_no == 1 and raw.startswith(UTF8_BOM):
        raw = raw[len(UTF8_BOM):]
    if len(raw) > MAX_RECORD_BYTES:
        raise record_too_long(path, line_no)
    if not raw.strip():
        return None
    if b"\x00" in raw:
        raise DataError("contains NUL bytes; is this a binary file?", path, line_no)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"invalid UTF-8 at byte {e.start} of the line; re-encode the file as UTF-8",
                        path, line_no) from None


def line_json(text: str, path: str | os.PathLike, line_no: int) -> Any:
    """A line's JSON value, all of its strings Unicode text (check_unicode); DataError naming path:line (and a
    JSON array on line 1, or the field) otherwise."""
    try:
        value = safejson.loads(text)
    except json.JSONDecodeError as e:
        hint = ""
        if line_no == 1 and text.lstrip().startswith("["):
            hint = "; this looks like a JSON array: JSONL needs one JSON object per line"
        raise DataError(f"invalid JSON: {e.msg} at column {e.colno}{hint}", path, line_no) from None
    if _SURROGATE_ESCAPE.search(text):  # only an escape can give a lone surrogate: the line is strict UTF-8
        try:
            check_unicode(value)
        except RecordError as e:
            raise DataError(e.message, path, line_no, e.field) from None
    return value


# JSON's \ud800-\udfff escapes, the only way a lone surrogate gets into a parsed line (as a pair they are fine)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # Python keeps bytes that are not UTF-8 as these too


def check_unicode(value: Any, field: str | None = None) -> None:
    """RecordError naming the first string of a JSON value (an object key included) that holds a lone surrogate,
    which JSON's "\\ud800" escape gives: not Unicode text, so no tokenizer, file or terminal can take it. Every
    reader of JSON data checks its values here (line_json; columnar.check_row for JSON-text columns)."""
    if isinstance(value, str):
        if LONE_SURROGATE.search(value):
            raise RecordError("contains a lone surrogate (a \\ud800-\\udfff escape that is not half of a pair), "
                              "which is not Unicode text; fix or drop the record", field)
    elif isinstance(value, dict):
        for key, item in value.items():
            where = json.dumps(key) if field is None else f"{field}.{key}" if key.isidentifier() else \
                f"{field}[{json.dumps(key)}]"
            if LONE_SURROGATE.search(key):
                raise RecordError("a key contains a lone surrogate (a \\ud800-\\udfff escape that is not half of a "
                                  f"pair), which is not Unicode text: {where}", field)
            check_unicode(item, where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{field or ''}[{i}]")


def parse_line(raw: bytes, kind: str | None, path: str | os.PathLike, line_no: int) -> dict | None:
    """Decode, parse and validate one raw line (kind=None: of the kind its keys say). Returns None for a blank
    line; raises DataError. Shared (through parse_lines) by iter_records and the parallel workers of `prepare`,
    so both report errors identically."""
    text = line_text(raw, path, line_no)
    if text is None:
        return None
    obj = line_json(text, path, line_no)
    if kind is None:  # mixed files (tokenizer training): the keys say what the record is
        kind = detect_kind(obj)
        if kind is None:
            raise DataError('cannot tell the kind of record: expected a "text", "conversations" or '
                            '"chosen"/"rejected" key' + (f"; keys: {_keys(obj)}" if isinstance(obj, dict) else
                                                         f", got {_type_name(obj)}"), path, line_no)
    try:
        validate_record(kind, obj)
    except RecordError as e:
        raise DataError(e.message, path, line_no, e.field) from None
    return obj


def parse_lines(lines: Iterable[bytes], kind: str | None, path: str | os.PathLike, first_line: int = 1,
                skip_invalid: bool = False, counter: SkipCounter | None = None) -> Iterator[tuple[int, dict]]:
    """(line_no, record) of each valid record of raw `lines` numbered from `first_line` (a file, or a chunk of
    one); an invalid one raises its DataError, or with skip_invalid is added to `counter` and passed over."""
    for line_no, raw in enumerate(lines, start=first_line):
        try:
            record = parse_line(raw, kind, path, line_no)
        except DataError as e:
            if not skip_invalid:
                raise
            if counter is not None:
                counter.add(e)
            continue
        if record is not None:
            yield line_no, record


def check_input_file(path: str | os.PathLike) -> Path:
    """Fail early, naming the path, if it is missing, a directory, empty or binary."""
    path = Path(path)
    if not path.exists():
        raise DataError("no such file", path)
    if path.is_dir():
        raise DataError("is a directory; pass the .jsonl files inside it", path)
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError as e:
        raise DataError(f"cannot be read: {e.strerror}", path) from None
    if not head.strip(UTF8_BOM + b" \t\r\n"):
        raise DataError("is empty (no records)", path)
    if head.startswith(b"\x1f\x8b"):
        raise DataError("is gzip-compressed; decompress it first (gunzip)", path)
    if b"\x00" in head:
        raise DataError("is a binary file (it contains NUL bytes), not JSONL text", path)
    return path


def check_given_once(paths: Iterable, what: str = "") -> None:
    """The rule for the input files of `prepare` (training on raw files, `eval`) and `tokenizer train`: none given
    twice, under any of its names (`a`, `./a`, a symlink, a hard link: one file), or its records would be counted
    twice, as `prepare merge` refuses a part given twice (data/parts.py, which knows a part by its manifest). `what`
    starts the message (the flag). A path that does not exist is its own check's error."""
    seen: dict[tuple[int, int], str] = {}
    for given in paths:
        try:
            status = os.stat(given)
        except OSError:
            continue
        key = (status.st_dev, status.st_ino)
        if key in seen:
            same = f" (as {seen[key]} too)" if seen[key] != str(given) else ""
            raise NanoforgeError(f"{what}{given} is given twice{same}; its records would be counted twice; give "
                                 "each input once")
        seen[key] = str(given)


def iter_records(path: str | os.PathLike, kind: str | None, skip_invalid: bool = False,
                 counter: SkipCounter | None = None) -> Iterator[tuple[int, dict]]:
    """Yield (line_no, record) for every valid record of `kind` in the JSONL file at `path` (kind=None: of
    any kind, detected per record). Invalid records raise DataError, or with skip_invalid=True are skipped and
    added to `counter`. A file with no records at all (or none valid) raises DataError naming the path."""
    if kind is not None and kind not in KINDS:
        raise NanoforgeError(f"unknown data kind {kind!r}; expected one of {', '.join(KINDS)}")
    path = check_input_file(path)
    seen = 0
    with open(path, "rb") as f:
        for line_no, record in parse_lines(f, kind, path, 1, skip_invalid, counter):
            seen += 1
            yield line_no, record
    if seen == 0:
        raise DataError(f"has no valid {kind} records" if kind else "has no valid records", path)


def detect_kind(obj: Any) -> str | None:
    """The kind of a record judged by its keys (used where files of several kinds are mixed)."""
    if isinstance(obj, dict):
        if "text" in obj:
            return "pretrain"
        if "conversations" in obj:
            return "sft"
        if "chosen" in obj or "rejected" in obj:
            return "dpo"
    return None
