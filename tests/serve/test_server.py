"""`nanoforge serve`: a real uvicorn process on a tiny trained run, spoken to with the official `openai`
client and with raw HTTP. Replies are checked against `complete()` run here on the same checkpoint, so a
server that sampled differently, counted tokens wrongly or mixed up concurrent requests would fail."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the serving tests need the `openai` client (pip install openai)")
httpx = pytest.importorskip("httpx", reason="the serving tests need httpx")
pytest.importorskip("fastapi", reason="serving needs fastapi and uvicorn (pip install fastapi uvicorn)")
pytest.importorskip("uvicorn", reason="serving needs fastapi and uvicorn (pip install fastapi uvicorn)")

from nanoforge.infer import options as chat_defaults  # noqa: E402
from nanoforge.infer.generate import SamplingConfig, complete  # noqa: E402
from nanoforge.chat.replies import parse_reply  # noqa: E402

from conftest import free_port  # noqa: E402
from test_generate import make_tiny_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-123"
ERROR_FIELDS = {"message", "type", "param", "code"}


class ServerProcess:
    """`python -m nanoforge serve RUN --port P ...` in its own process, up once /health answers."""

    def __init__(self, run_dir: Path, log_path: Path, *args: str, preexec_fn=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        env.pop("NANOFORGE_API_KEY", None)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanoforge", "serve", str(run_dir), "--port", str(self.port),
             "--device", "cpu", "--log-level", "warning", *args],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn)
        self.wait_healthy()

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_healthy(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout} s:\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_tokenizer):
    return make_tiny_run(tmp_path_factory, tiny_tokenizer)


@pytest.fixture(scope="module")
def server(run_dir, tmp_path_factory):
    proc = ServerProcess(run_dir, tmp_path_factory.mktemp("server") / "server.log", "--api-key", KEY)
    yield proc
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()


@pytest.fixture(scope="module")
def local(run_dir):
    """The same checkpoint loaded here, to compute what the server should answer."""
    import torch

    from nanoforge.weights.load import load_model

    torch.set_num_threads(1)
    model, tokenizer, _ = load_model(run_dir)
    return model, tokenizer


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def server_cfg(**fields) -> SamplingConfig:
    """The sampling the server uses: `nanoforge chat`'s defaults, with the request's fields on top."""
    return dataclasses.replace(chat_defaults.CHAT_SAMPLING, **fields)


def chat_stop_ids(tok) -> list[int]:
    return [t for t in (tok.eos_id, tok.im_end_id, tok.im_start_id) if t is not None]


MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Tell me a story about a little robot."}]


def stream_chat(client, **kwargs) -> tuple[str, str | None, dict | None, int]:
    """(joined text, last finish_reason, usage, number of chunks) of a streamed chat completion."""
    text, finish, usage, n = "", None, None, 0
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        n += 1
        if chunk.usage is not None:
            usage = {k: getattr(chunk.usage, k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage, n


# ---------------------------------------------------------------------------------------------- the API


def test_health_and_models(server, client):
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "run"
    models = client.models.list()
    assert [m.id for m in models.data] == ["run"]
    assert client.models.retrieve("run").id == "run"


def test_chat_matches_local_generation_and_counts_tokens(client, local):
    model, tok = local
    reply = client.chat.completions.create(model="run", messages=MESSAGES, temperature=0, max_tokens=20)
    prompt_ids, _ = tok.render_chat(MESSAGES, add_generation_prompt=True)
    expected = complete(model, tok, [prompt_ids], server_cfg(temperature=0, max_new_tokens=20),
                        chat_stop_ids(tok))[0]
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    # the reply as the one parser reads it (no tools offered: any call the model writes is not returned)
    content = parse_reply(expected.text, thinking_open=False).content if tok.supports_tools else expected.text
    assert choice.message.content == content and content
    assert choice.finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == len(prompt_ids) + len(expected.token_ids)
    assert reply.model == "run" and reply.object == "chat.completion"


def test_streaming_joins_to_the_non_streaming_reply(client):
    for kwargs in (dict(temperature=0, max_tokens=24), dict(temperature=0.9, top_p=0.95, seed=11, max_tokens=24)):
        whole = client.chat.completions.create(model="run", messages=MESSAGES, **kwargs)
        text, finish, usage, n_chunks = stream_chat(client, model="run", messages=MESSAGES, **kwargs)
        assert text == whole.choices[0].message.content
        assert finish == whole.choices[0].finish_reason
        assert usage == {k: getattr(whole.usage, k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        assert n_chunks > 3, "the reply should arrive in pieces"


def test_seed_reproduces_and_length_limit_says_length(client):
    kwargs = dict(model="run", messages=MESSAGES, temperature=1.0, seed=5, max_tokens=3)
    first = client.chat.completions.create(**kwargs)
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first.choices[0].message.content
    if first.choices[0].finish_reason == "length":
        assert first.usage.completion_tokens == 3
    else:
        assert first.usage.completion_tokens < 3


def test_stop_strings_cut_the_reply(client):
    base = client.chat.completions.create(model="run", messages=MESSAGES, temperature=0, max_tokens=30)
    text = base.choices[0].message.content
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip() == text[i:i + 3])
    expected = text[:text.index(stop)]
    cut = client.chat.completions.create(model="run", messages=MESSAGES, temperature=0, max_tokens=30,
                                         stop=[stop, "zzzzqqq"])
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == (expected, "stop")
    streamed, finish, _, _ = stream_chat(client, model="run", messages=MESSAGES, temperature=0, max_tokens=30,
                                         stop=stop)
    assert (streamed, finish) == (expected, "stop")


def test_completions_continue_the_raw_prompt(client, local):
    model, tok = local
    prompt = "Once upon a time"
    reply = client.completions.create(model="run", prompt=prompt, temperature=0, max_tokens=12)
    expected = complete(model, tok, [tok.encode(prompt)], server_cfg(temperature=0, max_new_tokens=12),
                        [tok.eos_id])[0]
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(tok.encode(prompt))
    assert reply.usage.completion_tokens == len(expected.token_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="run", prompt=prompt, temperature=0, max_tokens=12, stream=True) if c.choices)
    assert streamed == expected.text


# ---------------------------------------------------------------------------------------------- the key


def test_api_key_is_required_on_the_api(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.get(server.url + "/v1/models", headers=headers)
        assert response.status_code == 401
        assert set(response.json()["error"]) == ERROR_FIELDS
        assert response.json()["error"]["code"] == "invalid_api_key"
    ok = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="run", messages=MESSAGES, max_tokens=2)
    assert httpx.get(server.url + "/health").status_code == 200, "health needs no key"
    assert httpx.get(server.url + "/").status_code == 200, "nor does the page (it asks for the key)"


# ---------------------------------------------------------------------------------------------- bad requests


def _chat(**fields):
    return {"model": "run", "messages": [{"role": "user", "content": "hi"}], **fields}


BAD_REQUESTS = [
    # (name, path, body (bytes are sent as they are), expected status, expected param or None)
    ("invalid JSON", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("not UTF-8", "/v1/chat/completions", b'\xff\xfe{}', 400, None),
    ("NaN temperature", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None),
    ("nested too deeply", "/v1/chat/completions", b"[" * 200_000, 400, None),
    ("body not an object", "/v1/chat/completions", [1, 2], 400, None),
    ("missing messages", "/v1/chat/completions", {"model": "run"}, 400, "messages"),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("message not an object", "/v1/chat/completions", {"messages": ["hi"]}, 400, "messages[0]"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "bot", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("content not a string", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("model not a string", "/v1/chat/completions", _chat(model=3), 400, "model"),
    ("temperature a string", "/v1/chat/completions", _chat(temperature="hot"), 400, "temperature"),
    ("temperature too high", "/v1/chat/completions", _chat(temperature=7), 400, "temperature"),
    ("top_p zero", "/v1/chat/completions", _chat(top_p=0), 400, "top_p"),
    ("max_tokens a float", "/v1/chat/completions", _chat(max_tokens=1.5), 400, "max_tokens"),
    ("max_tokens a bool", "/v1/chat/completions", _chat(max_tokens=True), 400, "max_tokens"),
    ("max_tokens zero", "/v1/chat/completions", _chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens over the cap", "/v1/chat/completions", _chat(max_tokens=10**6), 400, "max_tokens"),
    ("stream not a bool", "/v1/chat/completions", _chat(stream="yes"), 400, "stream"),
    ("empty stop string", "/v1/chat/completions", _chat(stop=[""]), 400, "stop"),
    ("too many stop strings", "/v1/chat/completions", _chat(stop=list("abcde")), 400, "stop"),
    ("seed a string", "/v1/chat/completions", _chat(seed="x"), 400, "seed"),
    ("n over --max-batch", "/v1/chat/completions", _chat(n=33), 400, "n"),
    ("prompt too long", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "once upon a time " * 200}]}, 400, "messages"),
    ("body too large", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x" * 1_100_000}]}, 413, None),
    ("missing prompt", "/v1/completions", {"model": "run"}, 400, "prompt"),
    ("prompt a number", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("completion prompt too long", "/v1/completions", {"prompt": "once upon a time " * 200}, 400, "prompt"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, name, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS and error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    if name.endswith("too long"):
        assert error["code"] == "context_length_exceeded"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_unknown_routes_and_methods_get_openai_errors(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405),
                                 ("GET", "/v1/models/other", 404)):
        response = httpx.request(method, server.url + path, headers=headers)
        assert response.status_code == status
        assert set(response.json()["error"]) == ERROR_FIELDS


def test_oversized_body_is_refused_without_a_content_length(server):
    """A chunked upload declares no size; the server must count what it reads and stop at the limit."""
    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"x" * 50_000
        yield b'"}]}'

    response = httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=30,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == 413
    assert set(response.json()["error"]) == ERROR_FIELDS


# ---------------------------------------------------------------------------------------------- concurrency


def test_sixteen_concurrent_streams_each_get_their_own_reply(server, client):
    """Each concurrent stream must equal the same request made alone: replies that shared a KV cache or
    interleaved tokens would differ."""
    seeds = list(range(16))
    alone = {s: client.chat.completions.create(model="run", messages=MESSAGES, temperature=1.0, seed=s,
                                               max_tokens=16) for s in seeds[:4]}
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []
    health_ok: list[bool] = []

    def one(seed: int) -> None:
        try:
            results[seed] = stream_chat(client, model="run", messages=MESSAGES, temperature=1.0, seed=seed,
                                        max_tokens=16)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    health_ok.append(httpx.get(server.url + "/health", timeout=10).status_code == 200)  # the loop stays free
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(results) == seeds
    for seed, (text, finish, usage, _) in results.items():
        assert finish in ("stop", "length")
        assert usage["completion_tokens"] <= 16
        if seed in alone:
            assert text == alone[seed].choices[0].message.content
    assert health_ok == [True]


def test_a_client_leaving_mid_stream_frees_the_server(server, client):
    body = _chat(stream=True, max_tokens=100, temperature=1.0)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        next(response.iter_lines())  # read a little, then hang up
    reply = client.chat.completions.create(model="run", messages=MESSAGES, temperature=0, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------------------------------------- in process


class _InProcessServer:
    """create_app served by uvicorn on a thread of this process, so a test can watch the model's calls."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the in-process server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture()
