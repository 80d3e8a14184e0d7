"""JSON built to crash its parser (nested a thousand deep, an integer of 5,000 digits) wherever nanoforge reads
JSON it did not write: a clean refusal, like any malformed JSON, never a RecursionError or ValueError.

Through the real server (the official openai client, one keep-alive connection that must survive), the reply
parser (a model can write such a block), the calculator; the CLI's readers are in test_bad_inputs.py's
catalogue, RL prompt files in test_rl_prompts.py. Every reader of outside JSON goes through nanoforge/core/safejson.py:
the last test checks that no other json.loads is left on such input."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from nanoforge.serve.chat_reply import reply_message
from nanoforge.serve.protocol import GenerationRequest
from nanoforge.chat.replies import StreamParser, parse_reply
from nanoforge.chat.calculator import run_tool_call

ROOT = Path(__file__).resolve().parents[1]
DEEP = "[" * 1000 + "]" * 1000
DEEP_OBJECT = '{"a": ' * 1000 + "1" + "}" * 1000
HUGE = "1" * 5000
HOSTILE = {"deep": (DEEP_OBJECT, "nested deeper than 100 levels"),
           "huge-int": ('{"expression": ' + HUGE + "}", "a number of 5000 digits (the limit is 4300)")}


@pytest.mark.parametrize("name", HOSTILE)
def test_the_reply_parser_drops_and_reports_a_hostile_block(name):
    """A model writing such a tool call (chat, serve, eval, rewards, RL rollouts all parse with this): the block
    is dropped with an error saying why, the calls around it are kept, whole or streamed."""
    arguments, why = HOSTILE[name]
    good = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    for body in ('{"name": "calculator", "arguments": ' + arguments + "}",  # an object
                 json.dumps({"name": "calculator", "arguments": arguments})):  # a JSON string of one
        text = f"ok\n{good}\n<tool_call>\n{body}\n</tool_call>\n{good}"
        reply = parse_reply(text, thinking_open=False)
        assert [c["id"] for c in reply.tool_calls] == ["call_0", "call_1"] and reply.content == "ok"
        assert len(reply.errors) == 1 and reply.errors[0].startswith("tool call block 1: ")
        parser = StreamParser(thinking_open=False)
        events = [e for piece in re.findall(".{1,7}", text, re.DOTALL) for e in parser.feed(piece)] + parser.close()
        assert [v for kind, v in events if kind == "error"] == reply.errors
        assert why in reply.errors[0]
        request = GenerationRequest([0], None, False, False, structured=True, thinking_open=False, tools_offered=True)
        message, warnings = reply_message(text, request, "call_")  # what the server logs, and answers
        assert len(message["tool_calls"]) == 2 and warnings == [f"dropped a malformed tool call ({reply.errors[0]})"]


def test_the_calculator_answers_an_error_string():
    for arguments, why in HOSTILE.values():
        result = run_tool_call({"name": "calculator", "arguments": arguments}, ["calculator"])
        assert result == f"Error: the arguments of 'calculator' are not valid JSON ({why})"


# ---------------------------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_tokenizer):
    pytest.importorskip("openai", reason="the serving tests need the `openai` client")
    pytest.importorskip("fastapi", reason="serving needs fastapi and uvicorn")
    pytest.importorskip("uvicorn", reason="serving needs fastapi and uvicorn")
    from test_generate import make_tiny_run
    from test_server import KEY, ServerProcess

    proc = ServerProcess(make_tiny_run(tmp_path_factory, tiny_tokenizer),
                         tmp_path_factory.mktemp("hostile_json") / "server.log", "--api-key", KEY)
    yield proc, KEY
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()


@pytest.fixture
def client(server):
    """The official openai client and raw requests, on one httpx connection (max_connections=1);
    `client.connections` has the local address of each response's connection, so a connection that the
    server dropped shows as a second address."""
    import httpx
    import openai

    proc, key = server
    connections = []
    http = httpx.Client(limits=httpx.Limits(max_connections=1), headers={"Authorization": f"Bearer {key}"},
                        event_hooks={"response": [lambda r: connections.append(
                            r.extensions["network_stream"].get_extra_info("client_addr"))]})
    client = SimpleNamespace(openai=openai.OpenAI(base_url=proc.url + "/v1", api_key=key, max_retries=0, timeout=60,
                                                  http_client=http),
                             post=lambda path, **kw: http.post(proc.url + path, timeout=60, **kw),
                             connections=connections)
    yield client
    http.close()


def _calling(arguments) -> list[dict]:
    return [{"role": "user", "content": "What is 1 + 1?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c0", "content": "2"}]


def _one_connection(client, requests: int) -> None:
    assert len(client.connections) == requests and len(set(client.connections)) == 1, client.connections


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_tool_call_arguments_get_a_400_and_the_connection_lives_on(client, name):
    import openai

    arguments, why = HOSTILE[name]
    with pytest.raises(openai.BadRequestError) as refused:
        client.openai.chat.completions.create(model="run", messages=_calling(arguments), max_tokens=2)
    error = refused.value.body
    assert error["param"] == "messages[1].tool_calls[0].function.arguments" and why in error["message"], error
    reply = client.openai.chat.completions.create(model="run", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
    assert reply.choices[0].message.content is not None
    _one_connection(client, 2)


@pytest.mark.parametrize("body, why", [
    (DEEP, "nested deeper than 100 levels"),
    ('{"model": "run", "max_tokens": ' + HUGE + ', "messages": [{"role": "user", "content": "hi"}]}',
     "a number of 5000 digits"),
    ('{"model": "run", "messages": [{"role": "user", "content": ' + DEEP_OBJECT + "}]}", "nested deeper"),
])
def test_a_hostile_request_body_gets_a_400(client, body, why):
    response = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json" and why in response.json()["error"]["message"]
    again = client.post("/v1/nanoforge/tools/run", json={"name": "calculator", "arguments": {"expression": "6*7"}})
    assert again.json() == {"content": "42"}
    _one_connection(client, 2)


def test_the_tool_endpoint_answers_an_error_string(client):
    for arguments, why in HOSTILE.values():
        response = client.post("/v1/nanoforge/tools/run", json={"name": "calculator", "arguments": arguments})
        assert response.status_code == 200
        assert response.json() == {"content": f"Error: the arguments of 'calculator' are not valid JSON ({why})"}
    _one_connection(client, 2)


# ---------------------------------------------------------------------------------------------- one decoder

# json.loads on JSON nanoforge wrote itself (metrics, manifests, checkpoint state, benchmark results, the
# tokenizer's own serialisation); everything else is read with safejson.loads.
OWN_JSON = {"nanoforge/core/safejson.py", "nanoforge/report/runs.py", "nanoforge/report/markdown.py",
            "nanoforge/recipes/bench.py", "nanoforge/train/metrics.py",
            "nanoforge/core/dirlock.py", "nanoforge/data/dpo.py", "nanoforge/chat/tokenizer.py", "nanoforge/weights/export.py"}


def test_no_other_json_loads_reads_outside_input():
    found = {str(p.relative_to(ROOT)): re.findall(r"\bjson\.loads?\(", p.read_text(encoding="utf-8"))
             for p in (ROOT / "nanoforge").rglob("*.py")}
    assert {path for path, calls in found.items() if calls} <= OWN_JSON, found
