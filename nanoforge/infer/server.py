"""`nanoforge serve RUN`: an OpenAI-compatible HTTP API for a trained run, and a web chat page at `/`.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions` (both streaming by
server-sent events when `"stream": true`), `GET /health`, and the page at `GET /`. The official `openai`
clients work against it with `base_url="http://127.0.0.1:8000/v1"`.

Every error is JSON in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with a 4xx status
for anything the request got wrong (bad JSON, wrong types, unknown role, a prompt longer than the context,
a body over `max_body_bytes`, `max_tokens` over the cap, a missing or wrong API key). A request is checked
completely before it is queued, so a bad one never reaches the model.

Concurrency: the model and its KV cache are not thread-safe, so requests are *queued*, not batched: one
worker thread (a single-worker executor, FIFO) generates one reply at a time. The event loop only parses
requests and relays text: a streaming reply's pieces are handed from the worker to the loop through an
asyncio queue (`loop.call_soon_threadsafe`), so `/health` and new requests are answered while a reply is being
generated. A client that disconnects mid-stream sets a flag the worker reads between tokens, which ends
that generation early and frees the worker for the next request. (Batching requests together would raise
throughput; `generate` supports batches, but interleaving streams of different lengths is left for later.)

Sampling defaults are those of `nanoforge chat` (temperature 0.7, top_p 0.9, plus the non-OpenAI fields
`top_k` 50 and `repetition_penalty` 1.1, which requests may also set): a small model loops without them.
"""
# No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations (`request: Request`)
# at runtime, and Request is imported inside create_app so that fastapi stays an optional dependency.
import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from nanoforge.errors import NanoforgeError
from nanoforge.infer import chat as chat_defaults
from nanoforge.infer.generate import Completion, SamplingConfig, stream_completion

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 1_000_000
DEFAULT_MAX_PENDING = 64  # requests waiting for the worker; more get a 503 rather than an ever-growing queue
DEFAULT_REQUEST_TIMEOUT = 300.0  # seconds from a request's arrival after which its generation is cut short
MAX_STOP_STRINGS = 4  # OpenAI's limit
ROLES = ("system", "user", "assistant")
PAGE = Path(__file__).with_name("static") / "chat.html"

log = logging.getLogger("nanoforge.serve")


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
class _Request:
    """A checked generation request: the prompt's ids, how to sample, and how to answer."""
    prompt_ids: list[int]
    cfg: SamplingConfig
    stream: bool
    include_usage: bool


class _Limits:
    """What the server accepts, derived from the model: the context length and the max_tokens cap."""

    def __init__(self, context: int, max_tokens_cap: int | None, defaults: SamplingConfig):
        self.context = context
        self.max_tokens_cap = min(max_tokens_cap or context, context)
        self.defaults = defaults


def _sampling(body: dict, limits: _Limits) -> tuple[SamplingConfig, bool, bool]:
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


def _check_fits(prompt_ids: list[int], limits: _Limits, param: str) -> None:
    if len(prompt_ids) >= limits.context:
        raise _bad(f"the prompt is {len(prompt_ids)} tokens, but this model's context is {limits.context} tokens "
                   f"including the reply; shorten it to under {limits.context} tokens",
                   param=param, code="context_length_exceeded")


def parse_chat_request(body: Any, tokenizer, limits: _Limits) -> _Request:
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
    return _Request(prompt_ids, cfg, stream, include_usage)


def parse_completion_request(body: Any, tokenizer, limits: _Limits) -> _Request:
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
    return _Request(prompt_ids, cfg, stream, include_usage)


# ----------------------------------------------------------------------------------------------------------
# generation: one at a time, on one worker thread


class _Cancelled(Exception):
    pass