def slow_server(local, request):
    """create_app in this process on the test run's model, whose forward is slowed to >= 10 ms and watched:
    state["most"] is the most forward calls that ever ran at once, state["calls"] how many there were."""
    from nanoforge.serve.app import create_app

    model, tok = local
    inner = model.forward
    state = {"active": 0, "most": 0, "calls": 0}
    lock = threading.Lock()

    def slow_forward(*args, **kwargs):
        with lock:
            state["active"] += 1
            state["calls"] += 1
            state["most"] = max(state["most"], state["active"])
        try:
            time.sleep(0.01)
            return inner(*args, **kwargs)
        finally:
            with lock:
                state["active"] -= 1

    model.forward = slow_forward
    server = _InProcessServer(create_app(model, tok, "run", **getattr(request, "param", {})))
    try:
        yield server, state
    finally:
        server.stop()
        del model.forward


def test_one_generation_at_a_time_and_the_event_loop_stays_free(slow_server):
    """The model is not thread-safe: requests must reach it one at a time. The slowed-down forward shows
    whether two generations ever overlap, and whether /health still answers while one runs."""
    server, state = slow_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    results, errors = [], []

    def one(seed: int) -> None:
        try:
            results.append(stream_chat(client, model="run", messages=MESSAGES, temperature=1.0, seed=seed,
                                       max_tokens=12))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # generation is under way (6 replies x 12 steps x >= 10 ms)
    started = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    health_latency = time.monotonic() - started
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert len(results) == 6 and all(finish in ("stop", "length") for _, finish, _, _ in results)
    assert state["most"] == 1, f"{state['most']} generations ran on the model at once"
    assert health_latency < 0.5, f"/health took {health_latency:.2f} s while replies were generated"


