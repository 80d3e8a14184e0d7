"""Strict, streaming reading of MiniMind-format JSONL.

Every record is checked against the schema of its kind before anything else sees it, and every problem is
reported as `path:line: field: message`, so a person can open the file at that line and fix it. Reading is
line by line in binary (memory stays flat whatever the file size) and tolerates what editors and other tools
commonly produce: a UTF-8 byte-order mark on line 1, CRLF line ends, blank lines.

Formats (see DESIGN.md, "Data formats"):
    pretrain  {"text": "..."}
    sft       {"conversations": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
              also MiniMind-3's tool use: "tools" on the system message, an assistant's "tool_calls" and
              "reasoning_content", role "tool" for results (see _check_messages)
    dpo       {"chosen": [messages], "rejected": [messages]}  same prefix, different final assistant turn
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from typing import Any, Iterable, Iterator

from nanoforge import safejson
from nanoforge.errors import NanoforgeError

KINDS = ("pretrain", "sft", "dpo")
ROLES = ("system", "user", "assistant")
UTF8_BOM = b"\xef\xbb\xbf"
# Bytes read at the start of a file to tell JSONL text from a binary file.
_SNIFF_BYTES = 8192


class DataError(NanoforgeError):
    """A problem with one input file, located by path, line (1-based) and field.

    `field` is written the way a person would index into the record, e.g. `"conversations"[3].role`.
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None, line: int | None = None,
                 field: str | None = None):
        self.message, self.line, self.field = message, line, field
        self.path = None if path is None else str(path)
        super().__init__(self._format())

    def _format(self) -> str:
        where = self.path if self.path is not None else "<record>"
        line = f":{self.line}" if self.line is not None else ""
        field = f" {self.field}:" if self.field is not None else ""
        return f"{where}{line}:{field} {self.message}"

    def __reduce__(self):
        # Errors raised in worker processes are pickled back to the parent; keep every attribute.
        return (DataError, (self.message, self.path, self.line, self.field))


