"""`nanoforge serve RUN`: an OpenAI-compatible HTTP API for a trained run, and a web chat page at `/`.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions` (both streaming by
server-sent events when `"stream": true`), `GET /health`, and the page at `GET /`. The official `openai`
clients work against it with `base_url="http://127.0.0.1:8000/v1"`. Chat takes OpenAI's `tools` and
`tool_choice`, tool messages and `chat_template_kwargs: {"enable_thinking": true}`, and answers with
`reasoning_content` and `tool_calls` (serve/chat_request.py, serve/chat_reply.py); completions take several
prompts, token ids and `echo` (serve/completions.py); both take `n`, `logit_bias` and log-probs
(serve/logprobs.py), and refuse with a 400 naming it every field they do not support (the fields both share are
serve/protocol.py's; docs/serving.md lists them all). For the web page, which cannot run Python,
`GET /v1/nanoforge/tools` lists the built-in tools and `POST /v1/nanoforge/tools/run` runs one. Every error is
JSON in OpenAI's shape, 4xx for a bad request.

Concurrency: requests are batched. One generation thread (serve/worker.py) steps the engine, which decodes every
running request together and admits new ones as slots free up (`--max-batch`); the event loop only parses,
answers and streams, so `/health` and new requests are answered meanwhile. A client that disconnects mid-stream
or a request past its deadline frees its slot before the next step.

Sampling defaults are those of `nanoforge chat` (temperature 0.7, top_p 0.9, plus the non-OpenAI fields
`top_k` 50 and `repetition_penalty` 1.1, which requests may also set): a small model loops without them."""
# No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations (`request: Request`)
# at runtime. fastapi and uvicorn are the optional `serve` extra: only `nanoforge serve` imports this module.
import contextlib
import errno
import functools
import logging
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.options import CHAT_SAMPLING
from nanoforge.serve import protocol
from nanoforge.infer.load import load_for_inference
from nanoforge.serve.chat_reply import ChatChunks, chat_body, chat_choice
from nanoforge.serve.chat_request import parse_chat_request
from nanoforge.serve.completions import TextChunks, parse_completion_request, text_body
from nanoforge.serve.connections import Gate, GuardedProtocol, OutOfDescriptors, bind_listeners, connection_cap
from nanoforge.infer.generate import SamplingConfig
from nanoforge.serve.logprobs import TokenText
from nanoforge.serve.options import ServeOptions
from nanoforge.serve.protocol import APIError, Chunks, GenerationRequest, Limits
from nanoforge.serve.repeats import RepeatFilter
from nanoforge.serve.worker import Choice, Worker
from nanoforge.chat.calculator import BUILTIN_TOOLS, run_tool_call

DEFAULT_MAX_BODY_BYTES = 1_000_000
PAGE = Path(__file__).with_name("static") / "chat.html"
SERVER_LOGGERS = ["nanoforge.serve", "uvicorn.error", "asyncio"]  # each kind of record once per window, counted

log = logging.getLogger("nanoforge.serve")


# -------------------------------------------------------------------------------------------------- the app

def create_app(model, tokenizer, model_name: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_tokens_cap: int | None = None,
               max_pending: int = ServeOptions.max_pending, precision: str = "fp32",
               defaults: SamplingConfig | None = None, request_timeout: float | None = ServeOptions.request_timeout,
               max_batch: int = ServeOptions.max_batch, on_shutdown: Callable[[], None] | None = None):
    """The FastAPI app serving `model` under the name `model_name`.

    api_key         when set, every /v1 request needs `Authorization: Bearer <api_key>` (else 401)
    max_body_bytes  larger request bodies get 413 before they are read in full
    max_tokens_cap  the largest max_tokens accepted (default and upper bound: the model's context)
    max_pending     requests allowed in the server at once (generating or waiting for a slot); more get 503
    max_batch       sequences generated together (the engine's slots)
    defaults        sampling used for fields a request leaves out (default: `nanoforge chat`'s)
    request_timeout seconds from a request's arrival (queue wait included) after which its generation stops
                    at the next token with finish_reason "length", streaming or not (a 200 with the text so
                    far, never a 504: a stream's 200 is sent before generation starts); None or 0: no limit
    on_shutdown     called as the server stops, after the replies in progress are stopped"""
    defaults = defaults or CHAT_SAMPLING
    limits = Limits(model.context_length, max_tokens_cap, defaults, model.cfg.vocab_size, max_batch)
    worker = Worker(model, tokenizer, precision, max_pending, request_timeout, max_batch)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.shutdown()  # stop replies in progress, so Ctrl-C does not wait for them to finish
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="nanoforge", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.worker, app.state.model_name = worker, model_name
    _add_error_handlers(app)
    _add_model_routes(app, worker, model_name, api_key)
    _add_generation_routes(app, worker, tokenizer, limits, model_name, api_key, max_body_bytes)
    _add_tool_routes(app, api_key, max_body_bytes)
    return app


