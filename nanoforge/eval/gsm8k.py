"""`eval --gsm8k FILE`: grade-school maths word problems answered by generation, optionally with the calculator.

GSM8K (Cobbe et al. 2021, arXiv 2110.14168) records are `{"question": str, "answer": str}`; the answer's worked
steps end with `#### N`, and N (commas removed) is the gold answer. The prompt is the question alone as one
user message (no system prompt; with `--tools` the template's tools section forms the system turn), decoded
greedily through the tool loop (infer/turns.py), so a model that calls the calculator gets its results.

The model's answer is read from its final reply's content: the first number after the last `####` when there
is one (the format GSM8K's own solutions teach), else the last number in the content. Numbers are compared by
value, not text: "18" == "18.0", "1,000" == "1000", "-3" == "-3.00"; thousands separators must be well
placed ("1,000" is a number, "1,0" is 1 and 0).

Tokens/s is every generated token over the loop's wall time (prompt rendering, prefill and tool runs included)."""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable

from nanoforge.data.jsonl import DataError, check_input_file
from nanoforge.eval.common import Progress, fitting, format_table, json_lines
from nanoforge.infer.generate import SamplingConfig
from nanoforge.infer.turns import Conversation, converse

ANSWER_MARK = "####"
# A number as people write it: an optional minus sign (not one between two words or digits, "90-37" is a
# subtraction), digits with well-placed thousands commas or none, an optional decimal part.
NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


@dataclass
class Problem:
    question: str
    gold: str  # the number after ####, commas removed
    where: str = ""  # file:line


def to_number(text: str) -> Decimal | None:
    """"1,000" -> Decimal(1000); None when `text` is not a plain number."""
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def numbers_equal(a: str | None, b: str | None) -> bool:
    """Whether two number texts have the same value ("18" and "18.0", "1,000" and "1000")."""
    x, y = to_number(a or ""), to_number(b or "")
    return x is not None and y is not None and x == y


def gold_answer(answer: str) -> str | None:
    """The number after the last `####` of a GSM8K solution, commas removed; None when there is none."""
    head, mark, tail = answer.rpartition(ANSWER_MARK)
    text = tail.strip().replace(",", "")
    return text if mark and to_number(text) is not None else None


def extract_answer(content: str) -> str | None:
    """The model's answer in its final content: the first number after the last `####`, else the last number
    in the content; commas removed. None when it wrote no number."""
    head, mark, tail = content.rpartition(ANSWER_MARK)
    if mark:
        found = NUMBER.search(tail)
        if found:
            return found.group().replace(",", "")
    numbers = NUMBER.findall(content)
    return numbers[-1].replace(",", "") if numbers else None


def read_gsm8k(path, limit: int | None = None) -> list[Problem]:
    """The problems of a GSM8K JSONL file (the first `limit` of them); DataError naming file:line: field."""
    path = check_input_file(path)
    # islice stops before reading the line after the limit (a bad line there is never seen)
    problems = [_problem(obj, path, line_no) for line_no, obj in itertools.islice(json_lines(path), limit)]
    if not problems:
        raise DataError("has no problems", path)
    return problems


def _problem(obj, path, line_no: int) -> Problem:
    if not isinstance(obj, dict):
        raise DataError('a record must be a JSON object {"question": ..., "answer": ...}', path, line_no)
    for name in ("question", "answer"):
        if not isinstance(obj.get(name), str) or not obj[name].strip():
            got = "missing" if name not in obj else f"got {type(obj[name]).__name__} {obj[name]!r:.40}"
            raise DataError(f"must be a non-empty string ({got})", path, line_no, f'"{name}"')
    gold = gold_answer(obj["answer"])
    if gold is None:
        raise DataError(f"must end with '{ANSWER_MARK} N', N a number (GSM8K's format), got "
                        f"{obj['answer'][-40:]!r}", path, line_no, '"answer"')
    return Problem(obj["question"], gold, f"{path}:{line_no}")


def evaluate_gsm8k(model, tokenizer, problems: list[Problem], tools=(), think: bool = False, batch_size: int = 8,
                   max_new_tokens: int = 256, max_turns: int = 4, precision: str = "fp32", progress: bool = True,
                   log: Callable[[str], None] = print) -> dict:
    """Accuracy on problems (`read_gsm8k`, which run_eval calls before loading the model, so that a bad file
    fails at once), decoding greedily with the given built-in tools; prints a table through `log` and returns
    the numbers with one row per problem."""
    cfg = SamplingConfig(temperature=0, max_new_tokens=max_new_tokens)
    openings = [[{"role": "user", "content": p.question}] for p in problems]
    bar = Progress(progress, "gsm8k problems", len(problems))
    conversations, seconds = converse(model, tokenizer, openings, cfg, batch_size, bar.update,
                                      tools=tools, think=think, max_turns=max_turns, precision=precision)
    bar.close()
    problems, conversations, too_long = fitting(problems, [p.where for p in problems], conversations, "problems",
                                                model, max_new_tokens, log)
    rows = [_graded(p, r) for p, r in zip(problems, conversations)]
    result = _summary(rows, conversations, seconds, bool(tools))
    result.update(tools=list(tools), think=think, too_long=len(too_long), too_long_records=too_long, per_record=rows)
    log(format_table([f"gsm8k ({len(rows)} problems" + (", tools: " + ",".join(tools) if tools else "") + ")",
                      "value"], _table_rows(result)))
    return result


def _graded(problem: Problem, conversation: Conversation) -> dict:
    predicted = extract_answer(conversation.final_content)
    return {"where": problem.where, "gold": problem.gold, "predicted": predicted,
            "correct": numbers_equal(predicted, problem.gold), "turns": conversation.turns, "end": conversation.end,
            "content": conversation.final_content}


def _summary(rows: list[dict], conversations: list[Conversation], seconds: float, with_tools: bool) -> dict:
    n = len(rows)
    tokens = sum(r.new_tokens for r in conversations)
    out = {"problems": n, "accuracy": sum(r["correct"] for r in rows) / n,
           "answered": sum(r["predicted"] is not None for r in rows) / n,
           "mean_turns": sum(r.turns for r in conversations) / n,
           "ended_normally": sum(r.finished for r in conversations) / n,
           "new_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}
    if with_tools:
        replies = [reply for r in conversations for reply in r.replies]
        calls = sum(len(reply.tool_calls) for reply in replies)
        blocks = calls + sum(len(reply.errors) for reply in replies)
        out.update(tool_calls=calls, tool_call_blocks=blocks,
                   tool_call_parse_rate=calls / blocks if blocks else None,
                   problems_with_calls=sum(any(x.tool_calls for x in r.replies) for r in conversations) / n)
    return out


def _table_rows(result: dict) -> list[list[str]]:
    rows = [["accuracy", f"{result['accuracy']:.4f}"], ["answered (a number found)", f"{result['answered']:.4f}"],
            ["mean turns", f"{result['mean_turns']:.2f}"], ["ended normally", f"{result['ended_normally']:.4f}"]]
    if "tool_calls" in result:
        rate = result["tool_call_parse_rate"]
        rows += [["tool-call parse rate", "n/a" if rate is None else f"{rate:.4f}"],
                 ["tool calls", f"{result['tool_calls']:,}"],
                 ["problems with a call", f"{result['problems_with_calls']:.4f}"]]
    rows += [["new tokens", f"{result['new_tokens']:,}"], ["tokens/s", f"{result['tokens_per_s']:,.1f}"],
             ["too long for the context (not scored)", f"{result['too_long']:,}"]]
    return rows
