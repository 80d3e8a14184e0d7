"""`nanoforge serve` with tools and thinking: a real uvicorn process serving the tiny run SFT'd on calculator
conversations (tests/tool_run.py), driven by the official `openai` client. Tools in -> tool calls out, the
same reply streamed, the full round trip (call -> calculator -> answer), thinking on, tool_choice "none", bad
requests; in process, the streamed deltas against the whole-text parse at every split point of a reply, and
tool requests against a plain-ChatML model."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="the serving tests need the `openai` client (pip install openai)")
httpx = pytest.importorskip("httpx", reason="the serving tests need httpx")
pytest.importorskip("fastapi", reason="serving needs fastapi and uvicorn (pip install fastapi uvicorn)")
pytest.importorskip("uvicorn", reason="serving needs fastapi and uvicorn (pip install fastapi uvicorn)")
from starlette.testclient import TestClient  # noqa: E402

from nanoforge.chat.template import CHAT_TEMPLATE  # noqa: E402
from nanoforge.serve.chat_reply import ReplyDeltas, reply_message  # noqa: E402
from nanoforge.serve.protocol import GenerationRequest  # noqa: E402
from nanoforge.chat.replies import parse_reply  # noqa: E402
from nanoforge.chat.tokenizer import Tokenizer  # noqa: E402
from nanoforge.chat.calculator import CALCULATOR_SCHEMA, run_tool_call  # noqa: E402

import tool_run  # noqa: E402
from test_generate import random_model  # noqa: E402
from test_server import ERROR_FIELDS, ServerProcess  # noqa: E402

KEY = "tools-key-7"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
slow = pytest.mark.slow  # the tool run takes about half a minute to build, once per session


# ---------------------------------------------------------------------------------------------- the delta builder

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
REPLY = ("I should compute 12 * 7 and then 3 + 4.\n</think>\n\nTwo calls <b>now</b>.\n"
         + CALL.format("12 * 7") + "\n" + CALL.format("3 + 4"))


def _request(thinking_open=True, tools_offered=True, structured=True) -> GenerationRequest:
    return GenerationRequest([0], None, True, False, structured=structured, thinking_open=thinking_open,
                             tools_offered=tools_offered)


def join_deltas(deltas) -> dict:
    """The message a client accumulates from a stream's deltas (role chunk excepted)."""
    message = {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
    for delta in deltas:
        message["content"] += delta.get("content", "")
        message["reasoning_content"] += delta.get("reasoning_content", "")
        message["tool_calls"] += delta.get("tool_calls", [])
    return message


def _same_message(joined: dict, whole: dict) -> None:
    assert joined["content"] == (whole["content"] or "")
    assert joined["reasoning_content"] == whole.get("reasoning_content", "")
    assert [{k: v for k, v in c.items() if k != "index"} for c in joined["tool_calls"]] == whole.get("tool_calls", [])
    assert [c["index"] for c in joined["tool_calls"]] == list(range(len(joined["tool_calls"])))


@pytest.mark.parametrize("text,thinking_open", [(REPLY, True), ("\n<think>\n" + REPLY, False)])
def test_deltas_at_every_split_join_to_the_whole_parse(text, thinking_open):
    """However the reply is cut into pieces (two pieces at every point, and one character at a time), no
    piece of a tag reaches content or reasoning, and the deltas join to the non-streamed message."""
    req = _request(thinking_open)
    whole, warnings = reply_message(text, req, "call_t_")
    parsed = parse_reply(text, thinking_open, "call_t_")
    assert whole["content"] == parsed.content == "Two calls <b>now</b>."
    assert whole["reasoning_content"] == parsed.reasoning == "I should compute 12 * 7 and then 3 + 4."
    assert whole["tool_calls"] == parsed.tool_calls and len(parsed.tool_calls) == 2 and warnings == []
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        deltas = ReplyDeltas(req, "call_t_")
        out = [d for piece in pieces for d in deltas.feed(piece)] + deltas.close()
        for d in out:
            shown = d.get("content", "") + d.get("reasoning_content", "")
            assert not any(tag in shown for tag in ("<t", "</t", "<tool", "think>", "call>")), (pieces, d)
            assert len(d) == 1, d
        _same_message(join_deltas(out), whole)
        assert deltas.calls == 2 and deltas.warnings() == []


def test_calls_not_offered_and_malformed_blocks_are_dropped_not_shown():
    text = "\n</think>\n\nok " + CALL.format("1 + 1") + "\n<tool_call>\n{not json}\n</tool_call> end"
    for tools_offered in (True, False):
        req = _request(True, tools_offered)
        whole, warnings = reply_message(text, req, "call_t_")
        deltas = ReplyDeltas(req, "call_t_")
        out = [d for ch in text for d in deltas.feed(ch)] + deltas.close()
        _same_message(join_deltas(out), whole)
        assert whole["content"] == parse_reply(text, True).content == "ok  end" and "reasoning_content" not in whole
        assert len(whole.get("tool_calls", [])) == (1 if tools_offered else 0)
        assert any("not valid JSON" in w for w in warnings) and deltas.warnings() == warnings
        assert any("offered no tools" in w for w in warnings) == (not tools_offered)


def test_a_plain_template_reply_is_all_content():
    req = _request(structured=False)
    text = "<think>\nx\n</think>\n\n" + CALL.format("2 * 2")
    assert reply_message(text, req, "c_")[0] == {"role": "assistant", "content": text}
    deltas = ReplyDeltas(req, "c_")
    assert join_deltas(deltas.feed(text[:5]) + deltas.feed(text[5:]) + deltas.close())["content"] == text


# ---------------------------------------------------------------------------------------------- a plain-ChatML model


def test_tools_against_a_template_without_tool_support(tiny_tokenizer):
    import torch

    torch.set_num_threads(1)
    from nanoforge.serve.app import create_app

    plain = Tokenizer(tiny_tokenizer.backend, chat_template=CHAT_TEMPLATE, config=tiny_tokenizer.config)
    assert not plain.supports_tools
    user = {"role": "user", "content": "hi"}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}]}
    with TestClient(create_app(random_model(seed=0), plain, "plain")) as client:
        refused = [({"messages": [user], "tools": [CALCULATOR_SCHEMA]}, "tools"),
                   ({"messages": [user, call, {"role": "tool", "content": "2"}]}, "messages[1]"),
                   ({"messages": [user, {"role": "tool", "content": "2"}]}, "messages[1]")]
        for body, param in refused:
            response = client.post("/v1/chat/completions", json={**body, "max_tokens": 4})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and "no tool support" in error["message"]
        # tools not offered (tool_choice none) need no support; a plain reply is returned as it is
        ok = client.post("/v1/chat/completions", json={"messages": [user], "tools": [CALCULATOR_SCHEMA],
                                                       "tool_choice": "none", "max_tokens": 8, "temperature": 0})
        assert ok.status_code == 200 and isinstance(ok.json()["choices"][0]["message"]["content"], str)


