"""The OpenAI wire format of `nanoforge serve`, without FastAPI: errors, the fields every generation request
shares (sampling, n, logit_bias, streaming), usage and what every stream's chunks share. Each endpoint's own
fields and replies are read and written beside it: `/v1/completions` by serve/completions.py, chat by
serve/chat_request.py and serve/chat_reply.py, log-probs by serve/logprobs.py.

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
    """A checked generation request: the prompts' ids, how to sample, and how to answer.

    prompt_ids   the (first) prompt; `prompts` all of them (several on /v1/completions), default [prompt_ids]
    structured   the reply is in the thinking/tool-call format (a template with tool support wrote the
                 prompt), so it is parsed into reasoning, content and tool calls; else it is plain text
    thinking_open the prompt ends inside an open think block (the reply starts with reasoning)
    tools_offered the prompt offered tools (tool_choice "auto"): only then do tool calls come back
    n            samples per prompt: choice k is sample k % n of prompt k // n
    top_logprobs None: no log-probs; else log-probs with that many most likely tokens per position
    echo         /v1/completions' echo: the prompt's text (prompt_texts) and, with log-probs, its tokens' too
    score_only   max_tokens 0 with echo: the one token generated is dropped, only the prompt is scored
    ignore_eos   vLLM's extension: no stop token ends the reply (max_tokens does; for benchmarks)"""
    prompt_ids: list[int]
    cfg: SamplingConfig
    stream: bool
    include_usage: bool
    structured: bool = False
    thinking_open: bool = False
    tools_offered: bool = False
    prompts: list[list[int]] | None = None
    n: int = 1
    logit_bias: dict[int, float] | None = None
    top_logprobs: int | None = None
    echo: bool = False
    prompt_texts: list[str] | None = None
    score_only: bool = False
    ignore_eos: bool = False

    def __post_init__(self):
        if self.prompts is None:
            self.prompts = [self.prompt_ids]

    @property
    def prompt_logprobs(self) -> bool:
        return self.echo and self.top_logprobs is not None


class Limits:
    """What the server accepts, derived from the model: the context length, the max_tokens cap, the vocabulary
    (token ids and logit_bias keys) and the engine's slots (n)."""

    def __init__(self, context: int, max_tokens_cap: int | None, defaults: SamplingConfig, vocab: int | None = None,
                 max_batch: int = 32):
        self.context, self.defaults, self.vocab, self.max_batch = context, defaults, vocab, max_batch
        self.max_tokens_cap = min(max_tokens_cap or context, context)


@dataclass
class Shared:
    """The fields both endpoints read (sampling(); max_tokens as asked: a 0 generates 1 token in `cfg`)."""
    cfg: SamplingConfig
    stream: bool
    include_usage: bool
    n: int
    logit_bias: dict[int, float] | None
    max_tokens: int
    ignore_eos: bool = False


SHARED_FIELDS = frozenset({"ignore_eos", "model", "temperature", "top_p", "top_k", "repetition_penalty", "max_tokens",
                           "max_completion_tokens", "seed", "n", "presence_penalty", "frequency_penalty", "stop",
                           "stream", "stream_options", "logit_bias", "logprobs", "user"})
STREAM_OPTIONS = ("include_usage", "include_obfuscation")  # the second accepted, nothing to pad on this server


def check_known(body: dict, known: frozenset, refused: dict[str, str]) -> None:
    """400 for a field this endpoint does not know (a typo, or one of OpenAI's it cannot honour) or a refused
    one set (to anything but null or empty): never silently ignored."""
    for name, value in body.items():
        if name in refused and value not in (None, "", [], {}):
            raise bad_request(f"{name} is not supported by this server: {refused[name]}", param=name)
        if name not in known and name not in refused:
            raise bad_request(f"unknown field {json.dumps(name)[:60]}: this server refuses fields it does not "
                              f"support rather than ignoring them (docs/serving.md lists them)", param=name)


