"""The replies of `/v1/chat/completions`: the generated text parsed (chat/replies.py, the one parser) into
OpenAI's assistant message, whole or as streamed chunks, which join to the same message.

The message: `content` (null when the reply is only tool calls), `reasoning_content` (only when there is
reasoning: DeepSeek's and vLLM's name, kept by the `openai` client as an extra field), `tool_calls` (ids
`call_<16 hex>_<index>`, unique across replies; `arguments` a JSON string). `finish_reason` is "tool_calls"
when the reply has calls and ended by itself ("length" stays "length": the client should know it was cut).

Streaming: the first chunk of each choice carries the role, each delta one of `reasoning_content`, `content` or
`tool_calls` (a call sent whole once its closing tag arrives), then a chunk with the finish reason; every chunk
names its choice (`n` > 1: the choices' chunks interleave). The parser holds back text that may still become a
tag, so no piece of `<think>` or `<tool_call>` ever reaches the content.

Log-probs (`logprobs: true`, `top_logprobs` 0 to 20): `{"content": [...]}` in OpenAI's shape (serve/logprobs.py)
for every generated token of the reply, reasoning and tool-call text included (the stop token not); streamed,
each entry goes with the chunk of the piece whose text reaches it (a chunk with an empty delta when the parser
holds that text back).

Dropped, and reported as warnings for the server's log: a malformed tool-call block (never shown as content),
and calls when the request offered no tools (none sent, or tool_choice "none"). A reply rendered by a template
without tool support (plain ChatML) is plain text: all of it is content."""
import secrets

from nanoforge.chat.replies import StreamParser, parse_reply
from nanoforge.serve.logprobs import Entry, ReplyEntries, TokenText, chat_logprobs
from nanoforge.serve.protocol import Chunks, GenerationRequest
from nanoforge.serve.worker import Choice, Piece


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


def chat_choice(choice: Choice, req: GenerationRequest, text: TokenText) -> tuple[dict, list[str]]:
    """One whole choice of a reply, and warnings for the log."""
    message, warnings = reply_message(choice.text, req, call_id_prefix())
    logprobs = None
    if req.top_logprobs is not None:
        logprobs = chat_logprobs(ReplyEntries(text, 0, with_stop=False).end(choice), text)
    finish = finish_reason(choice.finish_reason, bool(message.get("tool_calls")))
    return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish}, warnings


def chat_body(model_name: str, reply_id: str, now: int, choices: list[dict], usage: dict) -> dict:
    return {"id": reply_id, "object": "chat.completion", "created": now, "model": model_name,
            "choices": choices, "usage": usage, "system_fingerprint": None}


class ChatChunks(Chunks):
    """One streamed chat reply's chunks (protocol.Chunks), each choice parsed by its own ReplyDeltas."""
    object = "chat.completion.chunk"

    def __init__(self, model_name: str, reply_id: str, now: int, req: GenerationRequest, text: TokenText):
        super().__init__(model_name, reply_id, now)
        self.req, self.text = req, text
        self.deltas = [ReplyDeltas(req, call_id_prefix()) for _ in range(req.n)]
        self.entries = [ReplyEntries(text, 0, with_stop=False) for _ in range(req.n)]

    def envelope(self, choices: list[dict]) -> dict:
        return {**super().envelope(choices), "system_fingerprint": None}

    def chunk(self, index: int, delta: dict, finish: str | None = None, entries: list[Entry] | None = None) -> dict:
        logprobs = chat_logprobs(entries, self.text) if entries else None
        return self.envelope([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

    def first(self) -> list[dict]:
        return [self.chunk(i, {"role": "assistant", "content": ""}) for i in range(self.req.n)]

    def feed(self, piece: Piece) -> list[dict]:
        entries = self.entries[piece.index].feed(piece) if self.req.top_logprobs is not None else []
        return self._chunks(piece.index, self.deltas[piece.index].feed(piece.text), entries)

    def end(self, choice: Choice) -> list[dict]:
        """The held-back rest and the finish reason."""
        i, deltas = choice.index, self.deltas[choice.index]
        entries = self.entries[i].end(choice) if self.req.top_logprobs is not None else []
        out = self._chunks(i, deltas.close(), entries)
        return out + [self.chunk(i, {}, finish_reason(choice.finish_reason, deltas.calls > 0))]

    def _chunks(self, index: int, deltas: list[dict], entries: list[Entry]) -> list[dict]:
        """A chunk per delta, the log-prob entries with the first (or alone, with an empty delta)."""
        if not deltas:
            return [self.chunk(index, {}, entries=entries)] if entries else []
        return [self.chunk(index, delta, entries=entries if k == 0 else None) for k, delta in enumerate(deltas)]

    def warnings(self) -> list[str]:
        return [w for deltas in self.deltas for w in deltas.warnings()]