def stream_reply(model, tokenizer, prompt_ids: list[int], cfg: SamplingConfig, stop_ids: list[int], precision: str,
                 cancelled: threading.Event | None = None,
                 deadline: float | None = None) -> Iterator[str | Completion]:
    """`generate.stream_completion`: text pieces, then one `Completion`. Abandoned (raising _Cancelled) once
    `cancelled` is set. Past `deadline` (a time.monotonic() value) the reply ends after the token in hand, with
    finish_reason "length", as if max_tokens had been reached."""
    def keep_going() -> bool:
        if cancelled is not None and cancelled.is_set():
            raise _Cancelled()
        return deadline is None or time.monotonic() < deadline

    return stream_completion(model, tokenizer, prompt_ids, cfg, stop_ids, precision, keep_going)


class _Worker:
    """The single generation thread and its queue: a one-worker executor runs jobs in arrival order."""

    def __init__(self, model, tokenizer, precision: str, max_pending: int,
                 request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT):
        self.model, self.tokenizer, self.precision = model, tokenizer, precision
        self.max_pending = max_pending
        self.request_timeout = request_timeout
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoforge-generate")
        self.live: set[threading.Event] = set()
        self._lock = threading.Lock()
        self._pending = 0  # jobs submitted and not yet finished, the running one included

    @property
    def pending(self) -> int:
        return self._pending

    def check_room(self) -> None:
        """503 when too many requests wait already. A soft bound: checked here, counted when submitted."""
        if self._pending >= self.max_pending:
            raise APIError(503, f"the server is busy: {self._pending} requests are already waiting; retry later",
                           code="server_busy", type="server_error")

    def _submit(self, fn: Callable):
        def job():
            try:
                return fn()
            finally:
                with self._lock:
                    self._pending -= 1

        with self._lock:
            self._pending += 1
        return asyncio.get_running_loop().run_in_executor(self.executor, job)

    def deadline(self) -> float | None:
        """When a request arriving now must stop generating: the timeout counts its wait in the queue too."""
        return time.monotonic() + self.request_timeout if self.request_timeout else None

    async def complete(self, req: _Request, stop_ids: list[int]) -> Completion:
        self.check_room()
        deadline = self.deadline()

        def job() -> Completion:  # stream_reply's last item is the Completion that complete() would give
            *_, done = stream_reply(self.model, self.tokenizer, req.prompt_ids, req.cfg, stop_ids, self.precision,
                                    deadline=deadline)
            return done

        return await self._submit(job)

    async def stream(self, req: _Request, stop_ids: list[int]):
        """Async iterator over the reply's text pieces, then its Completion. The worker thread hands each
        item to the event loop's queue; leaving the loop early (a client gone) stops the generation."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        deadline = self.deadline()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop has closed: the server is shutting down
                cancelled.set()

        def job() -> None:
            if cancelled.is_set():
                return  # the client left while the request waited its turn
            try:
                for item in stream_reply(self.model, self.tokenizer, req.prompt_ids, req.cfg, stop_ids,
                                         self.precision, cancelled, deadline):
                    put(item)
            except _Cancelled:
                pass
            except BaseException as e:  # handed to the loop, which reports it on the stream
                put(e)

        self.live.add(cancelled)
        self._submit(job)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Completion):
                    return
        finally:
            cancelled.set()
            self.live.discard(cancelled)

    def shutdown(self) -> None:
        for event in list(self.live):
            event.set()
        self.executor.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------------------------------------
# the app


def _usage(prompt_ids: list[int], completion: Completion) -> dict:
    n_prompt, n_completion = len(prompt_ids), len(completion.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode("utf-8")


def create_app(model, tokenizer, model_name: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_tokens_cap: int | None = None,
               max_pending: int = DEFAULT_MAX_PENDING, precision: str = "fp32",
               defaults: SamplingConfig | None = None, request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT):
    """The FastAPI app serving `model` under the name `model_name`.

    api_key         when set, every /v1 request needs `Authorization: Bearer <api_key>` (else 401)
    max_body_bytes  larger request bodies get 413 before they are read in full
    max_tokens_cap  the largest max_tokens accepted (default and upper bound: the model's context)
    max_pending     requests allowed to wait for the generation worker; more get 503
    defaults        sampling used for fields a request leaves out (default: `nanoforge chat`'s)
    request_timeout seconds from a request's arrival (queue wait included) after which its generation stops
                    at the next token with finish_reason "length", streaming or not (a 200 with the text so
                    far, never a 504: a stream's 200 is sent before generation starts); None or 0: no limit
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    if defaults is None:
        defaults = SamplingConfig(temperature=chat_defaults.DEFAULT_TEMPERATURE, top_k=chat_defaults.DEFAULT_TOP_K,
                                  top_p=chat_defaults.DEFAULT_TOP_P,
                                  repetition_penalty=chat_defaults.DEFAULT_REPETITION_PENALTY,
                                  max_new_tokens=chat_defaults.DEFAULT_MAX_NEW_TOKENS)
    limits = _Limits(model.model.rotary_emb.n_positions, max_tokens_cap, defaults)
    worker = _Worker(model, tokenizer, precision, max_pending, request_timeout)
    # <|im_start|> too: a model that opens a new turn has finished its own (as in `nanoforge chat`).
    chat_stop_ids = [t for t in (tokenizer.eos_id, tokenizer.im_end_id, tokenizer.im_start_id) if t is not None]
    text_stop_ids = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    page = PAGE.read_text(encoding="utf-8")
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.shutdown()  # stop replies in progress, so Ctrl-C does not wait for them to finish

    app = FastAPI(title="nanoforge", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.worker = worker

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, message, code=code).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
                                "with the key the server was started with", code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        """The body as JSON, refusing (413) one over max_body_bytes before reading past the limit."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(413, f"the request body is {declared} bytes; the limit is {max_body_bytes}",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise APIError(413, f"the request body is over the limit of {max_body_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks), parse_constant=_no_constants)
        except (UnicodeDecodeError, ValueError) as e:
            raise _bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:  # "[[[[..." a hundred thousand deep fits in the body limit
            raise _bad("the request body is nested too deeply", code="invalid_json") from None

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "nanoforge"}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "queued": worker.pending}

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request):
        check_key(request)
        if name != model_name:
            raise APIError(404, f"no model {name!r}; this server serves {model_name!r}", param="model",
                           code="model_not_found")
        return model_card()

    async def run(req: _Request, stop_ids: list[int], prefix: str, make_body: Callable, make_chunk: Callable):
        """Answer a checked request: a JSON body, or an event stream of chunks ending in [DONE]."""
        reply_id, now = f"{prefix}-{secrets.token_hex(12)}", int(time.time())
        if not req.stream:
            try:
                done = await worker.complete(req, stop_ids)
            except NanoforgeError as e:
                raise _bad(str(e)) from None
            return JSONResponse(make_body(reply_id, now, done, _usage(req.prompt_ids, done)))

        worker.check_room()  # a 503 has to come before the stream's 200

        async def events():
            yield _sse(make_chunk(reply_id, now, None, None, first=True))
            try:
                async for item in worker.stream(req, stop_ids):
                    if isinstance(item, Completion):
                        yield _sse(make_chunk(reply_id, now, None, item.finish_reason))
                        if req.include_usage:
                            yield _sse({**make_chunk(reply_id, now, None, None), "choices": [],
                                        "usage": _usage(req.prompt_ids, item)})
                    elif item:
                        yield _sse(make_chunk(reply_id, now, item, None))
            except Exception as e:  # the 200 is already sent: report it in the stream, as OpenAI does
                ours = isinstance(e, NanoforgeError)
                if not ours:
                    log.exception("generation failed")
                error = APIError(400 if ours else 500, str(e),
                                 type="invalid_request_error" if ours else "server_error")
                yield _sse(error.body())
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def chat_body(reply_id, now, done: Completion, usage):
        return {"id": reply_id, "object": "chat.completion", "created": now, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                             "logprobs": None, "finish_reason": done.finish_reason}],
                "usage": usage, "system_fingerprint": None}

    def chat_chunk(reply_id, now, text, finish_reason, first=False):
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"id": reply_id, "object": "chat.completion.chunk", "created": now, "model": model_name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
                "system_fingerprint": None}

    def text_body(reply_id, now, done: Completion, usage):
        return {"id": reply_id, "object": "text_completion", "created": now, "model": model_name,
                "choices": [{"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason}],
                "usage": usage}

    def text_chunk(reply_id, now, text, finish_reason, first=False):
        return {"id": reply_id, "object": "text_completion", "created": now, "model": model_name,
                "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        req = parse_chat_request(await read_json(request), tokenizer, limits)
        return await run(req, chat_stop_ids, "chatcmpl", chat_body, chat_chunk)

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        req = parse_completion_request(await read_json(request), tokenizer, limits)
        return await run(req, text_stop_ids, "cmpl", text_body, text_chunk)

    return app


# ----------------------------------------------------------------------------------------------------------
# running it


def _check_can_listen(host: str, port: int) -> None:
    """Bind (host, port) once, as uvicorn will, so a port in use or a host that is not this machine's is a
    clear error now instead of a log line after the model has loaded."""
    import errno
    import socket
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no obstacle
            sock.bind(address)
    except OSError as e:
        why = "is already in use; choose another --port" if e.errno == errno.EADDRINUSE else f"cannot be used: {e}"
        raise NanoforgeError(f"{host}:{port} {why}") from None


def run_server(run_dir, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None,
               device: str = "auto", precision: str = "auto", model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_tokens_cap: int | None = None,
               log_level: str = "info", request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
               max_pending: int = DEFAULT_MAX_PENDING) -> None:
    """`nanoforge serve RUN`: load the run's latest checkpoint and serve it with uvicorn until Ctrl-C.

    The model is named after the run directory unless `model_name` is given."""
    import sys

    import uvicorn

    from nanoforge.infer.chat import resolve_precision
    from nanoforge.loader import load_model
    from nanoforge.device import resolve_device

    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise NanoforgeError(f"--port {port} must be between 1 and 65535")
    _check_can_listen(host, port)  # before minutes of loading, and before saying "serving"
    target = resolve_device(device)
    precision = resolve_precision(precision, target)
    model, tokenizer, checkpoint = load_model(run_dir, device=target)
    name = model_name or Path(run_dir).resolve().name
    app = create_app(model, tokenizer, name, api_key=api_key, max_body_bytes=max_body_bytes,
                     max_tokens_cap=max_tokens_cap, precision=precision, request_timeout=request_timeout,
                     max_pending=max_pending)
    shown = f"[{host}]" if ":" in host else host
    print(f"loaded {checkpoint} ({model.num_params() / 1e6:.1f}M parameters) on {target}, {precision}",
          file=sys.stderr)
    print(f"serving {name!r}: web chat at http://{shown}:{port}/, OpenAI API at http://{shown}:{port}/v1"
          + (" (API key required)" if api_key else ""), file=sys.stderr)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"warning: listening on {host} without --api-key: anyone who can reach this machine can use the "
              f"model", file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def main(argv: list[str] | None = None) -> None:
    """`python -m nanoforge.infer.server RUN [--host H] [--port P] [--api-key KEY]` (the key may also come
    from the NANOFORGE_API_KEY environment variable, which, unlike an argument, `ps` does not show)."""
    import argparse
    import os
    import sys

    parser = argparse.ArgumentParser(prog="python -m nanoforge.infer.server", description=main.__doc__)
    parser.add_argument("run", metavar="RUN", help="run directory (its latest checkpoint) or a checkpoint directory")
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--api-key", default=os.environ.get("NANOFORGE_API_KEY") or None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="auto", choices=chat_defaults.PRECISION_CHOICES)
    parser.add_argument("--model-name")
    parser.add_argument("--max-tokens-cap", type=int)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                        help="seconds after which a reply is cut short with finish_reason 'length' (0: no limit)")
    parser.add_argument("--max-pending", type=int, default=DEFAULT_MAX_PENDING,
                        help="requests allowed to wait for the model; more are answered 503 server_busy")
    args = parser.parse_args(argv)
    try:
        run_server(args.run, host=args.host, port=args.port, api_key=args.api_key, device=args.device,
                   precision=args.precision, model_name=args.model_name, max_tokens_cap=args.max_tokens_cap,
                   log_level=args.log_level, request_timeout=args.request_timeout, max_pending=args.max_pending)
    except NanoforgeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
