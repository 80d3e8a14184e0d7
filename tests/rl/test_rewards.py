"""RL rewards: the built-ins, the user's own, their sum, the agent reward and a local reward model."""
from __future__ import annotations

import json
import math

import pytest
import torch

from nanoforge.core.errors import NanoforgeError
from nanoforge.rl.reward_model import load_reward_model
from nanoforge.rl.rewards import (AgentTurns, agent_reward, agent_reward_parts, answer_found, answer_number,
                                  combine, format_reward, length_reward, math_reward, parse_rewards, parse_weights,
                                  repetition_reward)

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'


def test_answer_number_takes_the_number_after_hashes_else_the_last():
    assert answer_number("so 3 + 4 = 7\n#### 1,072 apples, not 5") == 1072
    assert answer_number("first 3, then 18.0") == answer_number("18")
    assert answer_number("it is -5.") == -5
    assert answer_number("no digits here") is None and answer_number("#### none") is None


@pytest.mark.parametrize("reply, answer, expected", [
    ("The total is 18.", "18", 1.0),
    ("#### 18.0", "18", 1.0),
    ("So 1,072 in all", "Natalia ... = <<48+24=72>>\n#### 1,072", 1.0),
    ("#### 18, not 20", "18", 1.0),
    ("18 at first, finally 20", "18", 0.0),
    ("<think>\nmaybe 20\n</think>\n\nIt is 18", "18", 1.0),
    ("<think>\nIt is 18\n</think>\n\nno idea", "18", 0.0),  # a number only in the thinking does not count
    ("", "18", 0.0),
])
def test_math_reward(reply, answer, expected):
    assert math_reward(reply, {"answer": answer}) == expected


def test_math_reward_with_open_thinking_and_its_errors():
    assert math_reward("maybe 20\n</think>\n\n18", {"answer": "18", "thinking_open": True}) == 1.0
    assert math_reward("maybe 18 or so", {"answer": "18", "thinking_open": True}) == 0.0  # never left the thinking
    with pytest.raises(NanoforgeError, match=r'needs an "answer".*data.jsonl:7'):
        math_reward("18", {"answer": None, "_where": "data.jsonl:7"})
    with pytest.raises(NanoforgeError, match="needs a number"):
        math_reward("18", {"answer": "Paris"})


@pytest.mark.parametrize("reply, thinking_open, expected", [
    ("Plain answer.", False, 1.0),
    ("<think>\nhmm\n</think>\n\nAnswer.", False, 1.0),
    ("hmm\n</think>\n\nAnswer.", True, 1.0),
    ("\n\n" + CALL, False, 1.0),  # a reply that only calls a tool
    ("<think>\nhmm\n</think>\n\n" + CALL, False, 1.0),
    ("<think>\nhmm\n</think>\n\n", False, 0.0),  # nothing after the thinking
    ("<think>\nhmm, never closed", False, 0.0),
    ("Answer.</think>", False, 0.0),
    ("Answer. <think>late</think>", False, 0.0),
    ("<think>a</think><think>b</think>Answer.", False, 0.0),
    ("Answer.", True, 0.0),  # the open think block was never closed
    ("<think>\nhmm\n</think>\n\nAnswer.", True, 0.0),  # a second <think>
    ("<tool_call>\n{not json}\n</tool_call>", False, 0.0),
    ("Answer.\n<tool_call>\n{\"name\": \"calculator\"", False, 0.0),  # unclosed block
    ("Answer.</tool_call>", False, 0.0),  # stray closer
])
def test_format_reward(reply, thinking_open, expected):
    assert format_reward(reply, {"thinking_open": thinking_open}) == expected


def test_length_reward_penalises_empty_truncated_and_budget_end():
    assert length_reward("  \n", {}) == -0.5
    assert length_reward("fine", {"truncated": True}) == -0.5
    assert length_reward("fine", {}) == 0.0
    budget = {"max_new_tokens": 100}
    assert length_reward("fine", {**budget, "reply_tokens": 50}) == 0.0
    assert length_reward("fine", {**budget, "reply_tokens": 90}) == 0.0
    assert length_reward("fine", {**budget, "reply_tokens": 95}) == pytest.approx(-0.25)
    assert length_reward("fine", {**budget, "reply_tokens": 100}) == pytest.approx(-0.5)


def test_repetition_reward_is_minus_the_share_of_repeated_trigrams():
    assert repetition_reward("the cat sat on the mat today", {}) == 0.0
    assert repetition_reward("a b c a b c a b c", {}) == pytest.approx(-(1 - 3 / 7))  # 7 trigrams, 3 distinct
    assert repetition_reward("哈哈哈哈哈", {}) == pytest.approx(-(1 - 1 / 3))  # by character
    assert repetition_reward("two words", {}) == 0.0


# ---------------------------------------------------------------------------------------------- choosing


def test_parse_rewards_builtins_and_errors():
    assert [name for name, _ in parse_rewards("math, format,length,repetition")] == ["math", "format", "length",
                                                                                      "repetition"]
    for spec, message in [("", "no reward given"), ("maths", "unknown reward 'maths'"),
                          ("math,math", "given twice"), ("no_such_module_xyz:fn", "cannot import"),
                          ("nanoforge.rl.rewards:nope", "has no 'nope'"),
                          ("nanoforge.rl.rewards:LENGTH_PENALTY", "not a function"),
                          ("missing/file.py:fn", "no such file")]:
        with pytest.raises(NanoforgeError, match=message):
            parse_rewards(spec)