# ---------------------------------------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_tokenizer):
    run_dir = tool_run.make_tool_run(tmp_path_factory, tiny_tokenizer)
    proc = ServerProcess(run_dir, tmp_path_factory.mktemp("tool_server") / "server.log", "--api-key", KEY)
    yield proc
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def ask(a, op, b) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": tool_run.question(a, op, b)}]


def message_of(reply) -> dict:
    """A non-streamed reply's message as plain data (reasoning_content is an extra field of the client's)."""
    message = reply.choices[0].message
    return {"content": message.content or "", "reasoning_content": (message.model_extra or {}).get(
        "reasoning_content") or "", "calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
            "finish": reply.choices[0].finish_reason}


def streamed(client, **kwargs) -> tuple[dict, list, dict]:
    """(the message accumulated from the deltas, the raw tool-call deltas, usage) of a streamed reply."""
    out = {"content": "", "reasoning_content": "", "calls": [], "finish": None}
    raw_calls, usage = [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                raw_calls.append(call)
                out["calls"].append((call.function.name, call.function.arguments))
            out["finish"] = choice.finish_reason or out["finish"]
    return out, raw_calls, usage


def _calling_question(client, **kwargs):
    """The first question of tool_run.QUESTIONS whose greedy reply is a tool call (most are)."""
    for q in tool_run.QUESTIONS:
        reply = client.chat.completions.create(model="run", messages=ask(*q), tools=[CALCULATOR_SCHEMA],
                                               temperature=0, max_tokens=80, **kwargs)
        if reply.choices[0].message.tool_calls:
            return q, reply
    pytest.fail("the tool run wrote no tool call for any of its questions")


@slow
def test_tools_in_tool_calls_out_and_the_stream_equals_it(client):
    q, reply = _calling_question(client)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.content is None and message.role == "assistant"
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "calculator" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["expression"], str)
    again = client.chat.completions.create(model="run", messages=ask(*q), tools=[CALCULATOR_SCHEMA], temperature=0,
                                           max_tokens=80)
    assert again.choices[0].message.tool_calls[0].id != call.id, "call ids must be unique across replies"

    stream, raw_calls, usage = streamed(client, model="run", messages=ask(*q), tools=[CALCULATOR_SCHEMA],
                                        temperature=0, max_tokens=80)
    assert stream == message_of(reply)
    assert [(c.index, c.type) for c in raw_calls] == [(i, "function") for i in range(len(raw_calls))]
    assert all(c.id.startswith("call_") for c in raw_calls)
    assert usage.completion_tokens == reply.usage.completion_tokens
    assert usage.prompt_tokens == reply.usage.prompt_tokens


