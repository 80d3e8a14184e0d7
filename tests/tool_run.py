"""A tiny run that has learnt to call the calculator: SFT'd until it reproduces a dozen calculator
conversations greedily, with and without thinking. Tests of `chat --tools`, `serve` with tools, the web page
and `eval --toolcall` use it to drive the real tool path end to end (a random model never writes a call).

Each conversation: a question "What is A op B?", the assistant's call calculator {"expression": "A op B"}
(after the reasoning "I should compute A op B." when thinking is on), the tool's result, and the answer
"The answer is R." (after "The calculator gave R." when thinking is on). Built once per test session (about
half a minute on a quiet 2-core CPU).
"""
from __future__ import annotations

import json
from pathlib import Path

from nanoforge.chat.calculator import CALCULATOR_SCHEMA, evaluate

QUESTIONS = [(12, "*", 7), (48, "/", 2), (345, "+", 678), (90, "-", 37), (15, "*", 15), (81, "/", 9),
             (250, "+", 250), (1000, "-", 1), (6, "*", 13), (72, "/", 8), (123, "+", 456), (500, "-", 125)]
ANSWER = "The answer is {}."
REASONING = "I should compute {}."
REASONING_AFTER = "The calculator gave {}."
_RUNS: dict[str, Path] = {}


def question(a, op, b) -> str:
    return f"What is {a} {op} {b}?"


def conversation(a, op, b, think: bool) -> list[dict]:
    """One training conversation, as an SFT record's messages (tools declared on the system turn)."""
    expression = f"{a} {op} {b}"
    result = evaluate(expression)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]}
    answer = {"role": "assistant", "content": ANSWER.format(result)}
    if think:
        call["reasoning_content"] = REASONING.format(expression)
        answer["reasoning_content"] = REASONING_AFTER.format(result)
    return [{"role": "system", "content": "You are a helpful assistant.", "tools": [CALCULATOR_SCHEMA]},
            {"role": "user", "content": question(a, op, b)}, call, {"role": "tool", "content": result}, answer]


def write_tool_sft(path: Path) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for q in QUESTIONS:
            for think in (False, True):
                f.write(json.dumps({"conversations": conversation(*q, think=think)}) + "\n")
    return path


def make_tool_run(tmp_path_factory, tokenizer) -> Path:
    """The run directory (built once per session). Its tokenizer is trained on the tiny corpus plus the
    rendered conversations (with `tokenizer`, any one with the tools template), so the long tools system turn
    is a few hundred tokens, not seven hundred, and a tiny model learns the calls in a few hundred steps."""
    if "run" not in _RUNS:
        from conftest import tiny_corpus
        from nanoforge.data.prepare import prepare_dataset
        from nanoforge.data.sources import train_tokenizer
        from nanoforge.recipes.pretrain import pretrain
        from nanoforge.recipes.sft import sft

        work = tmp_path_factory.mktemp("tool_run")
        quiet = dict(log=lambda *a: None)
        records = write_tool_sft(work / "tools.jsonl")
        rendered = work / "rendered.jsonl"
        with open(records, encoding="utf-8") as f, open(rendered, "w", encoding="utf-8") as out:
            for line in f:
                text = tokenizer.render_text(json.loads(line)["conversations"])
                out.write(json.dumps({"text": text}) + "\n")
        corpus = tiny_corpus(work)[:1]
        tok = train_tokenizer([*corpus, rendered], vocab_size=1024, out_dir=work / "tok")
        prepare_dataset("pretrain", corpus, tok, work / "pre", val_fraction=0.1, workers=1, **quiet)
        pretrain([str(work / "pre")], work / "base", preset="tiny", quiet=True, tokenizer=str(work / "tok"),
                 overrides={"max_steps": 1, "tensorboard": False, "eval_every": 0, "seq_len": 32,
                            "max_seq_len": 512, "precision": "fp32"})
        prepare_dataset("sft", [records], tok, work / "sft", val_fraction=0.0, workers=1, **quiet)
        sft(str(work / "base"), [str(work / "sft")], work / "run", quiet=True,
            overrides={"max_steps": 300, "lr": 3e-3, "warmup_steps": 10, "seq_len": 512, "batch_size": 4,
                       "eval_every": 0, "save_every": 0, "tensorboard": False, "precision": "fp32",
                       "sample_every": 0})
        _RUNS["run"] = work / "run"
    return _RUNS["run"]
