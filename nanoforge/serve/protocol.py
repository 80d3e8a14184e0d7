"""The OpenAI wire format of `nanoforge serve`, without FastAPI: errors, the fields every generation request
shares (sampling, streaming), `/v1/completions` requests and replies. The chat endpoint's messages, tools and
template switches are read by serve/chat_request.py, its replies written by serve/chat_reply.py.

Every error is JSON in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with a 4xx status
for anything the request got wrong (bad JSON, wrong types, unknown role, a prompt longer than the context,
a body over `max_body_bytes`, `max_tokens` over the cap, a missing or wrong API key). A request is checked
completely before it is queued, so a bad one never reaches the model."""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any

from nanoforge.core import safejson
from nanoforge.infer.generate import Completion, SamplingConfig

MAX_STOP_STRINGS = 4  # OpenAI's limit

# --------------------------------------------------------------------------------- errors in OpenAI's shape

class APIError(Exception):
    """A request the server refuses, answered as `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _no_constants(name: str):
    """Python's json reads NaN and Infinity, which JSON does not have; a NaN temperature would pass every
    range check (all comparisons with NaN are false) and break sampling."""
    raise ValueError(f"{name} is not a JSON value")


def parse_json(data: bytes) -> Any:
    """A request body (already read within the size limit) as JSON, or a 400 invalid_json."""
    try:
        return safejson.loads(data, parse_constant=_no_constants)  # depth and number size limited
    except (UnicodeDecodeError, ValueError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None


def check_api_key(authorization: str, api_key: str | None) -> None:
    """401 unless the Authorization header is `Bearer <api_key>` (nothing is asked when api_key is None)."""
    if api_key is None:
        return
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
                            "with the key the server was started with", code="invalid_api_key")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# ---------------------------------------------------------------------------- reading and checking requests

def field(body: dict, name: str, kinds: tuple, what: str, default=None):
    """body[name] if it has one of `kinds` (absent or null: `default`); bools are never numbers."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad_request(f"{name} must be {what}, got {json.dumps(value)[:60]}", param=name)
    return value


def number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = field(body, name, (int, float), "a number", default)
    if value < low or (low_open and value == low) or value > high:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise bad_request(f"{name}={value} must be in {interval}", param=name)
    return float(value)


def integer(body: dict, name: str, default: int | None, low: int, high: int, hint: str = "") -> int | None:
    value = field(body, name, (int,), "an integer", default)
    if value is not None and not low <= value <= high:
        raise bad_request(f"{name}={value} must be between {low} and {high}{hint}", param=name)
    return value


@dataclass
class GenerationRequest:
    """A checked generation request: the prompt's ids, how to sample, and how to answer.

    structured   the reply is in the thinking/tool-call format (a template with tool support wrote the
                 prompt), so it is parsed into reasoning, content and tool calls; else it is plain text
    thinking_open the prompt ends inside an open think block (the reply starts with reasoning)
    tools_offered the prompt offered tools (tool_choice "auto"): only then do tool calls come back"""
    prompt_ids: list[int]
    cfg: SamplingConfig
    stream: bool
    include_usage: bool
    structured: bool = False
    thinking_open: bool = False
    tools_offered: bool = False


class Limits:
    """What the server accepts, derived from the model: the context length and the max_tokens cap."""

    def __init__(self, context: int, max_tokens_cap: int | None, defaults: SamplingConfig):
        self.context, self.defaults = context, defaults
        self.max_tokens_cap = min(max_tokens_cap or context, context)