def _add_error_handlers(app) -> None:
    """Every error as JSON in OpenAI's shape: refusals with their status, unknown paths, and crashes (500)."""
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, message, code=code).body(), status_code=exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def _hung_up(request, exc: ClientDisconnect):
        return Response(status_code=400)  # nobody reads it; serve/connections.py logs the hang-up, once per kind

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(error.body(), status_code=500)


def _add_model_routes(app, worker: Worker, model_name: str, api_key: str | None) -> None:
    page = PAGE.read_text(encoding="utf-8")
    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "nanoforge"}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "queued": worker.pending}

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page)

    @app.get("/v1/models")
    async def models(request: Request):
        protocol.check_api_key(request.headers.get("authorization", ""), api_key)
        return {"object": "list", "data": [dict(card)]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request):
        protocol.check_api_key(request.headers.get("authorization", ""), api_key)
        if name != model_name:
            raise APIError(404, f"no model {name!r}; this server serves {model_name!r}", param="model",
                           code="model_not_found")
        return dict(card)


def _add_generation_routes(app, worker: Worker, tokenizer, limits: Limits, model_name: str,
                           api_key: str | None, max_body_bytes: int) -> None:
    stop_ids = tokenizer.stop_ids  # the chat format's rule, on /v1/completions too
    text = TokenText(tokenizer)  # how tokens are written in log-probs

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        protocol.check_api_key(request.headers.get("authorization", ""), api_key)
        req = parse_chat_request(await _read_json(request, max_body_bytes), tokenizer, limits)
        reply_id, now = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

        def body(choices: list[Choice]) -> dict:
            out = []
            for choice in choices:
                one, warnings = chat_choice(choice, req, text)
                _log_warnings(reply_id, warnings)
                out.append(one)
            return chat_body(model_name, reply_id, now, out, protocol.usage(req, choices))

        return await _answer(worker, req, stop_ids, reply_id, body,
                             lambda: ChatChunks(model_name, reply_id, now, req, text))

    @app.post("/v1/completions")
    async def completions(request: Request):
        protocol.check_api_key(request.headers.get("authorization", ""), api_key)
        req = parse_completion_request(await _read_json(request, max_body_bytes), tokenizer, limits)
        reply_id, now = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        return await _answer(worker, req, stop_ids, reply_id,
                             lambda choices: text_body(model_name, reply_id, now, req, choices, text),
                             lambda: TextChunks(model_name, reply_id, now, req, text))


def _add_tool_routes(app, api_key: str | None, max_body_bytes: int) -> None:
    """GET /v1/nanoforge/tools (the built-in tools' schemas), POST /v1/nanoforge/tools/run {"name", "arguments"}
    -> {"content": the result}. Only the built-in tools (chat/calculator.py: no eval, bounded work) run; anything
    else is answered "Error: ...", as a tool result the model can read."""
    @app.get("/v1/nanoforge/tools")
    async def tools(request: Request):
        protocol.check_api_key(request.headers.get("authorization", ""), api_key)
        return {"object": "list", "data": list(BUILTIN_TOOLS.values())}

    @app.post("/v1/nanoforge/tools/run")
    async def run_tool(request: Request):
        protocol.check_api_key(request.headers.get("authorization", ""), api_key)
        body = await _read_json(request, max_body_bytes)
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise APIError(400, "the body must be {\"name\": a built-in tool, \"arguments\": its JSON object}",
                           param="name")
        arguments = body.get("arguments", {})
        if not isinstance(arguments, (str, dict)):
            raise APIError(400, "arguments must be an object or a JSON string of one", param="arguments")
        return {"content": run_tool_call({"name": body["name"], "arguments": arguments}, BUILTIN_TOOLS)}


def _log_warnings(reply_id: str, warnings: list[str]) -> None:
    for warning in warnings:
        log.warning("%s: %s", reply_id, warning)


