"""The server under attack and under load: the API key compared in constant time, the per-request timeout,
a hypothesis fuzz of both generation endpoints (random JSON, random headers: never a 5xx, every error in
OpenAI's shape), and 50 concurrent streaming clients against a real uvicorn process (every request completes
or gets a clean 503, memory stays bounded, the server still answers afterwards)."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="the serving tests need httpx")
pytest.importorskip("fastapi", reason="serving needs fastapi and uvicorn (pip install fastapi uvicorn)")
pytest.importorskip("uvicorn", reason="serving needs fastapi and uvicorn (pip install fastapi uvicorn)")
hypothesis = pytest.importorskip("hypothesis", reason="the fuzz test needs hypothesis (pip install hypothesis)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from nanoforge.infer import options as chat_defaults  # noqa: E402
from nanoforge.infer.generate import complete  # noqa: E402

from test_generate import make_tiny_run, random_model  # noqa: E402

ERROR_FIELDS = {"message", "type", "param", "code"}
KEY = "fuzz-key-9"


def assert_openai_error(response, status: int | None = None) -> dict:
    if status is not None:
        assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS and isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str)
    return error


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer):
    """A random-weight model (no training needed) with the tiny tokenizer: the API does not care what it says."""
    import torch

    torch.set_num_threads(1)
    return random_model(seed=0), tiny_tokenizer  # both have a vocabulary of 512


def app_for(tiny, **kwargs):
    from nanoforge.serve.app import create_app

    model, tok = tiny
    return create_app(model, tok, "m", **kwargs)


# ------------------------------------------------------------------------------------------------ the API key


def test_the_api_key_is_compared_in_constant_time(tiny, monkeypatch):
    """Every key check goes through hmac.compare_digest (time independent of where the keys differ), and
    near-miss keys (a prefix, one more character, another case, the wrong scheme) are all refused."""
    import hmac

    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    with TestClient(app_for(tiny, api_key=KEY)) as client:
        for given_header in (f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Bearer {KEY.upper()}", "Bearer ",
                             f"Basic {KEY}", KEY, ""):
            headers = {"Authorization": given_header} if given_header else {}
            error = assert_openai_error(client.get("/v1/models", headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert any(b == KEY.encode() for _, b in calls), "the key was not compared with hmac.compare_digest"


# ---------------------------------------------------------------------------------------------- the timeout


@pytest.fixture()
def slowed(tiny):
    """The tiny model with its forward slowed to >= 20 ms a call."""
    model, tok = tiny
    inner = model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.02)
        return inner(*args, **kwargs)

    model.forward = slow_forward
    try:
        yield model, tok
    finally:
        model.__dict__.pop("forward", None)


@pytest.mark.slow
def test_a_reply_past_the_request_timeout_ends_with_length(slowed):
    model, tok = slowed
    slow = model.forward
    del model.forward  # the premise, unslowed: left alone, this reply runs long
    stop_ids = [t for t in (tok.eos_id, tok.im_end_id, tok.im_start_id) if t is not None]
    cfg = dataclasses.replace(chat_defaults.CHAT_SAMPLING, temperature=0, max_new_tokens=80)
    for question in ("hi", "hello", "tell me more", "why?", "go on", "and then?"):  # a random model's reply
        messages = [{"role": "user", "content": question}]                        # length depends on the prompt
        prompt_ids, _ = tok.render_chat(messages, add_generation_prompt=True)
        full = complete(model, tok, [prompt_ids], cfg, stop_ids)[0]
        if len(full.token_ids) >= 50:
            break
    assert len(full.token_ids) >= 50, "the test needs a reply that would run long"
    model.forward = slow
    body = {"messages": messages, "max_tokens": 80, "temperature": 0}
    with TestClient(app_for((model, tok), request_timeout=0.3)) as client:
        started = time.monotonic()
        reply = client.post("/v1/chat/completions", json=body)
        elapsed = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        n = reply.json()["usage"]["completion_tokens"]
        assert 1 <= n < len(full.token_ids) // 2 and elapsed < len(full.token_ids) * 0.02, (n, elapsed)
        # the reply so far, cut short (its last token may hold part of a character, decoded as U+FFFD)
        assert full.text.startswith(choice["message"]["content"].rstrip("\ufffd"))

        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
        assert len(chunks) < len(full.token_ids) // 2
        assert client.get("/health").status_code == 200


def test_no_timeout_means_the_whole_reply(tiny):
    with TestClient(app_for(tiny, request_timeout=None)) as client:
        reply = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 20, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 20


# ---------------------------------------------------------------------------------------------------- fuzz

_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**70, max_value=2**70)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def plausible(name: str):
    """Values near the valid range of each field, so that fuzzing also reaches generation."""
    return {
        "temperature": st.floats(min_value=-1, max_value=3, allow_nan=False),
        "top_p": st.floats(min_value=-0.5, max_value=1.5, allow_nan=False),
        "top_k": st.integers(min_value=-2, max_value=2_000_000),
        "repetition_penalty": st.floats(min_value=-1, max_value=12, allow_nan=False),
        "max_tokens": st.integers(min_value=-1, max_value=6),
        "max_completion_tokens": st.integers(min_value=-1, max_value=6),
        "seed": st.integers(min_value=-1, max_value=2**64),
        "n": st.integers(min_value=0, max_value=2),
        "presence_penalty": st.floats(min_value=-3, max_value=3, allow_nan=False),
        "frequency_penalty": st.just(0) | st.floats(min_value=-3, max_value=3, allow_nan=False),
        "logprobs": st.booleans(),
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values}),
        "model": st.just("m") | st.text(max_size=5),
        "prompt": st.text(max_size=40) | st.lists(st.text(max_size=10), max_size=2),
        "echo": st.booleans(),
        "suffix": st.none() | st.text(max_size=3),
    }[name]


_content = (st.text(max_size=60)
            | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 3]),
                                              "text": st.text(max_size=20) | json_values}), max_size=3)
            | json_values)
_message = st.fixed_dictionaries(
    {}, optional={"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", ""]) | json_values,
                  "content": _content, "name": json_values}) | json_values
_messages = st.lists(_message, max_size=4) | json_values

CHAT_FIELDS = ["model", "temperature", "top_p", "top_k", "repetition_penalty", "max_tokens",
               "max_completion_tokens", "seed", "n", "presence_penalty", "frequency_penalty", "logprobs", "stop",
               "stream", "stream_options"]
TEXT_FIELDS = CHAT_FIELDS + ["prompt", "echo", "suffix"]


def _body(fields: list[str], extra: dict):
    return st.fixed_dictionaries(extra, optional={name: plausible(name) | json_values for name in fields})


bodies = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), _body(CHAT_FIELDS, {"messages": _messages})),
    st.tuples(st.just("/v1/chat/completions"), _body(CHAT_FIELDS, {})),
    st.tuples(st.just("/v1/completions"), _body(TEXT_FIELDS, {})),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), json_values),
)
raw_bodies = st.sampled_from([b"", b"{", b"null", b"[]", b'{"messages": NaN}', b'{"temperature": Infinity}',
                              b"\xff\xfe\x00", b'{"prompt": "\\ud800"}', b'{"messages": [{"role": "user", '
                              b'"content": "\\udfff"}]}', b"[" * 50_000, b'"' + b"a" * 10 + b'"']) | st.binary(max_size=64)
header_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
headers = st.fixed_dictionaries({}, optional={
    "authorization": st.sampled_from([f"Bearer {KEY}"] * 4 + ["Bearer", "bearer " + KEY, f"Bearer  {KEY} "])
    | header_text,
    "content-type": st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                     "multipart/form-data; boundary=x"]) | header_text,
    "accept": header_text,
})


@pytest.fixture(scope="module")
def fuzz_client(tiny):
    # max_tokens_cap=4: a request that leaves max_tokens out generates at most 4 tokens, so fuzzing stays fast.
    with TestClient(app_for(tiny, api_key=KEY, max_tokens_cap=4), raise_server_exceptions=False) as client:
        yield client


def check_response(response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert_openai_error(response)
        return
    assert response.status_code == 200
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            chunk = json.loads(event)
            assert "error" not in chunk, chunk  # an error after the 200 would be a bug the checks missed
    else:
        body = response.json()
        assert body["choices"][0]["finish_reason"] in ("stop", "length"), body


@pytest.mark.slow
@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(request=bodies, raw=st.none() | raw_bodies, headers=headers)
def test_fuzzed_requests_never_get_a_5xx(fuzz_client, request, raw, headers):
    path, body = request
    content = raw if raw is not None else json.dumps(body).encode()
    check_response(fuzz_client.post(path, content=content, headers=headers))


@pytest.mark.slow
def test_fuzz_corner_cases(fuzz_client):
    """Cases found or feared while fuzzing, kept as plain regressions."""
    auth = {"authorization": f"Bearer {KEY}"}
    for body in ({"prompt": "\ud800"}, {"messages": [{"role": "user", "content": "\udfff"}]},
                 {"prompt": "a", "top_k": 10**6}, {"prompt": "a", "seed": 2**63 - 1},
                 {"prompt": "a", "temperature": 10**400}, {"prompt": "a", "stop": ["\ud800"]}):
        content = json.dumps(body).encode()
        check_response(fuzz_client.post("/v1/completions", content=content, headers=auth))
    for content in (b"[" * 100_000, b'{"prompt": 1e400}', b'{"prompt": "a", "temperature": 1e400}'):
        check_response(fuzz_client.post("/v1/completions", content=content, headers=auth))


# ---------------------------------------------------------------------------------------------------- load


def vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def stream_once(http, url: str, body: dict) -> str:
    """One streamed chat request under load: "busy_503" for a clean 503 server_busy, "completed" for a reply that
    ends with [DONE] after a stop or length finish; anything else fails an assertion."""
    with http.stream("POST", url, json=body) as response:
        if response.status_code == 503:
            response.read()
            error = response.json()["error"]
            assert set(error) == ERROR_FIELDS and error["code"] == "server_busy", error
            return "busy_503"
        assert response.status_code == 200, response.status_code
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-2:]
    last = json.loads(events[-2])
    assert "error" not in last and last["choices"][0]["finish_reason"] in ("stop", "length")
    return "completed"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's memory from /proc")
def test_fifty_concurrent_streaming_clients(tmp_path_factory, tiny_tokenizer, tmp_path):
    """50 clients stream chat replies for a bounded time (NANOFORGE_LOAD_SECONDS, default 8) against a real
    server limited to 16 waiting requests: each request ends with [DONE] or a clean 503 server_busy."""
    from test_server import ServerProcess

    run_dir = make_tiny_run(tmp_path_factory, tiny_tokenizer)
    seconds = float(os.environ.get("NANOFORGE_LOAD_SECONDS", "8"))
    clients, max_tokens = 50, 16
    server = ServerProcess(run_dir, tmp_path / "server.log", "--max-pending", "16", "--request-timeout", "60")
    pid = server.proc.pid
    try:
        body = {"model": "run", "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": max_tokens, "temperature": 1.0, "stream": True}
        warm = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60)
        assert warm.status_code == 200
        rss = {"before": vm_rss_kib(pid), "peak": 0}
        lock = threading.Lock()
        latencies: list[float] = []
        outcomes: dict[str, int] = {"completed": 0, "busy_503": 0}
        failures: list[str] = []
        stop_at = time.monotonic() + seconds
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                rss["peak"] = max(rss["peak"], vm_rss_kib(pid))
                time.sleep(0.1)

        def client_loop(i: int) -> None:
            with httpx.Client(timeout=60) as http:
                while time.monotonic() < stop_at:
                    started = time.monotonic()
                    try:
                        outcome = stream_once(http, server.url + "/v1/chat/completions", {**body, "seed": i})
                    except BaseException as e:  # noqa: BLE001
                        with lock:
                            failures.append(f"client {i}: {type(e).__name__}: {e}")
                        return
                    with lock:
                        outcomes[outcome] += 1
                        if outcome == "completed":
                            latencies.append(time.monotonic() - started)
                    if outcome == "busy_503":
                        time.sleep(0.2)  # back off, as a client should

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=seconds + 120)
        wall = time.monotonic() - started
        sampling.set()
        sampler.join()
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert not failures, failures[:5]
        time.sleep(0.5)
        rss["after"] = vm_rss_kib(pid)
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["queued"] == 0, health.text
        normal = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60)
        assert normal.status_code == 200 and normal.json()["choices"][0]["finish_reason"] in ("stop", "length")

        figures = {"clients": clients, "seconds": seconds, "wall_s": round(wall, 1), "max_tokens": max_tokens,
                   **outcomes, "p50_s": round(statistics.median(latencies), 3),
                   "p95_s": round(percentile(latencies, 0.95), 3), "max_s": round(max(latencies), 3),
                   "rss_before_mib": round(rss["before"] / 1024, 1), "rss_peak_mib": round(rss["peak"] / 1024, 1),
                   "rss_after_mib": round(rss["after"] / 1024, 1)}
        print("load figures:", json.dumps(figures))
        if os.environ.get("NANOFORGE_LOAD_REPORT"):
            Path(os.environ["NANOFORGE_LOAD_REPORT"]).write_text(json.dumps(figures, indent=1))
        assert outcomes["completed"] >= clients // 2, figures  # the server kept serving throughout
        assert rss["peak"] - rss["before"] < 256 * 1024, figures  # bounded: no per-request leak or pile-up
        assert rss["after"] - rss["before"] < 128 * 1024, figures
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]


def test_a_port_in_use_is_a_clear_error_before_loading(tmp_path):
    """Checked before the model loads (the run below does not even exist) and before "serving ..." is said."""
    import socket

    from nanoforge.core.errors import NanoforgeError
    from nanoforge.serve.app import run_server
    from nanoforge.serve.options import ServeOptions
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(NanoforgeError, match=f"127.0.0.1:{port} is already in use; choose another --port"):
            run_server(tmp_path / "no_run", ServeOptions(port=port))
