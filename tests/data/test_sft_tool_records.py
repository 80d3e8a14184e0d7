"""SFT with tool calls: MiniMind-3's records (tools, tool_calls, tool results, reasoning_content, null
content) validated with `file:line: field:` errors, prepared with the tokenizer's template (masks over whole
assistant turns), refused by a template without tool support, and `prepare --drop-empty-think`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nanoforge.chat.template import CHAT_TEMPLATE
from nanoforge.data.jsonl import DataError
from nanoforge.data.prepare import prepare_dataset
from nanoforge.data.sft_records import drops_empty_think
from nanoforge.data.shards import TokenShards
from nanoforge.core.errors import NanoforgeError
from nanoforge.chat.tokenizer import Tokenizer, load_tokenizer

from test_tokenizer import _masked_runs

ROOT = Path(__file__).resolve().parents[2]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"name": "add", "description": "a + b", "parameters": {"type": "object"}}]
SYSTEM = {"role": "system", "content": "You are a helpful assistant.", "tools": TOOLS}
USER = {"role": "user", "content": "Weather in Paris, and 1+2?"}
CALLS = {"role": "assistant", "content": None, "reasoning_content": "Two tools are needed.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                        {"name": "add", "arguments": {"a": 1, "b": 2}}]}
RESULTS = [{"role": "tool", "content": '{"temp": 12}'}, {"role": "tool", "content": "3"}]
ANSWER = {"role": "assistant", "content": "It is 12 degrees, and 1+2 = 3."}
TOOL_RECORDS = [
    [SYSTEM, USER, CALLS, *RESULTS, ANSWER],
    # tools as a JSON string, calls as a JSON string, a call again after the results, then the answer
    [{**SYSTEM, "tools": json.dumps(TOOLS)}, USER,
     {"role": "assistant", "content": "Let me check.", "tool_calls": json.dumps([{"name": "add", "arguments": {"a": 1}}])},
     {"role": "tool", "content": "1"},
     {"role": "assistant", "content": None, "tool_calls": [{"name": "get_weather", "arguments": {"city": "巴黎"}}]},
     {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny.", "reasoning_content": ""}],
    # no tools declared: any name may be called
    [{"role": "user", "content": "ping"}, {"role": "assistant", "content": None,
                                           "tool_calls": [{"name": "ping", "arguments": "{}"}]},
     {"role": "tool", "content": "pong"}, {"role": "assistant", "content": "pong"}],
]
PLAIN = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


def write_jsonl(path: Path, conversations) -> Path:
    path.write_text("".join(json.dumps({"conversations": c}, ensure_ascii=False) + "\n" for c in conversations),
                    encoding="utf-8")
    return path


@pytest.fixture(params=["tiny", "minimind"])
def tokenizer(request, tiny_tokenizer):
    """Our trained tiny tokenizer, and MiniMind-3's (skipped, saying why, without ../shared/data)."""
    if request.param == "tiny":
        return tiny_tokenizer
    return load_tokenizer(request.getfixturevalue("shared_data") / "minimind-tokenizer")


def prepared_docs(directory: Path):
    shards = TokenShards(directory, "train")
    return [shards.doc(i) for i in range(shards.num_docs)]


def assistant_spans(text: str) -> list[str]:
    """The assistant turns of a rendered conversation, found in the text: after each `<|im_start|>assistant\\n`
    through the `<|im_end|>` that closes it."""
    spans, at = [], text.find("<|im_start|>assistant\n")
    while at >= 0:
        start = at + len("<|im_start|>assistant\n")
        end = text.index("<|im_end|>", start) + len("<|im_end|>")
        spans.append(text[start:end])
        at = text.find("<|im_start|>assistant\n", end)
    return spans


