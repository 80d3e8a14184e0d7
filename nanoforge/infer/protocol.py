"""The OpenAI wire format of `nanoforge serve`, without FastAPI: reading and checking request bodies of
`/v1/chat/completions` and `/v1/completions`, and the JSON of replies and of streamed chunks.

Every error is JSON in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with a 4xx status
for anything the request got wrong (bad JSON, wrong types, unknown role, a prompt longer than the context,
a body over `max_body_bytes`, `max_tokens` over the cap, a missing or wrong API key). A request is checked
completely before it is queued, so a bad one never reaches the model.
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any

from nanoforge.errors import NanoforgeError
from nanoforge.infer.generate import Completion, SamplingConfig

MAX_STOP_STRINGS = 4  # OpenAI's limit
ROLES = ("system", "user", "assistant")

# ----------------------------------------------------------------------------------------------------------
# errors in OpenAI's shape


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
        return json.loads(data, parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # "[[[[..." a hundred thousand deep fits in the body limit
        raise _bad("the request body is nested too deeply", code="invalid_json") from None


def check_api_key(authorization: str, api_key: str | None) -> None:
    """401 unless the Authorization header is `Bearer <api_key>` (nothing is asked when api_key is None)."""
    if api_key is None:
        return
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
                            "with the key the server was started with", code="invalid_api_key")


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# ----------------------------------------------------------------------------------------------------------
# reading and checking requests


def _field(body: dict, name: str, kinds: tuple, what: str, default=None):
    """body[name] if it has one of `kinds` (absent or null: `default`); bools are never numbers."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise _bad(f"{name} must be {what}, got {json.dumps(value)[:60]}", param=name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = _field(body, name, (int, float), "a number", default)
    if value < low or (low_open and value == low) or value > high:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise _bad(f"{name}={value} must be in {interval}", param=name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int, hint: str = "") -> int | None:
    value = _field(body, name, (int,), "an integer", default)
    if value is not None and not low <= value <= high:
        raise _bad(f"{name}={value} must be between {low} and {high}{hint}", param=name)
    return value


@dataclass
class GenerationRequest:
    """A checked generation request: the prompt's ids, how to sample, and how to answer."""
    prompt_ids: list[int]
    cfg: SamplingConfig
    stream: bool
    include_usage: bool


class Limits:
    """What the server accepts, derived from the model: the context length and the max_tokens cap."""

    def __init__(self, context: int, max_tokens_cap: int | None, defaults: SamplingConfig):
        self.context = context
        self.max_tokens_cap = min(max_tokens_cap or context, context)
        self.defaults = defaults


def _sampling(body: dict, limits: Limits) -> tuple[SamplingConfig, bool, bool]:
    """The sampling fields shared by both endpoints -> (config, stream, include_usage)."""
    d = limits.defaults
    temperature = _number(body, "temperature", d.temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", d.top_p, 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", d.top_k, 0, 1_000_000)
    repetition_penalty = _number(body, "repetition_penalty", d.repetition_penalty, 0.0, 10.0, low_open=True)
    cap_hint = f" (the cap for this model, whose context is {limits.context} tokens)"
    max_tokens = _integer(body, "max_tokens", None, 1, limits.max_tokens_cap, cap_hint)
    if max_tokens is None:  # the newer name for the same thing
        max_tokens = _integer(body, "max_completion_tokens", None, 1, limits.max_tokens_cap, cap_hint)
    if max_tokens is None:
        max_tokens = min(d.max_new_tokens, limits.max_tokens_cap)
    seed = _integer(body, "seed", None, 0, 2**63 - 1)
    _integer(body, "n", 1, 1, 1, " (this server returns one choice per request)")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise _bad(f"{name} is not supported; use repetition_penalty (> 1 discourages repeats)", param=name)
    if _field(body, "logprobs", (bool, int), "a boolean", False):
        raise _bad("logprobs are not supported by this server", param="logprobs")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop")
    stream = _field(body, "stream", (bool,), "a boolean", False)
    options = _field(body, "stream_options", (dict,), "an object", {})
    include_usage = _field(options, "include_usage", (bool,), "a boolean", False)
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                         max_new_tokens=max_tokens, stop_strings=stop, seed=seed)
    return cfg, stream, include_usage


