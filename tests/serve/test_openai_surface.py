"""The OpenAI surface of `nanoforge serve` (issue 45 d): several prompts (strings or token ids), `n`, `echo`,
`max_tokens: 0`, log-probs on both endpoints, `logit_bias`, and every field it refuses. A real uvicorn process
on the tiny trained run (--max-batch 4), driven by the official `openai` client (httpx where it cannot say the
request); log-probs are checked against a fresh forward of the same checkpoint here, choices against single
requests with the seeds the engine gives each sample."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="the serving tests need the `openai` client (pip install openai)")
httpx = pytest.importorskip("httpx", reason="the serving tests need httpx")
pytest.importorskip("fastapi", reason="serving needs fastapi and uvicorn (pip install fastapi uvicorn)")
pytest.importorskip("uvicorn", reason="serving needs fastapi and uvicorn (pip install fastapi uvicorn)")
import torch  # noqa: E402

from nanoforge.infer.engine.sampler import seed_for  # noqa: E402
from nanoforge.infer.generate import complete  # noqa: E402

from test_server import ERROR_FIELDS, ServerProcess, local, run_dir, server_cfg  # noqa: E402,F401

MAX_BATCH = 4
MESSAGES = [{"role": "user", "content": "Tell me a story about a little robot."}]
PLAIN = {"repetition_penalty": 1.0}  # the server's default 1.1 changes the distribution log-probs are read from


@pytest.fixture(scope="module")
def server(run_dir, tmp_path_factory):
    proc = ServerProcess(run_dir, tmp_path_factory.mktemp("surface") / "server.log", "--max-batch", str(MAX_BATCH))
    yield proc
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def forward_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """(len(ids), V): row t is log_softmax(logits / T) of the token after ids[t], from one full forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def token_bytes(token: str) -> bytes:
    """A legacy log-probs token back to its bytes (`bytes:\\xe4\\xbd` for part of a character)."""
    if token.startswith("bytes:"):
        return bytes.fromhex(token[6:].replace("\\x", ""))
    return token.encode("utf-8")


def expected_string(tok, token: int) -> str:
    text = tok.decode([token])
    return text if "\ufffd" not in text else "bytes:"  # a token holding part of a character: only the prefix


def check_token_strings(tok, strings: list[str], ids: list[int]) -> None:
    assert len(strings) == len(ids)
    for string, token in zip(strings, ids):
        assert string.startswith(expected_string(tok, token)), (string, token)


def assert_same_entries(entries, others) -> None:
    """Chat log-prob entries equal in their tokens, and in their log-probs up to float rounding."""
    def flat(items) -> tuple[list, list]:
        rows = [(e.token, e.bytes, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in items]
        return ([(token, data, [t for t, _ in top]) for token, data, _, top in rows],
                [v for _, _, logprob, top in rows for v in [logprob] + [lp for _, lp in top]])

    (tokens, values), (other_tokens, other_values) = flat(entries), flat(others)
    assert tokens == other_tokens and values == pytest.approx(other_values, abs=1e-5)


# ------------------------------------------------------------------------------------- /v1/completions


def test_echo_and_logprobs_match_a_fresh_forward(client, local):
    model, tok = local
    prompt = "Once upon a time"
    ids = tok.encode(prompt)
    reply = client.completions.create(model="run", prompt=prompt, echo=True, logprobs=3, max_tokens=8, temperature=0,
                                      extra_body=PLAIN)
    done = complete(model, tok, [ids], server_cfg(temperature=0, max_new_tokens=8, **PLAIN), tok.stop_ids)[0]
    choice = reply.choices[0]
    assert choice.text == prompt + done.text and choice.finish_reason == done.finish_reason
    stop = [done.stop_id] if done.stop_id is not None else []
    every = ids + done.token_ids + stop
    lp = choice.logprobs
    check_token_strings(tok, lp.tokens, every)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = forward_logprobs(model, every)
    for i in range(1, len(every)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, every[i]].item(), abs=1e-4)
        values, top = ref[i - 1].topk(3)
        expected = {tok.decode([t]): v for t, v in zip(top.tolist(), values.tolist())}
        for string, value in expected.items():
            if "\ufffd" not in string:
                assert lp.top_logprobs[i][string] == pytest.approx(value, abs=1e-4)
        assert lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
        assert len(lp.top_logprobs[i]) in (3, 4)  # the 3 most likely, and the chosen one
    text_tokens = lp.tokens[:len(every) - len(stop)]
    assert b"".join(map(token_bytes, text_tokens)).decode("utf-8", "replace") == choice.text
    for string, offset in zip(text_tokens, lp.text_offset):
        if not string.startswith("bytes:"):
            assert choice.text[offset:offset + len(string)] == string
    assert lp.text_offset[len(text_tokens):] == [len(choice.text)] * len(stop)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(done.token_ids)