def test_a_client_leaving_stops_its_generation(slow_server):
    server, state = slow_server
    # ignore_eos: left alone, this reply runs its 100 tokens, whatever the model samples
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 100,
            "temperature": 1.0, "seed": 1, "ignore_eos": True}
    state["calls"] = 0
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        while "content" not in next(lines):  # wait for the first piece of text, then hang up
            pass
    time.sleep(0.5)  # long enough for ~50 more steps if the generation went on
    calls = state["calls"]
    time.sleep(0.3)
    assert state["calls"] == calls, "the generation went on after the client left"
    assert calls < 60, f"{calls} forward calls for a 100-token reply whose client left early"


@pytest.mark.parametrize("slow_server", [{"max_pending": 2}], indirect=True)
def test_a_full_queue_answers_503(slow_server):
    server, _ = slow_server
    # ignore_eos: no early end token frees the queue (a fresh clone's model, trained on less, can sample one)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "temperature": 1.0,
            "ignore_eos": True}
    statuses: list[int] = []

    def one() -> None:
        statuses.append(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    worker = server.server.config.app.state.worker
    while worker.pending < 2 and time.monotonic() < deadline:  # both are in, with 100 steps x >= 10 ms to go
        time.sleep(0.01)
    busy = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    assert busy.status_code == 503, busy.text
    assert set(busy.json()["error"]) == ERROR_FIELDS and busy.json()["error"]["code"] == "server_busy"
    for t in threads:
        t.join(timeout=60)
    assert statuses == [200, 200]
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