class RecordError(NanoforgeError, ValueError):
    """A schema violation inside one record, before its file and line are known (see validate_record)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message if field is None else f"{field}: {message}")
        self.message, self.field = message, field


@dataclass
class SkipCounter:
    """Collects records skipped with skip_invalid=True so the caller can report them.

    Keeps the count and the first `keep` messages (enough to see what is wrong, bounded for huge files).
    """

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
        lines = [f"skipped {self.skipped} invalid record(s); first ones:"]
        lines += [f"  {message}" for message in self.examples]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- schema


def _check_messages(messages: Any, name: str, tools: bool = False) -> None:
    """A conversation: at most one leading system message, then user/assistant strictly alternating,
    starting with user and ending with assistant (what MiniMind's SFT and DPO loaders assume).

    tools=True (SFT) also accepts MiniMind-3's tool use: `tools` on the opening system message, an
    assistant's `tool_calls` (content may then be null) and `reasoning_content`, and `tool` messages, which
    follow an assistant message with tool_calls (at most one per call) and are followed by an assistant."""
    if not isinstance(messages, list):
        raise RecordError(f"must be a list of messages, got {_type_name(messages)}", f'"{name}"')
    if not messages:
        raise RecordError("is an empty conversation; it needs at least a user and an assistant message",
                          f'"{name}"')
    declared = _declared_tools(messages, name) if tools else None
    calls = answered = 0  # tool calls of the last assistant message, and tool messages answering them
    for i, message in enumerate(messages):
        where = f'"{name}"[{i}]'
        _check_role_and_content(message, where, tools)
        role = message["role"]
        parsed = check_tool_fields(message, f"{where}.", declared) if tools else None
        expected = _expected_role(messages, i, calls, answered)
        if role not in expected:
            previous = f'after "{messages[i - 1]["role"]}"' if i else "as the first message"
            wanted = " or ".join(f'"{r}"' for r in expected)
            raise RecordError(f'expected {wanted} {previous}, got "{role}" ({_order_rule(messages, i, calls)})',
                              f"{where}.role")
        if role == "assistant":
            calls, answered = len(parsed or []), 0
        elif role == "tool":
            answered += 1
    last = messages[-1]["role"]
    if last != "assistant":
        raise RecordError(f'must end with an assistant message, ends with "{last}"', f'"{name}"')


def _check_role_and_content(message: Any, where: str, tools: bool) -> None:
    if not isinstance(message, dict):
        raise RecordError(f"must be an object with role and content, got {_type_name(message)}", where)
    for key in ("role", "content"):
        if key not in message and not (key == "content" and tools and has_tool_calls(message)):
            raise RecordError(f'missing "{key}"', where)
    if not isinstance(message["role"], str):
        raise RecordError(f"must be a string, got {_type_name(message['role'])}", f"{where}.role")
    check_content(message, f"{where}.", tools)
    roles = ROLES + (("tool",) if tools else ())
    if message["role"] not in roles:
        extra = " (or tool, answering an assistant's tool_calls)" if tools else ""
        raise RecordError(f'"{message["role"]}" is not one of {", ".join(ROLES)}{extra}', f"{where}.role")


def _expected_role(messages: list, i: int, calls: int = 0, answered: int = 0) -> tuple[str, ...]:
    """The roles allowed at position i given the ones before it (`calls`: tool calls of the last assistant
    message, `answered`: the tool messages after it so far)."""
    if i == 0:
        return ("system", "user")
    previous = messages[i - 1]["role"]
    if previous == "user":
        return ("assistant",)
    if previous == "assistant" and calls:
        return ("tool",)
    if previous == "tool":
        return ("tool", "assistant") if answered < calls else ("assistant",)
    return ("user",)


def _order_rule(messages: list, i: int, calls: int) -> str:
    role, previous = messages[i]["role"], messages[i - 1]["role"] if i else None
    if role == "tool" and not (previous in ("assistant", "tool") and calls):
        return "a tool message answers a call in the tool_calls of the assistant message before it"
    if role == "tool":
        return f"no more tool messages than the {calls} tool_calls they answer"
    if previous in ("assistant", "tool") and calls:
        return f"the {calls} tool_calls are answered by tool messages, then the assistant replies"
    return "at most one leading system message, then user and assistant alternating"


# ---------------------------------------------------------------------------------------------- tool use
# The shapes of MiniMind-3's tool use, checked here for `prepare` and by chat/messages.py before rendering (one
# definition of each). `prefix` starts every RecordError field: '"conversations"[2].' here, "" for toolcalls.


def _parsed_json(value: Any) -> Any:
    """A JSON-string field parsed (an empty string is an empty list, as the renderer reads it); else as it is."""
    if not isinstance(value, str):
        return value
    return safejson.loads(value) if value.strip() else []


def _json_field(value: Any, field: str, parse=_parsed_json) -> Any:
    try:
        return parse(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise RecordError(f"not valid JSON: {e.msg} at column {e.colno}", field) from None


def has_tool_calls(message: dict) -> bool:
    """Whether an assistant message calls tools (invalid JSON counts as calls: its own check reports it)."""
    try:
        return bool(_parsed_json(message.get("tool_calls")))
    except json.JSONDecodeError:
        return True


def call_function(call: dict) -> Any:
    """A tool call's {"name", "arguments"}: its "function" when set (as the chat template reads it), else itself."""
    return call["function"] if call.get("function") else call


def tool_function(tool: dict) -> dict:
    """A tool schema's {"name", "parameters", ...}: OpenAI's {"type": "function", "function": {...}}, or bare."""
    return tool["function"] if isinstance(tool.get("function"), dict) else tool


def check_content(message: dict, prefix: str = "", tools: bool = True) -> None:
    """`content` is a string, or (tools=True) null in an assistant message that calls tools."""
    content = message.get("content")
    if isinstance(content, str) or (tools and content is None and message["role"] == "assistant"
                                    and has_tool_calls(message)):
        return
    why = " (null is allowed only in an assistant message with tool_calls)" if tools and content is None else ""
    raise RecordError(f"must be a string, got {_type_name(content)}{why}", f"{prefix}content")


def parsed_tools(tools: Any, field: str) -> list:
    """`tools`: a list of tool schema objects, or a JSON string of one, parsed."""
    tools = _json_field(tools, field)
    if not isinstance(tools, list):
        raise RecordError(f"must be a list of tool schemas (or a JSON string of one), got {_type_name(tools)}",
                          field)
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RecordError(f"must be a tool schema object, got {_type_name(tool)}", f"{field}[{j}]")
    return tools


def _declared_tools(messages: list, name: str) -> set[str] | None:
    """The tool names the opening system message declares in `tools` (None when it declares none)."""
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("tools") is not None and not (
                i == 0 and message.get("role") == "system"):
            raise RecordError("only the opening system message declares tools", f'"{name}"[{i}].tools')
    if not isinstance(messages[0], dict) or messages[0].get("tools") is None:
        return None
    where = f'"{name}"[0].tools'
    names = set()
    for j, tool in enumerate(parsed_tools(messages[0]["tools"], where)):
        inner = tool_function(tool)
        if not (isinstance(inner.get("name"), str) and inner["name"]):
            raise RecordError('must be a tool schema with a string "name" (or OpenAI\'s {"type": "function", '
                              '"function": {"name": ..., "parameters": ...}})', f"{where}[{j}]")
        names.add(inner["name"])
    return names


def check_tool_fields(message: dict, prefix: str = "", declared: set[str] | None = None,
                      json_arguments: bool = True) -> list | None:
    """`reasoning_content` and `tool_calls` of one message; returns the calls, parsed (None when it has none).
    `declared`: the names a call may use (None: any). json_arguments=False passes a string `arguments` as
    written (the renderer does, like HF's apply_chat_template); True (data) requires a JSON object in it."""
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise RecordError(f"must be a string, got {_type_name(reasoning)}", f"{prefix}reasoning_content")
    calls, where = message.get("tool_calls"), f"{prefix}tool_calls"
    if calls is None:
        return None
    if message["role"] != "assistant":
        raise RecordError(f"only assistant messages call tools (this is a {message['role']} message)", where)
    calls = _json_field(calls, where)
    if isinstance(calls, dict):
        raise RecordError("must be a list of calls, got one object (wrap it in a list)", where)
    if not isinstance(calls, list):
        raise RecordError(f"must be a list of calls (or a JSON string of one), got {_type_name(calls)}", where)
    for k, call in enumerate(calls):
        _check_call(call, f"{where}[{k}]", declared, json_arguments)
    return calls


def _check_call(call: Any, where: str, declared: set[str] | None, json_arguments: bool) -> None:
    if not isinstance(call, dict):
        raise RecordError('must be an object: {"name": ..., "arguments": ...} or OpenAI\'s {"type": "function", '
                          f'"function": {{"name": ..., "arguments": ...}}}}, got {_type_name(call)}', where)
    if call_function(call) is not call:
        where, call = f"{where}.function", call["function"]
        if not isinstance(call, dict):
            raise RecordError(f'must be an object with "name" and "arguments", got {_type_name(call)}', where)
    name = call.get("name")
    if name is None:
        raise RecordError('missing "name"', where)
    if not isinstance(name, str) or not name:
        raise RecordError(f"must be a non-empty string, got {_type_name(name)}", f"{where}.name")
    if declared is not None and name not in declared:
        known = ", ".join(sorted(declared)) or "none"
        raise RecordError(f'"{name}" is not a tool the record declares (in the system message\'s tools: {known})',
                          f"{where}.name")
    if "arguments" not in call:
        raise RecordError('missing "arguments" (an object, or a JSON string of one)', where)
    arguments = call["arguments"]
    if json_arguments:
        arguments = _json_field(arguments, f"{where}.arguments", safejson.loads)
    if not isinstance(arguments, dict if json_arguments else (dict, str)):
        raise RecordError(f"must be an object of arguments (or a JSON string of one), got {_type_name(arguments)}",
                          f"{where}.arguments")


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
    _check_messages(obj["conversations"], "conversations", tools=True)


def _check_dpo(obj: dict) -> None:
    for name in ("chosen", "rejected"):
        if name not in obj:
            raise RecordError(f'missing "{name}" (DPO records look like {{"chosen": [messages], '
                              f'"rejected": [messages]}}); keys: {_keys(obj)}')
        _check_messages(obj[name], name)
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


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _keys(obj: dict) -> str:
    return ", ".join(f'"{k}"' for k in list(obj)[:8]) or "none"


# ---------------------------------------------------------------------------------------------- lines


# One record over this is almost surely a file that is not JSONL (or a whole corpus on one line); tokenizing it
# as one document would need gigabytes. Split such documents into several records.
MAX_RECORD_BYTES = 32 << 20


def record_too_long(size: int, path, line_no: int) -> DataError:
    return DataError(f"the line is {size / 1e6:.0f} MB, over the {MAX_RECORD_BYTES >> 20} MB limit for one record; "
                     f"split the document into several records", path, line_no)


def line_text(raw: bytes, path: str | os.PathLike, line_no: int) -> str | None:
    """One raw line's text (line 1's BOM dropped), None for a blank line; DataError for one that is too long,
    binary or not UTF-8."""
    if line_no == 1 and raw.startswith(UTF8_BOM):
        raw = raw[len(UTF8_BOM):]
    if len(raw) > MAX_RECORD_BYTES:
        raise record_too_long(len(raw), path, line_no)
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
    """A line's JSON value; DataError naming path:line (and a JSON array on line 1) otherwise."""
    try:
        return safejson.loads(text)
    except json.JSONDecodeError as e:
        hint = ""
        if line_no == 1 and text.lstrip().startswith("["):
            hint = "; this looks like a JSON array: JSONL needs one JSON object per line"
        raise DataError(f"invalid JSON: {e.msg} at column {e.colno}{hint}", path, line_no) from None


def parse_line(raw: bytes, kind: str | None, path: str | os.PathLike, line_no: int) -> dict | None:
    """Decode, parse and validate one raw line. Returns None for a blank line; raises DataError.

    Shared (through parse_lines) by iter_records and the parallel workers of `prepare`, so both report errors
    identically.
    kind=None detects the kind of each record from its keys.
    """
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


def iter_records(path: str | os.PathLike, kind: str | None, skip_invalid: bool = False,
                 counter: SkipCounter | None = None) -> Iterator[tuple[int, dict]]:
    """Yield (line_no, record) for every valid record of `kind` in the JSONL file at `path` (kind=None: of
    any kind, detected per record).

    Invalid records raise DataError, or with skip_invalid=True are skipped and added to `counter`.
    A file with no records at all (or none valid) raises DataError naming the path.
    """
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
