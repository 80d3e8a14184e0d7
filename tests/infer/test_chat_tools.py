"""`nanoforge chat` with thinking and tools, on a tiny run that learnt to call the calculator
(tests/tool_run.py): the reply is parsed as it streams, reasoning is printed apart from the answer, each call
is run and its result fed back until the model answers. What the model was given is checked token for token
against the template's own render of the conversation the chat kept."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.chat import chat_loop
from nanoforge.infer.generate import SamplingConfig
from nanoforge.weights.load import load_model
from nanoforge.chat.tokenizer import CHAT_TEMPLATE, Tokenizer
from nanoforge.chat.calculator import CALCULATOR_SCHEMA, evaluate

from tool_run import ANSWER, QUESTIONS, REASONING, question

pytestmark = pytest.mark.slow  # the tool run takes a minute to build (once per session)

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=120)
SYSTEM = "You are a helpful assistant."  # the system text the tool run was trained with


@pytest.fixture(scope="module")
def loaded(tool_run_dir):
    model, tokenizer, _ = load_model(tool_run_dir)
    return model, tokenizer


def piped(loaded, text, **options):
    model, tokenizer = loaded
    out, prompts = io.StringIO(), []
    messages = chat_loop(model, tokenizer, GREEDY, SYSTEM, io.StringIO(text), out, interactive=False,
                         on_prompt=prompts.append, **options)
    return out.getvalue(), messages, prompts


def rendered(tokenizer, messages, **kwargs):
    return tokenizer.render_chat(messages, add_generation_prompt=True, tools=[CALCULATOR_SCHEMA], **kwargs)[0]


def test_a_tool_call_is_run_and_its_result_fed_back_until_the_model_answers(loaded):
    output, messages, prompts = piped(loaded, question(*QUESTIONS[0]), tools=["calculator"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    messages = messages[1:]
    call = messages[1]["tool_calls"][0]["function"]
    expression = json.loads(call["arguments"])["expression"]
    assert call["name"] == "calculator" and messages[2]["content"] == evaluate(expression)
    assert messages[3]["content"].startswith(ANSWER.split("{")[0]), "the model's own final answer"
    assert output == (f"[call calculator {call['arguments']}]\n[calculator -> {evaluate(expression)}]\n"
                      f"{messages[3]['content']}\n")
    tokenizer = loaded[1]
    system = [{"role": "system", "content": SYSTEM}]
    assert prompts == [rendered(tokenizer, system + messages[:1]), rendered(tokenizer, system + messages[:3])], \
        "the second prompt is the first, the reply with its call and the tool's result"
    assert "<tool_call>" not in messages[1]["content"] and messages[1]["content"] == ""


def test_thinking_is_shown_apart_from_the_answer_and_kept_as_reasoning(loaded):
    output, messages, prompts = piped(loaded, question(*QUESTIONS[1]), tools=["calculator"], think=True)
    first = messages[2]
    assert first["reasoning_content"].startswith(REASONING.format("")[:-1].rstrip())
    assert output.startswith(f"(thinking) {first['reasoning_content']} (end of thinking)\n[call calculator ")
    assert "<think>" not in output and "</think>" not in output and "<tool_call>" not in output
    assert prompts[0] == rendered(loaded[1], messages[:2], open_thinking=True)
    assert loaded[1].decode(prompts[0]).endswith("<|im_start|>assistant\n<think>\n")


def test_without_tools_none_are_declared_and_the_reply_is_kept_as_printed(loaded):
    output, messages, prompts = piped(loaded, question(*QUESTIONS[0]))
    assert prompts == [loaded[1].render_chat(messages[:2], add_generation_prompt=True)[0]], "no tools section"
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert "tool_calls" in messages[2] or output == messages[2]["content"] + "\n"


@pytest.mark.parametrize("think", [False, True])
def test_chat_eval_and_rl_give_the_same_tokens_for_the_same_conversation_and_seed(loaded, think):
    """One conversation, sampled (temperature 0.9, seed 11), through `chat`, `eval`'s loop and `grpo --tools`'s
    rollouts: the same prompt, replies, tool results and tokens."""
    from nanoforge.infer.turns import converse
    from nanoforge.rl.agent import sample_trajectories
    from nanoforge.rl.prompts import PromptRecord

    model, tokenizer = loaded
    text = question(*QUESTIONS[2])
    for seed in range(11, 41):  # the first seed whose conversation calls a tool (the model depends on the data)
        cfg = SamplingConfig(temperature=0.9, max_new_tokens=100, seed=seed)
        out, prompts = io.StringIO(), []
        chatted = chat_loop(model, tokenizer, cfg, SYSTEM, io.StringIO(text), out, interactive=False,
                            on_prompt=prompts.append, tools=["calculator"], think=think)
        if len(prompts) >= 2:
            break
    opening = chatted[:2]  # the system message and the question
    [evaluated], _ = converse(model, tokenizer, [opening], cfg, 1, tools=["calculator"], think=think, max_turns=6)
    [rolled] = sample_trajectories(model, tokenizer, [prompts[0]], [PromptRecord(messages=opening, gt=["0"])],
                              ["calculator"], cfg, max_turns=6, think=think)
    assert evaluated.ids[:len(prompts[0])] == prompts[0] and evaluated.ids == rolled.ids
    assert evaluated.messages == chatted and rolled.messages == chatted[2:]  # RL's keep no prompt messages
    assert prompts[1:] == [evaluated.ids[:len(p)] for p in prompts[1:]], "chat read the same tokens each round"
    assert len(prompts) >= 2, "the check means something only if the model called a tool"


def test_the_tool_rounds_stop_at_max_tool_turns(loaded):
    model, tokenizer = loaded
    output, messages, prompts = piped(loaded, question(*QUESTIONS[0]), tools=["calculator"], max_tool_turns=1)
    assert len(prompts) == 2  # this model answers after one result, so one round is enough ...


def test_tools_and_thinking_need_a_template_in_minimind3s_format(loaded):
    model, tokenizer = loaded
    plain = Tokenizer(tokenizer.backend, chat_template=CHAT_TEMPLATE)
    for options in ({"tools": ["calculator"]}, {"think": True}):
        with pytest.raises(NanoforgeError, match="plain ChatML"):
            chat_loop(model, plain, GREEDY, None, io.StringIO("hi"), io.StringIO(), interactive=False, **options)


def run_cli(run_dir, *args, stdin="What is 12 * 7?"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "nanoforge.cli", "chat", str(run_dir), "--device", "cpu",
                           "--temperature", "0", "--max-new-tokens", "100", "--system", SYSTEM, *args],
                          input=stdin, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_chat_with_the_calculator_from_the_command_line(tool_run_dir):
    result = run_cli(tool_run_dir, "--tools", "calculator")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("[call calculator {") and lines[1].startswith("[calculator -> ")
    assert lines[2].startswith("The answer is ")
    bad = run_cli(tool_run_dir, "--tools", "abacus")
    assert bad.returncode != 0 and "unknown tool 'abacus'" in bad.stderr and "calculator" in bad.stderr