def _unicode(text: str, param: str) -> str:
    """JSON's \\ud800 escapes give lone surrogates, which are not Unicode text and which the tokenizer
    cannot encode (a TypeError deep inside it, which would be a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"{param} contains a lone surrogate (\\ud800-\\udfff), which is not valid Unicode",
                   param=param) from None
    return text


def _message_content(message: dict, i: int) -> str:
    return _unicode(_message_text(message, i), f"messages[{i}].content")


def _message_text(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts; text is all a language model can read
        if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        raise _bad(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
                   param=f"messages[{i}].content")
    if not isinstance(content, str):
        raise _bad(f"messages[{i}].content must be a string, got {json.dumps(content)[:60]}",
                   param=f"messages[{i}].content")
    return content


def _chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages is required: a list of {role, content} objects", param="messages")
    if not isinstance(messages, list):
        raise _bad("messages must be a list of {role, content} objects", param="messages")
    if not messages:
        raise _bad("messages is empty; send at least one message", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object with role and content", param=f"messages[{i}]")
        role = message.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise _bad(f"messages[{i}].role {json.dumps(role)[:40]} is not one of {', '.join(ROLES)}",
                       param=f"messages[{i}].role")
        out.append({"role": role, "content": _message_content(message, i)})
    return out


def _check_fits(prompt_ids: list[int], limits: Limits, param: str) -> None:
    if len(prompt_ids) >= limits.context:
        raise _bad(f"the prompt is {len(prompt_ids)} tokens, but this model's context is {limits.context} tokens "
                   f"including the reply; shorten it to under {limits.context} tokens",
                   param=param, code="context_length_exceeded")


def parse_chat_request(body: Any, tokenizer, limits: Limits) -> GenerationRequest:
    """A /v1/chat/completions body -> a checked request (APIError when it is not one)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    _field(body, "model", (str,), "a string")
    messages = _chat_messages(body)
    cfg, stream, include_usage = _sampling(body, limits)
    try:
        prompt_ids, _ = tokenizer.render_chat(messages, add_generation_prompt=True)
    except NanoforgeError as e:
        raise _bad(str(e), param="messages") from None
    _check_fits(prompt_ids, limits, "messages")
    return GenerationRequest(prompt_ids, cfg, stream, include_usage)


def parse_completion_request(body: Any, tokenizer, limits: Limits) -> GenerationRequest:
    """A /v1/completions body (a raw prompt to continue) -> a checked request."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    _field(body, "model", (str,), "a string")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad("prompt is required and must be a string (or a list of one string)", param="prompt")
    _unicode(prompt, "prompt")
    if body.get("echo") or body.get("suffix"):
        raise _bad("echo and suffix are not supported by this server", param="echo" if body.get("echo") else "suffix")
    cfg, stream, include_usage = _sampling(body, limits)
    # An empty prompt continues from a document boundary, as GPT-2 did from <|endoftext|>.
    prompt_ids = tokenizer.encode(prompt) if prompt else [tokenizer.eos_id if tokenizer.eos_id is not None else 0]
    _check_fits(prompt_ids, limits, "prompt")
    return GenerationRequest(prompt_ids, cfg, stream, include_usage)


# ----------------------------------------------------------------------------------------------------------
# replies


def usage(prompt_ids: list[int], completion: Completion) -> dict:
    n_prompt, n_completion = len(prompt_ids), len(completion.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode("utf-8")


def chat_body(model_name: str, reply_id: str, now: int, done: Completion, usage: dict) -> dict:
    return {"id": reply_id, "object": "chat.completion", "created": now, "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                         "logprobs": None, "finish_reason": done.finish_reason}],
            "usage": usage, "system_fingerprint": None}


def chat_chunk(model_name: str, reply_id: str, now: int, text, finish_reason, first: bool = False) -> dict:
    delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
    return {"id": reply_id, "object": "chat.completion.chunk", "created": now, "model": model_name,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
            "system_fingerprint": None}


def text_body(model_name: str, reply_id: str, now: int, done: Completion, usage: dict) -> dict:
    return {"id": reply_id, "object": "text_completion", "created": now, "model": model_name,
            "choices": [{"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason}],
            "usage": usage}


def text_chunk(model_name: str, reply_id: str, now: int, text, finish_reason, first: bool = False) -> dict:
    return {"id": reply_id, "object": "text_completion", "created": now, "model": model_name,
            "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]}
