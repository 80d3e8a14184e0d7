"""A model's reply text -> reasoning, content and tool calls, in MiniMind-3's format (chat/template.py's
THINKING_TOOLS_TEMPLATE), whole (`parse_reply`, which feeds a `StreamParser`, so both agree) or as it streams.

The reply is what the model writes after the generation prompt, without the closing <|im_end|>. The template
writes an assistant turn as

    <think>\\n{reasoning}\\n</think>\\n\\n{content}[\\n]<tool_call>\\n{json}\\n</tool_call>[\\n<tool_call>...]

and the rules below undo exactly that, so a parsed reply rendered back through the template gives the text:
  - reasoning: with `thinking_open` (the prompt ended with `<think>\\n`) it runs from the start to the first
    `</think>`; otherwise a `<think>...</think>` block at the head (after newlines) is it, leading and trailing
    newlines dropped. No think block -> None; an unclosed one runs to the end of the reply.
  - content: the rest with its leading newlines dropped and every tool-call block taken out, with ONE '\\n'
    right before each block (the template's separator). Later think tags and a stray `</tool_call>` are content.
  - tool calls: the JSON object in each `<tool_call>...</tool_call>`, `{"name": str, "arguments": object or a
    JSON string of one}` (missing: `{}`); `arguments` as a JSON string (as OpenAI sends it): the model's text
    when that parses to the same object, else a fresh `json.dumps`.
  - a malformed block (not JSON, no name, arguments not an object, unclosed at the end) is an error and NOT
    content: text inside tool-call tags is never shown as prose.
Call ids are `{id_prefix}{index}`, index counting this reply's well-formed calls from 0 (default `call_0`, ...;
a server wanting ids unique across replies passes its own prefix)."""
from __future__ import annotations

import json
from contextlib import suppress
from dataclasses import dataclass, field

from nanoforge.core import safejson

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Reply:
    """A parsed reply: `tool_calls` in OpenAI's shape, `errors` one message per malformed tool-call block."""
    reasoning: str | None
    content: str
    tool_calls: list = field(default_factory=list)
    errors: list = field(default_factory=list)


def parse_reply(text: str, thinking_open: bool, id_prefix: str = "call_") -> Reply:
    """The whole reply `text` parsed (rules in the module docstring)."""
    parser = StreamParser(thinking_open, id_prefix)
    events = parser.feed(text) + parser.close()
    return reply_from_events(events, parser.saw_think)