@slow
def test_the_full_round_trip_ends_in_an_answer(client):
    q, reply = _calling_question(client)
    call = reply.choices[0].message.tool_calls[0]
    result = run_tool_call(call.model_dump(), ["calculator"])
    assert not result.startswith("Error"), result
    messages = ask(*q) + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = client.chat.completions.create(model="run", messages=messages, tools=[CALCULATOR_SCHEMA], temperature=0,
                                           max_tokens=40)
    answer = final.choices[0].message
    assert answer.content.startswith("The answer is ") and not answer.tool_calls
    assert final.choices[0].finish_reason == "stop"
    stream, _, _ = streamed(client, model="run", messages=messages, tools=[CALCULATOR_SCHEMA], temperature=0,
                            max_tokens=40)
    assert stream == message_of(final)


@slow
def test_thinking_gives_reasoning_apart_from_the_content(client):
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    q, reply = _calling_question(client, extra_body=think)
    got = message_of(reply)
    assert got["reasoning_content"].startswith("I should compute ")
    assert not any(tag in got["reasoning_content"] + got["content"] for tag in ("<think>", "</think>", "<tool_call>"))
    assert got["calls"] and got["finish"] == "tool_calls"
    stream, _, _ = streamed(client, model="run", messages=ask(*q), tools=[CALCULATOR_SCHEMA], temperature=0,
                            max_tokens=80, extra_body=think)
    assert stream == got
    off = client.chat.completions.create(model="run", messages=ask(*q), tools=[CALCULATOR_SCHEMA], temperature=0,
                                         max_tokens=80, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert not (off.choices[0].message.model_extra or {}).get("reasoning_content")


@slow
def test_tool_choice_none_gives_no_tool_calls(client):
    q, _ = _calling_question(client)
    reply = client.chat.completions.create(model="run", messages=ask(*q), tools=[CALCULATOR_SCHEMA],
                                           tool_choice="none", temperature=0, max_tokens=40)
    assert not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert isinstance(reply.choices[0].message.content, str)
    stream, raw_calls, _ = streamed(client, model="run", messages=ask(*q), tools=[CALCULATOR_SCHEMA],
                                    tool_choice="none", temperature=0, max_tokens=40)
    assert raw_calls == [] and stream == message_of(reply)


def _user(**fields):
    return {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 4, **fields}


def _call_message(arguments):
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calculator", "arguments": arguments}}]}


FN = {"type": "function", "function": {"name": "f"}}
BAD_TOOL_REQUESTS = [
    # (name, body, param, words in the message)
    ("tools not a list", _user(tools={"type": "function"}), "tools", "list"),
    ("tool without a name", _user(tools=[FN, {"type": "function", "function": {"description": "x"}}]),
     "tools[1].function.name", "name"),
    ("tool name with a quote", _user(tools=[{"type": "function", "function": {"name": 'a"b'}}]),
     "tools[0].function.name", "letters"),
    ("tool of another type", _user(tools=[{"type": "retrieval"}]), "tools[0].type", "function"),
    ("parameters not an object", _user(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
     "tools[0].function.parameters", "object"),
    ("tool_choice required", _user(tools=[FN], tool_choice="required"), "tool_choice", "auto"),
    ("tool_choice a function", _user(tools=[FN], tool_choice={"type": "function", "function": {"name": "f"}}),
     "tool_choice", "auto"),
    ("tool_choice unknown", _user(tools=[FN], tool_choice="sometimes"), "tool_choice", "auto"),
    ("unknown template switch", _user(chat_template_kwargs={"reasoning": True}), "chat_template_kwargs.reasoning",
     "enable_thinking"),
    ("switch not a bool", _user(chat_template_kwargs={"enable_thinking": "yes"}),
     "chat_template_kwargs.enable_thinking", "true or false"),
    ("tool content a number", {"messages": [{"role": "user", "content": "q"}, _call_message("{}"),
                                            {"role": "tool", "content": 4}]}, "messages[2].content", "string"),
    ("arguments not JSON", {"messages": [{"role": "user", "content": "q"}, _call_message("{oops")]},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ("null content without calls", {"messages": [{"role": "user", "content": "q"},
                                                 {"role": "assistant", "content": None}]}, "messages[1].content", "null"),
    ("reasoning not a string", {"messages": [{"role": "assistant", "content": "a", "reasoning_content": 3}]},
     "messages[0].reasoning_content", "string"),
]


@slow
@pytest.mark.parametrize("name,body,param,words", BAD_TOOL_REQUESTS, ids=[b[0] for b in BAD_TOOL_REQUESTS])
def test_bad_tool_requests_get_a_400_naming_the_field(server, name, body, param, words):
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS and error["param"] == param and words in error["message"], error


@slow
def test_the_pages_tool_endpoints(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    run = server.url + "/v1/nanoforge/tools/run"
    assert httpx.post(run, json={"name": "calculator", "arguments": {"expression": "6*7"}}).status_code == 401
    assert httpx.post(run, json={"name": "calculator", "arguments": '{"expression": "6*7"}'},
                      headers=auth).json() == {"content": "42"}
    assert httpx.post(run, json={"name": "shell", "arguments": {"cmd": "ls"}}, headers=auth).json()[
        "content"].startswith("Error: unknown tool 'shell'")
    assert httpx.post(run, json={"name": "calculator", "arguments": {"expression": "__import__('os')"}},
                      headers=auth).json()["content"].startswith("Error")
    for bad in ({"arguments": {}}, [1], {"name": "calculator", "arguments": 5}):
        response = httpx.post(run, json=bad, headers=auth)
        assert response.status_code == 400 and set(response.json()["error"]) == ERROR_FIELDS
    listed = httpx.get(server.url + "/v1/nanoforge/tools", headers=auth).json()["data"]
    assert listed == [CALCULATOR_SCHEMA]


@slow
def test_a_plain_chatml_run_refuses_tools_over_http(tmp_path_factory, tiny_tokenizer):
    """The tool run's weights with a plain-ChatML tokenizer (as tokenizers trained before tool support have),
    served by its own process: the openai client gets a 400 that says why, and plain chat still works."""
    import shutil

    source = tool_run.make_tool_run(tmp_path_factory, tiny_tokenizer)
    plain_run = tmp_path_factory.mktemp("plain") / "plain"
    shutil.copytree(source, plain_run, ignore=shutil.ignore_patterns("trainer.pt", "tokenizer"))
    Tokenizer(tiny_tokenizer.backend, chat_template=CHAT_TEMPLATE, config=tiny_tokenizer.config).save(
        plain_run / "tokenizer")
    proc = ServerProcess(plain_run, plain_run.parent / "server.log")
    try:
        plain = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="no tool support") as refused:
            plain.chat.completions.create(model="plain", messages=ask(*tool_run.QUESTIONS[0]),
                                          tools=[CALCULATOR_SCHEMA], max_tokens=8)
        assert refused.value.body["param"] == "tools"
        reply = plain.chat.completions.create(model="plain", messages=ask(*tool_run.QUESTIONS[0]), max_tokens=8,
                                              temperature=0)
        assert isinstance(reply.choices[0].message.content, str) and not reply.choices[0].message.tool_calls
    finally:
        proc.stop()