def test_user_rewards_from_a_module_and_a_file(tmp_path, monkeypatch):
    source = ("def short(completion, record):\n    return 1 if len(completion) < 5 else 0\n"
              "def bad(completion, record):\n    return 'yes'\n"
              "def nan(completion, record):\n    return float('nan')\n")
    (tmp_path / "my_rewards_mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    [(name, fn)] = parse_rewards("my_rewards_mod:short")
    assert name == "my_rewards_mod:short" and fn("hi", {}) == 1.0 and fn("a long reply", {}) == 0.0
    file_spec = f"{tmp_path / 'my_rewards_mod.py'}:short"
    assert parse_rewards(file_spec)[0][1]("hi", {}) == 1.0
    [(_, bad), (_, nan)] = parse_rewards(f"{tmp_path}/my_rewards_mod.py:bad,my_rewards_mod:nan")
    with pytest.raises(NanoforgeError, match=r"reward '.*:bad' returned 'yes' \(str\) .* prompts.jsonl:3"):
        bad("x", {"_where": "prompts.jsonl:3"})
    with pytest.raises(NanoforgeError, match="returned nan"):
        nan("x", {})


def test_a_user_reward_that_cannot_load_or_be_called_is_named_at_once(tmp_path):
    (tmp_path / "syntax.py").write_text("def f(c, r:\n    return 1\n")
    (tmp_path / "imports.py").write_text("import no_such_module_xyz\ndef f(c, r):\n    return 1\n")
    (tmp_path / "ok.py").write_text("def one(completion):\n    return 1\n"
                                    "def boom(completion, record):\n    raise KeyError('late')\n")
    for spec, message in [("syntax.py:f", r"syntax.py:f: cannot import .*\(SyntaxError: '\(' was never closed"),
                          ("imports.py:f", "cannot import .*No module named 'no_such_module_xyz'"),
                          ("ok.py:one", r"called as one\(completion, record\); its signature one\(completion\)")]:
        with pytest.raises(NanoforgeError, match=message):
            parse_rewards(f"{tmp_path / spec}")
    [(_, boom)] = parse_rewards(f"{tmp_path}/ok.py:boom")
    with pytest.raises(NanoforgeError, match=r"reward '.*ok.py:boom' failed on the prompt at p.jsonl:4: KeyError"):
        boom("x", {"_where": "p.jsonl:4"})
    for text in ("nan,1", "1,inf"):
        with pytest.raises(NanoforgeError, match="every weight must be a finite number"):
            parse_weights(text, 2)


def test_combine_weights_the_parts():
    total = combine(parse_rewards("math,length"), parse_weights("2,0.5", 2))
    value, parts = total("", {"answer": "3"})
    assert parts == {"math": 0.0, "length": -0.5} and value == -0.25
    value, parts = total("It is 3", {"answer": "3"})
    assert value == 2.0
    assert combine(parse_rewards("math,length"))("It is 3", {"answer": "3"})[0] == 1.0
    with pytest.raises(NanoforgeError, match="2 weights for 3 rewards"):
        parse_weights("1,2", 3)


# ---------------------------------------------------------------------------------------------- agent


def test_agent_reward_on_hand_made_trajectories():
    record = {"gt": ["391"]}
    solved = AgentTurns(replies=[CALL, "17*23 = 391."], tool_results=["391"], finished=True)
    assert agent_reward_parts(solved, record) == {"calls": 0.1, "bad": 0.0, "answer": 1.0, "unfinished": 0.0,
                                                  "total": 1.1}
    looping = AgentTurns(replies=[CALL] * 5, tool_results=["391"] * 5, finished=False)
    assert agent_reward(looping, record) == pytest.approx(0.3 - 0.5)  # calls capped, then unfinished
    malformed = AgentTurns(replies=["<tool_call>\n{not json}\n</tool_call>", "It is 390."], tool_results=[],
                           finished=True)
    assert agent_reward(malformed, record) == pytest.approx(-0.2)
    failed_call = AgentTurns(replies=[CALL, "Paris."], tool_results=["Error: unknown tool 'x'"], finished=True)
    assert agent_reward(failed_call, {"gt": ["paris", "France"]}) == pytest.approx(0.5)
    with pytest.raises(NanoforgeError, match='needs "gt"'):
        agent_reward(solved, {})


def test_answer_found_respects_word_and_number_edges():
    assert answer_found("The answer is 391.", "391")
    assert not answer_found("1391 or 3910", "391") and not answer_found("0.391", "391")
    assert not answer_found("391.5", "391") and answer_found("it is 391, done", "391")
    assert answer_found("答案是北京。", "北京") and answer_found("PARIS!", "Paris")


# ---------------------------------------------------------------------------------------------- reward model


def test_reward_model_scores_with_a_local_tiny_model(tmp_path, tiny_tokenizer):
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "rm"
    tiny_tokenizer.save(directory)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    config = transformers.LlamaConfig(vocab_size=len(hf_tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      num_labels=1)
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(config).save_pretrained(directory)

    rm = load_reward_model(directory)
    prompt = [{"role": "user", "content": "What is 2+2?"}]
    score = rm.score(prompt, "It is 4.")
    # the same score computed here: the model's logit at the last token of the rendered conversation
    text = hf_tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": "It is 4."}], tokenize=False)
    ids = hf_tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        assert score == pytest.approx(float(model(input_ids=ids).logits[0, 0]), abs=1e-5)
    assert math.isfinite(score) and score != rm.score(prompt, "It is 5, I think, or maybe 6.")
    assert rm.reward("It is 4.", {"messages": prompt}) == score


def test_reward_model_errors(tmp_path):
    with pytest.raises(NanoforgeError, match="no such directory.*never downloaded"):
        load_reward_model(tmp_path / "absent")
    with pytest.raises(NanoforgeError, match="no config.json"):
        load_reward_model(tmp_path)
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(NanoforgeError, match="cannot be loaded"):
        load_reward_model(tmp_path)