def reply_from_events(events: list, saw_think: bool) -> Reply:
    """A `Reply` from a stream's events; `saw_think` is the parser's, after close()."""
    reply = Reply(reasoning="" if saw_think else None, content="")
    for kind, value in events:
        if kind == "reasoning":
            reply.reasoning += value
        elif kind == "content":
            reply.content += value
        elif kind == "tool_call":
            reply.tool_calls.append({"id": value["id"], "type": "function",
                                     "function": {"name": value["name"], "arguments": value["arguments"]}})
        else:
            reply.errors.append(value)
    return reply


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (what may yet become it)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class StreamParser:
    """Incremental `parse_reply`: feed(piece) and close() return events, in order:
    ("reasoning", text), ("content", text), ("tool_call", {"index", "id", "name", "arguments"}),
    ("error", message). Text that may still turn into a tag (or a separator the tag would remove) is held
    back until it is known; whatever the splitting, the events' texts join to the whole-text parse."""

    def __init__(self, thinking_open: bool, id_prefix: str = "call_"):
        self.id_prefix, self.state = id_prefix, "reasoning" if thinking_open else "head"
        self.saw_think = thinking_open
        self.started = False  # the current reasoning/content has passed its leading newlines
        self.buf, self.calls, self.blocks, self.closed = "", 0, 0, False  # blocks: tool-call blocks, good or not

    def feed(self, piece: str) -> list:
        if self.closed:
            raise ValueError("StreamParser.feed after close()")
        self.buf += piece
        events: list = []
        while self._step(events, final=False):
            pass
        return events

    def close(self) -> list:
        """The end of the reply: what was held back is released, an unclosed tool-call block is an error."""
        events: list = []
        if not self.closed:
            while self._step(events, final=True):
                pass
            self.closed = True
        return events

    # one step of the state machine: True when it changed state (and may go on), False when it must wait

    def _step(self, events: list, final: bool) -> bool:
        if self.state in ("reasoning", "content") and not self.started:
            stripped = self.buf.lstrip("\n")
            self.buf, self.started = stripped, bool(stripped)
            if not self.started:
                return False
        return getattr(self, "_step_" + self.state)(events, final)

    def _step_head(self, events: list, final: bool) -> bool:
        self.buf = self.buf.lstrip("\n")
        if self.buf.startswith(THINK_OPEN):
            self.buf = self.buf[len(THINK_OPEN):]
            self.state, self.saw_think, self.started = "reasoning", True, False
            return True
        if THINK_OPEN.startswith(self.buf) and not final:  # nothing yet, or what may still become <think>
            return False
        self.state, self.started = "content", True
        return True

    def _step_reasoning(self, events: list, final: bool) -> bool:
        end = self.buf.find(THINK_CLOSE)
        if end >= 0:
            self._emit(events, "reasoning", self.buf[:end].rstrip("\n"))
            self.buf = self.buf[end + len(THINK_CLOSE):]
            self.state, self.started = "content", False
            return True
        if final:
            self._emit(events, "reasoning", self.buf.rstrip("\n"))
            self.buf = ""
            return False
        keep = _partial_suffix(self.buf, THINK_CLOSE)
        ready = self.buf[:len(self.buf) - keep]
        keep += len(ready) - len(ready.rstrip("\n"))  # newlines right before `</think>` are dropped
        self._emit(events, "reasoning", self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _step_content(self, events: list, final: bool) -> bool:
        start = self.buf.find(CALL_OPEN)
        if start >= 0:
            before = self.buf[:start]
            self._emit(events, "content", before[:-1] if before.endswith("\n") else before)
            self.buf = self.buf[start + len(CALL_OPEN):]
            self.state = "call"
            return True
        keep = 0 if final else max(_partial_suffix(self.buf, "\n" + CALL_OPEN), _partial_suffix(self.buf, CALL_OPEN))
        self._emit(events, "content", self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _step_call(self, events: list, final: bool) -> bool:
        end = self.buf.find(CALL_CLOSE)
        if end < 0:
            if final:
                self.blocks += 1
                events.append(("error", f"tool call block {self.blocks - 1} is not closed with {CALL_CLOSE} "
                                        f"(the reply ended inside it): {self.buf.strip()[:80]!r}"))
                self.buf = ""
            return False
        body, self.buf = self.buf[:end], self.buf[end + len(CALL_CLOSE):]
        self.blocks += 1
        call, error = parse_call_body(body)
        if error:
            events.append(("error", f"tool call block {self.blocks - 1}: {error}"))
        else:
            events.append(("tool_call", {"index": self.calls, "id": f"{self.id_prefix}{self.calls}", **call}))
            self.calls += 1
        self.state = "content"
        return True

    @staticmethod
    def _emit(events: list, kind: str, text: str) -> None:
        if text:
            events.append((kind, text))


def parse_call_body(body: str) -> tuple[dict | None, str | None]:
    """The text between the tool-call tags -> ({"name", "arguments" (a JSON string)}, None) or (None, error)."""
    body = body.strip()
    call, bad = _json_value(body)
    if bad:
        return None, f"not valid JSON ({bad.msg} at character {bad.pos}): {body[:80]!r}"
    if not isinstance(call, dict):
        return None, f"must be a JSON object with a name and arguments, got {body[:80]!r}"
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return None, f"has no string 'name': {body[:80]!r}"
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        parsed, bad = _json_value(arguments)
        if bad:
            return None, f"'arguments' of {name!r} is a string but not JSON ({bad.msg}): {arguments[:80]!r}"
        if not isinstance(parsed, dict):
            return None, f"'arguments' of {name!r} must be a JSON object, got {arguments[:80]!r}"
        return {"name": name, "arguments": arguments}, None
    if not isinstance(arguments, dict):
        return None, f"'arguments' of {name!r} must be an object, got {json.dumps(arguments)[:80]}"
    return {"name": name, "arguments": _arguments_text(body, name, arguments)}, None


def _json_value(text: str) -> tuple[object, json.JSONDecodeError | None]:
    """(the JSON value of `text`, None), or (None, the decode error) where it is not JSON."""
    try:
        return safejson.loads(text), None
    except json.JSONDecodeError as e:
        return None, e


def _arguments_text(body: str, name: str, arguments: dict) -> str:
    """The arguments as the model wrote them when the block has the template's layout, else json.dumps."""
    head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
    if body.startswith(head) and body.endswith("}"):
        raw = body[len(head):-1]
        with suppress(json.JSONDecodeError):
            if safejson.loads(raw) == arguments:
                return raw
    return json.dumps(arguments, ensure_ascii=False)