def test_a_stop_string_cuts_the_logprobs_and_the_stream_joins_to_the_whole(client):
    kwargs = dict(model="run", prompt="The little robot", logprobs=2, max_tokens=16, temperature=0, extra_body=PLAIN)
    base = client.completions.create(**kwargs).choices[0].text
    stop = next(base[i:i + 3] for i in range(3, len(base) - 3) if base[i:i + 3].strip() == base[i:i + 3])
    whole = client.completions.create(stop=stop, echo=True, **kwargs).choices[0]
    cut = "The little robot" + base[:base.index(stop)]
    assert (whole.text, whole.finish_reason) == (cut, "stop")
    lp = whole.logprobs
    assert all(offset < len(cut) for offset in lp.text_offset), "no token starting after the cut"
    assert b"".join(map(token_bytes, lp.tokens)).decode("utf-8", "replace").startswith(cut)
    text, keys = "", ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    joined = {key: [] for key in keys}
    for chunk in client.completions.create(stream=True, stop=stop, echo=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            for key in keys:
                joined[key] += getattr(choice.logprobs, key)
    assert text == whole.text
    assert joined == {key: getattr(lp, key) for key in keys}


def test_token_id_prompts_scored_as_lm_eval_harness_does(server, local):
    """lm-evaluation-harness sends token ids, echo, logprobs 1 and max_tokens 0 or 1, and reads the prompt's
    log-probs (the first null) and whether each continuation token was the greedy one."""
    model, tok = local
    context = tok.encode("Once upon a time")
    greedy = complete(model, tok, [context], server_cfg(temperature=0, max_new_tokens=3, **PLAIN), [])[0].token_ids
    prompts = [context + greedy, tok.encode("The robot counts the stars")]
    scored = post(server, "/v1/completions", {"model": "run", "prompt": prompts, "echo": True, "logprobs": 1,
                                               "max_tokens": 0, "temperature": 0.7}).json()
    assert scored["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 0,
                               "total_tokens": sum(map(len, prompts))}
    for prompt, choice in zip(prompts, scored["choices"]):
        assert choice["text"] == tok.decode(prompt) and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(prompt)
        ref = forward_logprobs(model, prompt)  # prompt log-probs are the model's own (T = 1), whatever the temperature
        assert lp["token_logprobs"][1:] == pytest.approx([ref[i - 1, prompt[i]].item()
                                                          for i in range(1, len(prompt))], abs=1e-4)
    payload = {"model": "run", "prompt": prompts[0], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
               "seed": 1234}
    lp = post(server, "/v1/completions", payload).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(prompts[0]) + 1  # the prompt, then the one generated token (read as [ctx:-1])
    continuation = range(len(context), len(prompts[0]))
    assert all(lp["tokens"][i] == max(lp["top_logprobs"][i], key=lp["top_logprobs"][i].get) for i in continuation)


def test_several_prompts_and_n_equal_single_requests_with_their_seeds(client):
    prompts = ["Once upon a time", "The little robot"]
    kwargs = dict(model="run", temperature=1.0, max_tokens=10, extra_body=PLAIN)
    reply = client.completions.create(prompt=prompts, n=2, seed=7, **kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(prompt=prompts[k // 2], seed=seed_for(7, k % 2), **kwargs) for k in range(4)]
    assert [c.text for c in reply.choices] == [s.choices[0].text for s in singles]
    assert reply.choices[0].text != reply.choices[1].text, "two samples of one prompt should differ"
    assert reply.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles[::2])
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    texts, usage = ["", "", "", ""], None
    for chunk in client.completions.create(prompt=prompts, n=2, seed=7, stream=True,
                                           stream_options={"include_usage": True}, **kwargs):
        assert len(chunk.choices) <= 1
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in reply.choices] and usage == reply.usage


def test_logit_bias_steers_every_token(client, local):
    model, tok = local
    prompt, favourite = "Once upon a time", tok.encode(" robot")[-1]
    kwargs = dict(model="run", prompt=prompt, max_tokens=5, temperature=0, logprobs=0, extra_body=PLAIN)
    pushed = client.completions.create(logit_bias={str(favourite): 100}, **kwargs).choices[0]
    assert pushed.logprobs.tokens == [tok.decode([favourite])] * 5
    first = complete(model, tok, [tok.encode(prompt)], server_cfg(temperature=0, max_new_tokens=1, **PLAIN),
                     [])[0].token_ids[0]
    banned = client.completions.create(logit_bias={str(first): -100}, **kwargs).choices[0]
    plain = client.completions.create(**kwargs).choices[0]
    assert plain.logprobs.tokens[0] == tok.decode([first]) != banned.logprobs.tokens[0]


def test_ignore_eos_runs_past_the_stop_tokens(client, local):
    """vLLM's extension, which load benchmarks send: the reply ends at max_tokens only."""
    model, tok = local
    stop = tok.im_end_id
    kwargs = dict(model="run", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=0, extra_body=PLAIN)
    stopped = client.completions.create(logit_bias={str(stop): 100}, **kwargs).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == ""
    ignored = client.completions.create(logit_bias={str(stop): 100}, **{**kwargs, "extra_body": {
        **PLAIN, "ignore_eos": True}}).choices[0]
    assert ignored.finish_reason == "length" and ignored.logprobs.tokens == [tok.decode([stop])] * 6


# ------------------------------------------------------------------------------------------------ chat


def test_chat_n_and_logprobs_match_single_requests_and_a_fresh_forward(client, local):
    model, tok = local
    prompt_ids, _ = tok.render_chat(MESSAGES, add_generation_prompt=True)
    kwargs = dict(model="run", messages=MESSAGES, temperature=0.8, max_tokens=12, logprobs=True, top_logprobs=2,
                  extra_body=PLAIN)
    reply = client.chat.completions.create(n=3, seed=5, **kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        seed = seed_for(5, choice.index)
        single = client.chat.completions.create(seed=seed, **kwargs).choices[0]
        assert choice.message.content == single.message.content
        assert_same_entries(choice.logprobs.content, single.logprobs.content)  # batched: equal up to rounding
        done = complete(model, tok, [prompt_ids], server_cfg(temperature=0.8, max_new_tokens=12, **PLAIN),
                        tok.stop_ids, seeds=[seed])[0]
        content = choice.logprobs.content
        assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == done.text
        check_token_strings(tok, [e.token for e in content], done.token_ids)
        ref = forward_logprobs(model, prompt_ids + done.token_ids, temperature=0.8)
        for k, entry in enumerate(content):
            row = ref[len(prompt_ids) + k - 1]
            assert entry.logprob == pytest.approx(row[done.token_ids[k]].item(), abs=1e-4)
            values, top = row.topk(2)
            assert [e.logprob for e in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
            check_token_strings(tok, [e.token for e in entry.top_logprobs], top.tolist())
            for e in [entry, *entry.top_logprobs]:
                assert e.token.startswith("bytes:") or bytes(e.bytes) == e.token.encode("utf-8")
    assert len({c.message.content for c in reply.choices}) > 1
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)


def test_chat_streams_n_choices_with_their_logprobs(client):
    kwargs = dict(model="run", messages=MESSAGES, temperature=1.0, max_tokens=10, n=2, seed=9, logprobs=True,
                  top_logprobs=1)
    whole = client.chat.completions.create(**kwargs)
    content, entries, finish = ["", ""], [[], []], [None, None]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content[choice.index] += choice.delta.content or ""
            entries[choice.index] += choice.logprobs.content if choice.logprobs else []
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    for i, choice in enumerate(whole.choices):
        assert content[i] == choice.message.content and finish[i] == choice.finish_reason
        assert_same_entries(entries[i], choice.logprobs.content)


def test_chat_logit_bias(client, local):
    _, tok = local
    favourite = tok.encode(" robot")[-1]
    reply = client.chat.completions.create(model="run", messages=MESSAGES, temperature=0, max_tokens=4,
                                           logit_bias={str(favourite): 100}, logprobs=True)
    assert [e.token for e in reply.choices[0].logprobs.content] == [tok.decode([favourite])] * 4


# ---------------------------------------------------------------------------------------------- refusals


def _chat(**fields) -> tuple:
    return "/v1/chat/completions", {"model": "run", "messages": [{"role": "user", "content": "hi"}], **fields}


def _text(**fields) -> tuple:
    return "/v1/completions", {"model": "run", "prompt": fields.pop("prompt", "hi"), **fields}


TOOL = {"type": "function", "function": {"name": "calculator"}}
REFUSED = [
    # (request, the param named)
    (_chat(response_format={"type": "json_object"}), "response_format"),
    (_chat(functions=[{"name": "f"}]), "functions"),
    (_chat(function_call="auto"), "function_call"),
    (_chat(audio={"voice": "alloy", "format": "mp3"}), "audio"),
    (_chat(prediction={"type": "content", "content": "x"}), "prediction"),
    (_chat(reasoning_effort="low"), "reasoning_effort"),
    (_chat(verbosity="low"), "verbosity"),
    (_chat(web_search_options={}), None),  # an empty object sets nothing: accepted
    (_chat(web_search_options={"search_context_size": "low"}), "web_search_options"),
    (_chat(presence_penalty=0.5), "presence_penalty"),
    (_chat(moderation={"model": "x"}), "moderation"),
    (_chat(modalities=["text", "audio"]), "modalities"),
    (_chat(store=True), "store"),
    (_chat(service_tier="flex"), "service_tier"),
    (_chat(metadata={"a": 1}), "metadata"),
    (_chat(parallel_tool_calls=False, tools=[TOOL]), "parallel_tool_calls"),
    (_chat(logprobs=1), "logprobs"),
    (_chat(logprobs="yes"), "logprobs"),
    (_chat(top_logprobs=2), "top_logprobs"),
    (_chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (_chat(n=MAX_BATCH + 1), "n"),
    (_chat(n=0), "n"),
    (_chat(best_of=2), "best_of"),
    (_chat(echo=True), "echo"),
    (_chat(suffix="x"), "suffix"),
    (_chat(min_p=0.1), "min_p"),
    (_chat(stream=True, stream_options={"foo": True}), "stream_options.foo"),
    (_chat(logit_bias={"abc": 1}), "logit_bias"),
    (_chat(logit_bias={"99999": 1}), "logit_bias"),
    (_chat(logit_bias={"5": 101}), "logit_bias"),
    (_chat(logit_bias={"5": "x"}), "logit_bias"),
    (_chat(logit_bias=[5]), "logit_bias"),
    (_chat(messages=[{"role": "user", "content": "hi", "name": "bob"}]), "messages[0].name"),
    (_chat(messages=[{"role": "user", "content": "hi", "extra": 1}]), "messages[0].extra"),
    (_chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no", "refusal": "no"}]),
     "messages[1].refusal"),
    (_chat(messages=[{"role": "user", "content": "hi", "name": None, "audio": None}]), None),
    (_text(suffix="x"), "suffix"),
    (_text(best_of=2), "best_of"),
    (_text(logprobs=6), "logprobs"),
    (_text(logprobs=True), "logprobs"),
    (_text(echo="yes"), "echo"),
    (_text(max_tokens=0), "max_tokens"),
    (_text(n=MAX_BATCH + 1), "n"),
    (_text(ignore_eos="yes"), "ignore_eos"),
    (_text(logit_bias={"1": -101}), "logit_bias"),
    (_text(top_logprobs=2), "top_logprobs"),
    (_text(prompt=[]), "prompt"),
    (_text(prompt=[[]]), "prompt[0]"),
    (_text(prompt=[1, 99999]), "prompt"),
    (_text(prompt=[[1, 2], [3, -1]]), "prompt[1]"),
    (_text(prompt=[True]), "prompt[0]"),
    (_text(prompt=[[1.5]]), "prompt[0]"),
    (_text(prompt=["a", 5]), "prompt[1]"),
    (_text(prompt=[[1] * 200]), "prompt[0]"),
    (_text(prompt=["a"] * 300), "prompt"),
]


@pytest.mark.parametrize("request_,param", REFUSED, ids=[f"{r[0][4:]}-{json.dumps(r[1])[:60]}" for r, _ in REFUSED])
def test_unsupported_fields_get_a_400_naming_them(server, request_, param):
    path, body = request_
    response = post(server, path, body)
    if param is None:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS and error["param"] == param and error["type"] == "invalid_request_error"
    if body.get("prompt") == [[1] * 200]:
        assert error["code"] == "context_length_exceeded"


def test_harmless_fields_are_accepted(client):
    reply = client.chat.completions.create(
        model="run", messages=MESSAGES, max_tokens=2, user="u1", metadata={"k": "v"}, store=False,
        service_tier="auto", prompt_cache_key="c", safety_identifier="s", modalities=["text"],
        response_format={"type": "text"}, parallel_tool_calls=True, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False})
    assert any(chunk.usage for chunk in reply)
    text = client.completions.create(model="run", prompt="hi", max_tokens=2, user="u1", suffix="", best_of=2, n=2)
    assert len(text.choices) == 2
    assert client.completions.create(model="run", prompt="hi", max_tokens=2, best_of=1).choices