async def _read_json(request: Request, max_body_bytes: int) -> Any:
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
    return protocol.parse_json(b"".join(chunks))


async def _answer(worker: Worker, req: GenerationRequest, stop_ids: list[int], reply_id: str,
                  body: Callable[[list[Choice]], dict], chunks: Callable[[], Chunks]):
    """Answer a checked request: `body(choices)` as JSON, or an event stream of `chunks()`'s chunks ending in
    [DONE] (the usage chunk before it, when asked)."""
    if not req.stream:
        try:
            choices = await worker.complete(req, stop_ids)
        except NanoforgeError as e:
            raise APIError(400, str(e)) from None
        return JSONResponse(body(choices))

    worker.check_room()  # a 503 has to come before the stream's 200
    stream = chunks()

    async def events():
        for chunk in stream.first():
            yield protocol.sse(chunk)
        try:
            done = []
            async for item in worker.stream(req, stop_ids):
                if isinstance(item, Choice):
                    done.append(item)
                for chunk in stream.end(item) if isinstance(item, Choice) else stream.feed(item):
                    yield protocol.sse(chunk)
            if req.include_usage:
                yield protocol.sse(stream.usage_chunk(protocol.usage(req, done)))
            _log_warnings(reply_id, stream.warnings())
        except Exception as e:  # the 200 is already sent: report it in the stream, as OpenAI does
            ours = isinstance(e, NanoforgeError)
            if not ours:
                log.exception("generation failed")
            error = APIError(400 if ours else 500, str(e), type="invalid_request_error" if ours else "server_error")
            yield protocol.sse(error.body())
        yield protocol.sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ----------------------------------------------------------------------------------------------- running it

def _listen(host: str, port: int, gate: Gate):
    """The server's sockets, bound now: a port in use or a host that is not this machine's is a clear error before
    the model loads, not a log line after it."""
    try:
        return bind_listeners(host, port, gate)
    except OSError as e:
        why = "is already in use; choose another --port" if e.errno == errno.EADDRINUSE else f"cannot be used: {e}"
        raise NanoforgeError(f"{host}:{port} {why}") from None


def run_server(run_dir, options: ServeOptions, device: str = "auto", precision: str = "auto",
               max_tokens_cap: int | None = None) -> None:
    """`nanoforge serve RUN`: serve the run's latest checkpoint, named after the run directory, until Ctrl-C."""
    host, port, api_key = options.host, options.port, options.api_key
    gate = Gate(options.max_connections, options.header_timeout, options.body_timeout)
    repeats = RepeatFilter(drop=(OutOfDescriptors,))
    listeners = _listen(host, port, gate)  # before minutes of loading, and before saying "serving"
    try:
        model, tokenizer, _, precision = load_for_inference(run_dir, device, precision, announce=True)
        app = create_app(model, tokenizer, Path(run_dir).resolve().name, api_key=api_key,
                         max_tokens_cap=max_tokens_cap, precision=precision,
                         request_timeout=options.request_timeout or None, max_pending=options.max_pending,
                         max_batch=options.max_batch, on_shutdown=lambda: repeats.flush(everything=True))
        _announce(app, options, gate)
        # asyncio's own loop: uvloop would accept connections without the Listener's accept()
        config = uvicorn.Config(app, http=functools.partial(GuardedProtocol, gate=gate), loop="asyncio",
                                log_level=options.log_level)
        with repeats.installed(SERVER_LOGGERS):  # after Config set up the log; flushed at shutdown (uvicorn then
            # re-raises the signal that stopped it, which may end the process before this block's end)
            uvicorn.Server(config).run(sockets=listeners)
    finally:
        for listener in listeners:
            listener.close()


def _announce(app, options: ServeOptions, gate: Gate) -> None:
    """Say where the server listens (and lower the connection cap to what the process's file limit allows)."""
    host, port, name = options.host, options.port, app.state.model_name
    gate.max_connections, note = connection_cap(gate.max_connections)
    if note:
        print(note, file=sys.stderr)
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {name!r}: web chat at http://{shown}:{port}/, OpenAI API at http://{shown}:{port}/v1"
          + (" (API key required)" if options.api_key else ""), file=sys.stderr)
    if host not in ("127.0.0.1", "localhost", "::1") and not options.api_key:
        print(f"warning: listening on {host} without --api-key: anyone who can reach this machine can use the "
              f"model", file=sys.stderr)
