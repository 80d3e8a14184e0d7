"""The replies of `/v1/chat/completions`: the generated text parsed (chat/replies.py, the one parser) into
OpenAI's assistant message, whole or as streamed chunks, which join to the same message.

The message: `content` (null when the reply is only tool calls), `reasoning_content` (only when there is
reasoning: DeepSeek's and vLLM's name, kept by the `openai` client as an extra field), `tool_calls` (ids
`call_<16 hex>_<index>`, unique across replies; `arguments` a JSON string). `finish_reason` is "tool_calls"
when the reply has calls and ended by itself ("length" stays "length": the client should know it was cut).

Streaming: the first chunk carries the role, each delta one of `reasoning_content`, `content` or `tool_calls`
(a call sent whole once its closing tag arrives), then a chunk with the finish reason. The parser holds back
text that may still become a tag, so no piece of `<think>` or `<tool_call>` ever reaches the content.

Dropped, and reported as warnings for the server's log: a malformed tool-call block (never shown as content),
and calls when the request offered no tools (none sent, or tool_choice "none"). A reply rendered by a template
without tool support (plain ChatML) is plain text: all of it is content."""
import secrets

from nanoforge.infer.generate import Completion
from nanoforge.serve.protocol import GenerationRequest
from nanoforge.chat.replies import StreamParser, parse_reply


def call_id_prefix() -> str:
    """A fresh prefix for one reply's call ids: `call_<16 hex>_`, the index follows."""
    return f"call_{secrets.token_hex(8)}_"


def finish_reason(reason: str, has_calls: bool) -> str:
    return "tool_calls" if has_calls and reason == "stop" else reason


def reply_message(text: str, req: GenerationRequest, id_prefix: str) -> tuple[dict, list[str]]:
    """The whole reply's text -> (the assistant message, warnings for the log)."""
    if not req.structured:
        return {"role": "assistant", "content": text}, []
    reply = parse_reply(text, req.thinking_open, id_prefix)
    calls = reply.tool_calls if req.tools_offered else []
    message = {"role": "assistant", "content": reply.content or (None if calls else "")}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if calls:
        message["tool_calls"] = calls
    return message, _warnings(reply.errors, len(reply.tool_calls) - len(calls))


def _warnings(errors: list[str], dropped: int) -> list[str]:
    notes = [f"dropped a malformed tool call ({e})" for e in errors]
    if dropped:
        notes.append(f"dropped {dropped} tool call(s) the model wrote though the request offered no tools")
    return notes


class ReplyDeltas:
    """A reply's text pieces -> the `delta` objects of its chunks (role excepted), in order."""

    def __init__(self, req: GenerationRequest, id_prefix: str):
        self.parser = StreamParser(req.thinking_open, id_prefix) if req.structured else None
        self.tools_offered = req.tools_offered
        self.calls, self.dropped = 0, 0
        self.errors: list[str] = []

    def feed(self, piece: str) -> list[dict]:
        if self.parser is None:
            return [{"content": piece}] if piece else []
        return self._deltas(self.parser.feed(piece))

    def close(self) -> list[dict]:
        return [] if self.parser is None else self._deltas(self.parser.close())

    def warnings(self) -> list[str]:
        return _warnings(self.errors, self.dropped)

    def _deltas(self, events: list) -> list[dict]:
        out = []
        for kind, value in events:
            if kind == "reasoning":
                out.append({"reasoning_content": value})
            elif kind == "content":
                out.append({"content": value})
            elif kind == "error":
                self.errors.append(value)
            elif not self.tools_offered:
                self.dropped += 1
            else:
                out.append({"tool_calls": [{"index": value["index"], "id": value["id"], "type": "function",
                                            "function": {"name": value["name"], "arguments": value["arguments"]}}]})
                self.calls += 1
        return out


def chat_body(model_name: str, reply_id: str, now: int, message: dict, finish: str, usage: dict) -> dict:
    return {"id": reply_id, "object": "chat.completion", "created": now, "model": model_name,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": usage, "system_fingerprint": None}


class ChatChunks:
    """One streamed reply's chunks: `first()`, `feed(piece)` for each piece, `end(done, usage)`."""

    def __init__(self, model_name: str, reply_id: str, now: int, req: GenerationRequest, id_prefix: str):
        self.model_name, self.reply_id, self.now = model_name, reply_id, now
        self.deltas = ReplyDeltas(req, id_prefix)

    def chunk(self, delta: dict, finish: str | None = None) -> dict:
        return {"id": self.reply_id, "object": "chat.completion.chunk", "created": self.now, "model": self.model_name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                "system_fingerprint": None}

    def first(self) -> dict:
        return self.chunk({"role": "assistant", "content": ""})

    def feed(self, piece: str) -> list[dict]:
        return [self.chunk(delta) for delta in self.deltas.feed(piece)]

    def end(self, done: Completion, usage: dict | None) -> list[dict]:
        """The held-back rest, the finish reason, and (when asked) a usage chunk with no choices."""
        out = [self.chunk(delta) for delta in self.deltas.close()]
        out.append(self.chunk({}, finish_reason(done.finish_reason, self.deltas.calls > 0)))
        if usage is not None:
            out.append({**self.chunk({}), "choices": [], "usage": usage})
        return out

    def warnings(self) -> list[str]:
        return self.deltas.warnings()