def test_tool_records_prepare_with_masks_over_whole_assistant_turns(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "tools.jsonl", TOOL_RECORDS + [PLAIN])
    manifest = prepare_dataset("sft", data, tokenizer, tmp_path / "out", val_fraction=0, workers=1, log=lambda _: None)
    assert manifest["drop_empty_think"]["share"] == 0
    docs = prepared_docs(tmp_path / "out")
    assert len(docs) == len(TOOL_RECORDS) + 1
    for conversation, (tokens, mask) in zip(TOOL_RECORDS + [PLAIN], docs):
        text = tokenizer.render_text(conversation)
        assert tokenizer.decode(tokens.tolist()) == text
        if any(m.get("tool_calls") for m in conversation):
            assert "<tool_call>" in text and "<tool_response>" in text
        if conversation[0].get("tools"):
            assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # the system turn declares the tools
        # token by token: each masked run decodes to one whole assistant turn, in order, and nothing else
        runs = _masked_runs(tokens.tolist(), mask.tolist())
        assert [tokenizer.decode(r) for r in runs] == assistant_spans(text)
        assert len(runs) == sum(m["role"] == "assistant" for m in conversation)


# (messages of the bad record, field named in the error, words in the message)
BAD = [
    ([SYSTEM, USER, {**CALLS, "tool_calls": '[{"name": "add", "arguments": '}, *RESULTS, ANSWER],
     '"conversations"[2].tool_calls', "not valid JSON"),
    ([SYSTEM, USER, {**CALLS, "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{a: 1}"}}]},
      RESULTS[0], ANSWER], '"conversations"[2].tool_calls[0].function.arguments', "not valid JSON"),
    ([SYSTEM, USER, {**CALLS, "tool_calls": {"name": "add", "arguments": {}}}, RESULTS[0], ANSWER],
     '"conversations"[2].tool_calls', "must be a list of calls, got one object"),
    ([SYSTEM, USER, {**CALLS, "tool_calls": [{"arguments": {}}]}, RESULTS[0], ANSWER],
     '"conversations"[2].tool_calls[0]', 'missing "name"'),
    ([SYSTEM, USER, RESULTS[0], ANSWER], '"conversations"[2].role',
     'expected "assistant" after "user", got "tool" (a tool message answers a call in the tool_calls'),
    ([SYSTEM, USER, CALLS, *RESULTS, RESULTS[0], ANSWER], '"conversations"[5].role',
     "no more tool messages than the 2 tool_calls"),
    ([SYSTEM, USER, CALLS, USER, ANSWER], '"conversations"[3].role', 'expected "tool" after "assistant"'),
    ([SYSTEM, USER, {**CALLS, "tool_calls": [{"name": "delete_everything", "arguments": {}}]}, RESULTS[0], ANSWER],
     '"conversations"[2].tool_calls[0].name', '"delete_everything" is not a tool the record declares'),
    ([USER, {**ANSWER, "reasoning_content": ["no"]}], '"conversations"[1].reasoning_content',
     "must be a string, got a list"),
    ([USER, {"role": "assistant", "content": None}], '"conversations"[1].content',
     "must be a string, got null (null is allowed only in an assistant message with tool_calls)"),
    ([USER, {**RESULTS[0], "content": None}], '"conversations"[1].content', "must be a string, got null"),
    ([SYSTEM, USER, CALLS, *RESULTS], '"conversations"', 'must end with an assistant message, ends with "tool"'),
    ([{**USER, "tools": TOOLS}, ANSWER], '"conversations"[0].tools', "only the opening system message declares"),
]


@pytest.mark.parametrize("messages,field,words", BAD, ids=[f"{b[1]}-{b[2][:24]}" for b in BAD])
def test_bad_tool_records_name_file_line_and_field(tmp_path, tiny_tokenizer, messages, field, words):
    data = write_jsonl(tmp_path / "bad.jsonl", [TOOL_RECORDS[0], PLAIN, messages, PLAIN])
    with pytest.raises(DataError) as caught:
        prepare_dataset("sft", data, tiny_tokenizer, tmp_path / "out", val_fraction=0, workers=1, log=lambda _: None)
    assert str(caught.value).startswith(f"{data}:3: {field}: "), str(caught.value)
    assert words in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_cli_prepare_reports_an_undeclared_tool(tmp_path, tiny_tokenizer_dir):
    data = write_jsonl(tmp_path / "in.jsonl", [TOOL_RECORDS[0], BAD[7][0]])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "nanoforge", "prepare", "--kind", "sft", "--data", str(data),
                           "--tokenizer", str(tiny_tokenizer_dir), "--out", str(tmp_path / "out"), "--workers", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f'error: {data}:2: "conversations"[2].tool_calls[0].name: "delete_everything" is not a tool the record '
        "declares (in the system message's tools: add, get_weather)")
    assert "Traceback" not in done.stderr