def sampling(body: dict, limits: Limits, min_tokens: int = 1) -> Shared:
    """The fields shared by both endpoints (SHARED_FIELDS but logprobs, each endpoint's own)."""
    d = limits.defaults
    temperature = number(body, "temperature", d.temperature, 0.0, 2.0)
    top_p = number(body, "top_p", d.top_p, 0.0, 1.0, low_open=True)
    top_k = integer(body, "top_k", d.top_k, 0, 1_000_000)
    repetition_penalty = number(body, "repetition_penalty", d.repetition_penalty, 0.0, 10.0, low_open=True)
    max_tokens = max_tokens_of(body, limits, min_tokens)
    seed = integer(body, "seed", None, 0, 2**63 - 1)
    n = integer(body, "n", 1, 1, limits.max_batch, " (the server's --max-batch, samples generated together)")
    for name in ("presence_penalty", "frequency_penalty"):
        if number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise bad_request(f"{name} is not supported; use repetition_penalty (> 1 discourages repeats)", param=name)
    field(body, "user", (str,), "a string")
    stream = field(body, "stream", (bool,), "a boolean", False)
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                         max_new_tokens=max(max_tokens, 1), stop_strings=stop_strings(body), seed=seed)
    return Shared(cfg, stream, include_usage(body), n, logit_bias(body, limits.vocab), max_tokens,
                  field(body, "ignore_eos", (bool,), "a boolean", False))


def max_tokens_of(body: dict, limits: Limits, low: int) -> int:
    """max_tokens, or its newer name max_completion_tokens, else the default (within the cap)."""
    cap, cap_hint = limits.max_tokens_cap, f" (the cap for this model, whose context is {limits.context} tokens)"
    for name in ("max_tokens", "max_completion_tokens"):
        value = integer(body, name, None, low, cap, cap_hint)
        if value is not None:
            return value
    return min(limits.defaults.max_new_tokens, cap)


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")  # absent or null: none; a string: that one
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise bad_request("stop must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop")
    for s in stop:
        check_unicode(s, "stop")
    return stop


def include_usage(body: dict) -> bool:
    options = field(body, "stream_options", (dict,), "an object", {})
    for key in options:
        if key not in STREAM_OPTIONS:
            raise bad_request(f"stream_options.{key} is not known; the options are {', '.join(STREAM_OPTIONS)}",
                              param=f"stream_options.{key}")
    field(options, "include_obfuscation", (bool,), "a boolean")
    return field(options, "include_usage", (bool,), "a boolean", False)


def logit_bias(body: dict, vocab: int | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias from -100 to 100}, added to that token's logit before sampling."""
    bias = field(body, "logit_bias", (dict,), "an object of {\"token id\": bias from -100 to 100}")
    out = {}
    for key, value in (bias or {}).items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise bad_request(f"logit_bias key {json.dumps(key)[:40]} is not a token id (a decimal integer as a "
                              f"string)", param="logit_bias")
        if vocab is not None and int(key) >= vocab:
            raise bad_request(f"logit_bias key {key} is not a token id of this model, whose vocabulary is {vocab} "
                              f"tokens", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"logit_bias[{key}] must be a number from -100 to 100, got {json.dumps(value)[:40]}",
                              param="logit_bias")
        out[int(key)] = float(value)
    return out or None


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


# -------------------------------------------------------------------------------------------------- replies

def usage(req: GenerationRequest, choices: list[Completion]) -> dict:
    """Each prompt's tokens once (however many samples it has), every choice's generated tokens."""
    n_prompt = sum(len(prompt) for prompt in req.prompts)
    n_completion = 0 if req.score_only else sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode("utf-8")


class Chunks:
    """One streamed reply's chunks, written by an endpoint's subclass (completions.TextChunks,
    chat_reply.ChatChunks): `first()`, `feed(piece)` for each worker.Piece, `end(choice)` for each
    worker.Choice, then `usage_chunk(usage)` when asked; `warnings()` for the server's log."""
    object = ""

    def __init__(self, model_name: str, reply_id: str, now: int):
        self.model_name, self.reply_id, self.now = model_name, reply_id, now

    def envelope(self, choices: list[dict]) -> dict:
        return {"id": self.reply_id, "object": self.object, "created": self.now, "model": self.model_name,
                "choices": choices}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self.envelope([]), "usage": usage}

    def warnings(self) -> list[str]:
        return []
