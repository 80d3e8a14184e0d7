"""chat/replies.py: a reply -> reasoning, content, tool calls; the template round trip with the real tokenizer;
the stream parser against the whole-text parse over many splittings."""
import json
import random

import pytest

from nanoforge.chat.replies import StreamParser, parse_reply, reply_from_events

CALL_A = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 / 2"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "weather", "arguments": {"city": "北京", "days": 2}}\n</tool_call>'


def _render_reply(tok, message, thinking_open):
    """The reply text the template implies for `message`: its render minus the prompt and the closing tag."""
    prompt = tok.render_text([{"role": "user", "content": "q"}], True, open_thinking=thinking_open)
    full = tok.render_text([{"role": "user", "content": "q"}, message])
    assert full.startswith(prompt) and full.endswith("<|im_end|>\n")
    return full[len(prompt):-len("<|im_end|>\n")]


def _as_message(reply):
    message = {"role": "assistant", "content": reply.content}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return message


ROUND_TRIPS = [
    # (reply text, thinking_open)
    ("Let me add.\nTwo steps.\n</think>\n\nI will call two tools.\n" + CALL_A + "\n" + CALL_B, True),
    ("\n</think>\n\n" + CALL_A + "\n" + CALL_B, True),
    ("思考一下。\n</think>\n\n你好！这是答案：24。", True),
    ("Just the answer, 24.", False),
    (CALL_A + "\n" + CALL_B, False),
    ("Calling.\n" + CALL_A, False),
]


@pytest.mark.parametrize("text,thinking_open", ROUND_TRIPS)
def test_round_trip_through_the_template(tiny_tokenizer, text, thinking_open):
    reply = parse_reply(text, thinking_open)
    assert reply.errors == []
    assert _render_reply(tiny_tokenizer, _as_message(reply), thinking_open) == text


def test_reasoning_content_and_two_calls():
    reply = parse_reply(ROUND_TRIPS[0][0], True)
    assert reply.reasoning == "Let me add.\nTwo steps."
    assert reply.content == "I will call two tools."
    assert [c["id"] for c in reply.tool_calls] == ["call_0", "call_1"]
    assert reply.tool_calls[0] == {"id": "call_0", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "48 / 2"}'}}
    assert json.loads(reply.tool_calls[1]["function"]["arguments"]) == {"city": "北京", "days": 2}


def test_only_calls_and_only_content():
    reply = parse_reply(CALL_A + "\n" + CALL_B, False)
    assert (reply.reasoning, reply.content, len(reply.tool_calls)) == (None, "", 2)
    reply = parse_reply("\n</think>\n\nhello", True)
    assert (reply.reasoning, reply.content, reply.tool_calls) == ("", "hello", [])


def test_think_block_at_the_head_without_open_thinking():
    reply = parse_reply("<think>\nhmm\n</think>\n\nanswer", False)
    assert (reply.reasoning, reply.content) == ("hmm", "answer")
    later = parse_reply("answer <think>x</think>", False)
    assert (later.reasoning, later.content) == (None, "answer <think>x</think>")


def test_unclosed_think_is_all_reasoning():
    reply = parse_reply("still thinking\n", True)
    assert (reply.reasoning, reply.content) == ("still thinking", "")


def test_id_prefix():
    reply = parse_reply(CALL_A + "\n" + CALL_B, False, id_prefix="call_x7_")
    assert [c["id"] for c in reply.tool_calls] == ["call_x7_0", "call_x7_1"]


def test_arguments_as_json_string_and_missing():
    text = ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>\n'
            '<tool_call>\n{"name": "g"}\n</tool_call>\n<tool_call>{"arguments":{"b":2},"name":"h"}</tool_call>')
    calls = parse_reply(text, False).tool_calls
    assert [c["function"]["arguments"] for c in calls] == ['{"a": 1}', "{}", '{"b": 2}']


@pytest.mark.parametrize("block,why", [
    ("<tool_call>\nnot json\n</tool_call>", "not valid JSON"),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', "no string 'name'"),
    ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', "must be an object"),
    ('<tool_call>\n{"name": "f", "arguments": "nope"}\n</tool_call>', "not JSON"),
    ('<tool_call>\n["f"]\n</tool_call>', "JSON object"),
    ('<tool_call>\n{"name": "f", "argu', "not closed"),
])
def test_malformed_calls_are_errors_and_not_content(block, why):
    reply = parse_reply("Before.\n" + block + "\n" + CALL_A, False)
    if "not closed" in why:
        reply = parse_reply("Before.\n" + CALL_A + "\n" + block, False)
    assert len(reply.errors) == 1 and why in reply.errors[0]
    assert reply.content == "Before."
    assert [c["function"]["name"] for c in reply.tool_calls] == ["calculator"]
    assert reply.tool_calls[0]["id"] == "call_0"


def test_text_after_a_call_and_stray_closer_stay_content():
    reply = parse_reply("a\n" + CALL_A + " then b </tool_call>", False)
    assert reply.content == "a then b </tool_call>"


STREAM_REPLIES = [
    (ROUND_TRIPS[0][0], True),
    ("推理：先算 48/2。\n\n</think>\n\n答案是 24。\n" + CALL_A + "\n" + CALL_B, True),
    ("<think>\n想一想\n</think>\n\n" + CALL_B, False),
    ("<thinking is not a tag> and <tool not a call either\n\n<tool_call", False),
    ("x\n" + CALL_A + "\n<tool_call>\nbroken\n</tool_call>\ntail\n<tool_call>\n{\"name\": \"f\"", False),
    ("a </th b \n\n</thin\n", True),
    ("\n\n<thi", False),
]


def _stream(text, thinking_open, cuts):
    parser = StreamParser(thinking_open)
    events, last = [], 0
    for cut in cuts + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    events += parser.close()
    return events, parser


@pytest.mark.parametrize("text,thinking_open", STREAM_REPLIES)
def test_stream_equals_whole_parse_over_random_splits(text, thinking_open):
    whole = parse_reply(text, thinking_open)
    rng = random.Random(len(text))
    splittings = [[i] for i in range(1, len(text))]  # every single cut: every tag split at every position
    splittings += [sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
                   for _ in range(200)]
    splittings.append(list(range(1, len(text))))  # one character at a time
    for cuts in splittings:
        events, parser = _stream(text, thinking_open, cuts)
        assert reply_from_events(events, parser.saw_think) == whole, cuts


def test_stream_holds_a_split_tag_then_releases_a_false_one():
    parser = StreamParser(False)
    assert parser.feed("Hi <tool") == [("content", "Hi ")]
    assert parser.feed("box> ok") == [("content", "<toolbox> ok")]
    assert parser.feed("\n<tool_") == []
    assert parser.feed('call>\n{"name": "f", "arguments": {}}\n</tool_call>') == [
        ("tool_call", {"index": 0, "id": "call_0", "name": "f", "arguments": "{}"})]
    thinking = StreamParser(True)
    assert thinking.feed("r\n</th") == [("reasoning", "r")]
    assert thinking.feed("ink>\n\nok") == [("content", "ok")]
    assert thinking.close() == []


def test_feed_after_close_is_refused():
    parser = StreamParser(False)
    parser.close()
    with pytest.raises(ValueError):
        parser.feed("x")