def test_a_template_without_tool_support_refuses_tool_records(tmp_path, tiny_tokenizer):
    old = Tokenizer(tiny_tokenizer.backend, chat_template=CHAT_TEMPLATE)  # plain ChatML: no tools
    data = write_jsonl(tmp_path / "plain.jsonl", [PLAIN])
    prepare_dataset("sft", data, old, tmp_path / "ok", val_fraction=0, workers=1, log=lambda _: None)
    for i, record in enumerate(TOOL_RECORDS):  # with and without null content
        data = write_jsonl(tmp_path / f"tools{i}.jsonl", [PLAIN, record])
        with pytest.raises(DataError) as caught:
            prepare_dataset("sft", data, old, tmp_path / "out", val_fraction=0, workers=1, log=lambda _: None)
        message = str(caught.value)
        assert message.startswith(f'{data}:2: "conversations": the tokenizer\'s chat template has no tool support')
        assert "tool calls and tool results" in message and "nanoforge tokenizer train" in message
        assert "MiniMind-3's tokenizer" in message


def test_drop_empty_think_share_is_seeded_and_deterministic(tmp_path, tokenizer):
    reasoned = [{"role": "user", "content": "why?"}, {"role": "assistant", "content": "because", "reasoning_content": "I know."}]
    records = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
               for i in range(80)] + [reasoned, TOOL_RECORDS[0]]
    data = write_jsonl(tmp_path / "sft.jsonl", records)
    share = 0.4
    manifest = prepare_dataset("sft", data, tokenizer, tmp_path / "a", val_fraction=0, workers=1,
                               drop_empty_think=share, log=lambda _: None)
    assert manifest["drop_empty_think"]["share"] == share
    docs = prepared_docs(tmp_path / "a")
    plain = Tokenizer(tokenizer.backend, chat_template=CHAT_TEMPLATE, config=tokenizer.config)
    dropped = [drops_empty_think(share, 0, line) for line in range(1, len(records) + 1)]
    assert 20 <= sum(dropped[:80]) <= 44  # about 40% of 80
    for conversation, (tokens, mask), drop in zip(records[:80], docs, dropped):
        think_ids, think_mask = tokenizer.render_chat(conversation)
        if drop:  # exactly the plain ChatML render: same ids, same mask
            assert (tokens.tolist(), mask.tolist()) == plain.render_chat(conversation)
        else:
            assert (tokens.tolist(), mask.tolist()) == (think_ids, think_mask)
    # a turn with reasoning keeps its think block whatever the draw; a dropped tool record loses only empty ones
    every = prepare_dataset("sft", data, tokenizer, tmp_path / "all", val_fraction=0, workers=1,
                            drop_empty_think=1.0, log=lambda _: None)
    assert every["drop_empty_think"]["share"] == 1.0
    texts = [tokenizer.decode(t.tolist()) for t, _ in prepared_docs(tmp_path / "all")]
    assert all("<think>" not in text for text in texts[:80])
    assert "<think>\nI know.\n</think>\n\n" in texts[80]
    assert "<think>\nTwo tools are needed.\n</think>" in texts[81] and "<think>\n\n</think>" not in texts[81]
    # deterministic: again, with other chunks, the same tokens
    prepare_dataset("sft", data, tokenizer, tmp_path / "b", val_fraction=0, workers=1, drop_empty_think=share,
                    chunk_bytes=256, log=lambda _: None)
    for (a, ma), (b, mb) in zip(docs, prepared_docs(tmp_path / "b")):
        assert np.array_equal(a, b) and np.array_equal(ma, mb)


def test_drop_empty_think_is_checked(tmp_path, tiny_tokenizer):
    data = write_jsonl(tmp_path / "sft.jsonl", [PLAIN])  # (its range: cli.number, tests/test_cli.py)
    with pytest.raises(NanoforgeError, match="sft records only"):
        prepare_dataset("pretrain", data, tiny_tokenizer, tmp_path / "out", drop_empty_think=0.5)