def sampling(body: dict, limits: Limits) -> tuple[SamplingConfig, bool, bool]:
    """The sampling fields shared by both endpoints -> (config, stream, include_usage)."""
    d = limits.defaults
    temperature = number(body, "temperature", d.temperature, 0.0, 2.0)
    top_p = number(body, "top_p", d.top_p, 0.0, 1.0, low_open=True)
    top_k = integer(body, "top_k", d.top_k, 0, 1_000_000)
    repetition_penalty = number(body, "repetition_penalty", d.repetition_penalty, 0.0, 10.0, low_open=True)
    cap, cap_hint = limits.max_tokens_cap, f" (the cap for this model, whose context is {limits.context} tokens)"
    max_tokens = (integer(body, "max_tokens", None, 1, cap, cap_hint)  # or its newer name, else the default
                  or integer(body, "max_completion_tokens", None, 1, cap, cap_hint) or min(d.max_new_tokens, cap))
    seed = integer(body, "seed", None, 0, 2**63 - 1)
    integer(body, "n", 1, 1, 1, " (this server returns one choice per request)")
    for name in ("presence_penalty", "frequency_penalty"):
        if number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise bad_request(f"{name} is not supported; use repetition_penalty (> 1 discourages repeats)", param=name)
    if field(body, "logprobs", (bool, int), "a boolean", False):
        raise bad_request("logprobs are not supported by this server", param="logprobs")
    stop = body.get("stop")  # absent or null: none; a string: that one
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise bad_request("stop must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop")
    stream = field(body, "stream", (bool,), "a boolean", False)
    options = field(body, "stream_options", (dict,), "an object", {})
    include_usage = field(options, "include_usage", (bool,), "a boolean", False)
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                          max_new_tokens=max_tokens, stop_strings=stop, seed=seed), stream, include_usage


def check_unicode(text: str, param: str) -> str:
    """JSON's \\ud800 escapes give lone surrogates, which are not Unicode text and which the tokenizer
    cannot encode (a TypeError deep inside it, which would be a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param} contains a lone surrogate (\\ud800-\\udfff), which is not valid Unicode",
                   param=param) from None
    return text


def check_fits(prompt_ids: list[int], limits: Limits, param: str) -> None:
    if len(prompt_ids) >= limits.context:
        raise bad_request(f"the prompt is {len(prompt_ids)} tokens, but this model's context is {limits.context} "
                          f"tokens including the reply; shorten it to under {limits.context} tokens",
                          param=param, code="context_length_exceeded")


def parse_completion_request(body: Any, tokenizer, limits: Limits) -> GenerationRequest:
    """A /v1/completions body (a raw prompt to continue) -> a checked request."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    field(body, "model", (str,), "a string")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("prompt is required and must be a string (or a list of one string)", param="prompt")
    check_unicode(prompt, "prompt")
    if body.get("echo") or body.get("suffix"):
        raise bad_request("echo and suffix are not supported by this server",
                          param="echo" if body.get("echo") else "suffix")
    cfg, stream, include_usage = sampling(body, limits)
    # An empty prompt continues from a document boundary, as GPT-2 did from <|endoftext|>.
    prompt_ids = tokenizer.encode(prompt) if prompt else [tokenizer.eos_id if tokenizer.eos_id is not None else 0]
    check_fits(prompt_ids, limits, "prompt")
    return GenerationRequest(prompt_ids, cfg, stream, include_usage)


# -------------------------------------------------------------------------------------------------- replies

def usage(prompt_ids: list[int], completion: Completion) -> dict:
    n_prompt, n_completion = len(prompt_ids), len(completion.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode("utf-8")


def text_body(model_name: str, reply_id: str, now: int, done: Completion, usage: dict) -> dict:
    return {"id": reply_id, "object": "text_completion", "created": now, "model": model_name,
            "choices": [{"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason}],
            "usage": usage}


class TextChunks:
    """One streamed /v1/completions reply's chunks (as infer/chat_reply.ChatChunks for chat): `first()`,
    `feed(piece)` for each piece, `end(done, usage)`."""

    def __init__(self, model_name: str, reply_id: str, now: int):
        self.model_name, self.reply_id, self.now = model_name, reply_id, now

    def chunk(self, text: str, finish: str | None = None) -> dict:
        return {"id": self.reply_id, "object": "text_completion", "created": self.now, "model": self.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

    def first(self) -> dict:
        return self.chunk("")

    def feed(self, piece: str) -> list[dict]:
        return [self.chunk(piece)] if piece else []

    def end(self, done: Completion, usage: dict | None) -> list[dict]:
        out = [self.chunk("", done.finish_reason)]
        if usage is not None:
            out.append({**self.chunk(""), "choices": [], "usage": usage})
        return out

    def warnings(self) -> list[str]:
        return []
