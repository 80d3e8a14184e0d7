"""Rewards of the RL stages: built-in rule rewards, the user's own (`module:function`), their weighted sum, and
MiniMind's agent reward over a multi-turn trajectory.

A reward is `fn(completion: str, record: dict) -> float`:
    completion  the reply's text as the model wrote it after the generation prompt (no stop token)
    record      PromptRecord.reward_record() (rl/prompts.py): the record's own keys, "messages", "answer", "gt",
                "_where" (path:line), plus what the rollout knows of this reply, which the stage adds:
                "thinking_open" (the prompt ended inside an open <think> block), "reply_tokens",
                "max_new_tokens", "truncated" (the reply hit max_new_tokens without its stop token)."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Callable

from nanoforge.core.errors import NanoforgeError
from nanoforge.chat.replies import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN, parse_reply

RewardFn = Callable[[str, dict], float]

# length: the penalty of an empty reply or one at its token budget, and where the budget's ramp starts
LENGTH_PENALTY = 0.5
LENGTH_RAMP_START = 0.9
# repetition: the n of the n-grams counted
REPETITION_N = 3

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# repetition units: runs of ASCII letters/digits (English words, numbers), and every other non-space character
# on its own (a Chinese character, a punctuation mark)
_UNITS = re.compile(r"[A-Za-z0-9]+|[^\sA-Za-z0-9]")


def answer_number(text: str) -> Decimal | None:
    """The answer a text gives: the first number after its last "####" (GSM8K's convention), else its last
    number; commas removed, compared as decimals (18 == 18.0). None when there is none."""
    found = _NUMBER.findall(text.rsplit("####", 1)[1])[:1] if "####" in text else _NUMBER.findall(text)[-1:]
    if not found:
        return None
    try:
        return Decimal(found[0].replace(",", ""))
    except InvalidOperation:
        return None


def math_reward(completion: str, record: dict) -> float:
    """1.0 when the reply's answer_number (outside its thinking) equals the record's "answer"'s, else 0.0."""
    where = record.get("_where") or "a prompt record"
    if record.get("answer") is None:
        raise NanoforgeError(f'the math reward needs an "answer" in every prompt record; {where} has none')
    gold = answer_number(str(record["answer"]))
    if gold is None:
        raise NanoforgeError(f'the math reward needs a number as the answer; {where} has {record["answer"]!r}')
    content = parse_reply(completion, bool(record.get("thinking_open"))).content  # without thinking and tool calls
    return 1.0 if answer_number(content) == gold else 0.0


def check_records(spec: str | None, records) -> None:
    """Every prompt record against the chosen built-in rewards before the run starts, not at the step that draws
    a bad one: math_reward refuses a record without a numeric "answer" whatever the reply."""
    if "math" in [name.strip() for name in (spec or "").split(",")]:
        for record in records:
            math_reward("", record.reward_record())


def format_reward(completion: str, record: dict) -> float:
    """1.0 for a well-formed reply, else 0.0. Well-formed means all of:
      - think tags: with record["thinking_open"] exactly one </think> and no <think>; otherwise none of either,
        or one <think> at the head (after newlines) and one </think> after it;
      - as many <tool_call> as </tool_call>, and every block a valid call (parse_reply reports no error);
      - something after the thinking: non-empty content or at least one tool call."""
    opens, closes = completion.count(THINK_OPEN), completion.count(THINK_CLOSE)
    if record.get("thinking_open"):
        think_ok = (opens, closes) == (0, 1)
    else:
        think_ok = (opens, closes) == (0, 0) or (
            (opens, closes) == (1, 1) and completion.lstrip("\n").startswith(THINK_OPEN)
            and completion.index(THINK_OPEN) < completion.index(THINK_CLOSE))
    reply = parse_reply(completion, bool(record.get("thinking_open")))
    calls_ok = completion.count(CALL_OPEN) == completion.count(CALL_CLOSE) and not reply.errors
    return 1.0 if think_ok and calls_ok and (reply.content.strip() or reply.tool_calls) else 0.0


def length_reward(completion: str, record: dict) -> float:
    """A mild length penalty, 0 for most replies:
        -LENGTH_PENALTY                    an empty (whitespace-only) reply, or a truncated one
        -LENGTH_PENALTY * clamp((n - 0.9 M) / (0.1 M), 0, 1)    otherwise, n = reply_tokens, M = max_new_tokens
    so the penalty grows linearly over the last 10% of the token budget (0 when the record lacks the two)."""
    if not completion.strip() or record.get("truncated"):
        return -LENGTH_PENALTY
    n, budget = record.get("reply_tokens"), record.get("max_new_tokens")
    if not n or not budget:
        return 0.0
    start = LENGTH_RAMP_START * budget
    return -LENGTH_PENALTY * min(max((n - start) / (budget - start), 0.0), 1.0)


def repetition_reward(completion: str, record: dict) -> float:
    """-(share of the reply's n-grams (n = REPETITION_N) that repeat an earlier one), in [-1, 0]: 0 for a reply
    without a repeated n-gram, near -1 for one word or phrase looped. Units are ASCII words and every other
    non-space character (so Chinese counts by character); fewer than n units -> 0."""
    units = _UNITS.findall(completion)
    grams = [tuple(units[i:i + REPETITION_N]) for i in range(len(units) - REPETITION_N + 1)]
    return -(1.0 - len(set(grams)) / len(grams)) if grams else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {"math": math_reward, "format": format_reward, "length": length_reward,
                                        "repetition": repetition_reward}


# ---------------------------------------------------------------------------------------------- choosing

def parse_rewards(spec: str) -> list[tuple[str, RewardFn]]:
    """`--reward math,format,mymod:fn,path/to/file.py:fn` -> [(name, fn), ...]: built-in names, or the user's
    function from an importable module or a .py file, checked to return a finite number each call."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise NanoforgeError(f"--reward: no reward given; the built-ins are {', '.join(BUILTIN_REWARDS)}")
    chosen: list[tuple[str, RewardFn]] = []
    for name in names:
        if name in (n for n, _ in chosen):
            raise NanoforgeError(f"--reward: {name!r} is given twice")
        if name in BUILTIN_REWARDS:
            chosen.append((name, BUILTIN_REWARDS[name]))
        elif ":" in name:
            chosen.append((name, checked_reward(name, load_user_reward(name))))
        else:
            raise NanoforgeError(f"--reward: unknown reward {name!r}; the built-ins are "
                                 f"{', '.join(BUILTIN_REWARDS)}, or give module:function or path/to/file.py:function")
    return chosen


def load_user_reward(spec: str) -> Callable:
    """`module:function` (importable, e.g. on PYTHONPATH) or `path/to/file.py:function` -> the function."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise NanoforgeError(f"--reward {spec}: expected module:function or path/to/file.py:function")
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    try:
        module = _module_from_file(Path(target), spec) if is_file else importlib.import_module(target)
    except NanoforgeError:
        raise
    except Exception as e:  # the user's code: a syntax error, a failing import, anything it raises
        hint = "" if is_file else "; give a module on PYTHONPATH or a file path/to/file.py:function"
        raise NanoforgeError(f"--reward {spec}: cannot import {target!r} ({type(e).__name__}: {e}){hint}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise NanoforgeError(f"--reward {spec}: {target} has no {attr!r}")
    if not callable(fn):
        raise NanoforgeError(f"--reward {spec}: {target}'s {attr!r} is {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("", {})
    except TypeError as e:
        raise NanoforgeError(f"--reward {spec}: a reward is called as {attr}(completion, record); its signature "
                             f"{attr}{inspect.signature(fn)} does not take that ({e})") from None
    except ValueError:  # no signature to read (some builtins): the first call will tell
        pass
    return fn


def _module_from_file(path: Path, spec: str):
    if not path.is_file():
        raise NanoforgeError(f"--reward {spec}: no such file {path}")
    module_spec = importlib.util.spec_from_file_location(f"nanoforge_user_reward_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise NanoforgeError(f"--reward {spec}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def checked_reward(name: str, fn: Callable) -> RewardFn:
    """fn wrapped so that an exception or a value other than a finite real number (bool counts as 0/1) is a
    NanoforgeError naming the reward and the prompt record, at the call that raised or returned it."""
    def reward(completion: str, record: dict) -> float:
        where = record.get("_where") or "an unknown record"
        try:
            value = fn(completion, record)
        except Exception as e:
            raise NanoforgeError(f"reward {name!r} failed on the prompt at {where}: {type(e).__name__}: {e}") from e
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise NanoforgeError(f"reward {name!r} returned {value!r} ({type(value).__name__}) for the prompt at "
                                 f"{where}; a reward must return a finite number (int or float)")
        return float(value)
    return reward


def parse_weights(text: str | None, count: int) -> list[float] | None:
    """`--reward-weights 1,0.5` -> [1.0, 0.5], one per reward (None or "" -> None: all 1)."""
    if not text:
        return None
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise NanoforgeError(f"--reward-weights {text}: expected comma-separated numbers") from None
    if not all(map(math.isfinite, weights)):
        raise NanoforgeError(f"--reward-weights {text}: every weight must be a finite number")
    if len(weights) != count:
        raise NanoforgeError(f"--reward-weights {text}: {len(weights)} weights for {count} rewards")
    return weights


def combine(rewards: list[tuple[str, RewardFn]], weights: list[float] | None = None):
    """Several rewards as one: fn(completion, record) -> (total, {name: value}), total = sum_i w_i r_i
    (w_i = 1 by default); the parts are for the logs."""
    weights = [1.0] * len(rewards) if weights is None else list(weights)
    if len(weights) != len(rewards):
        raise NanoforgeError(f"{len(weights)} reward weights for {len(rewards)} rewards")

    def total(completion: str, record: dict) -> tuple[float, dict[str, float]]:
        parts = {name: fn(completion, record) for name, fn in rewards}
        return sum(w * parts[name] for w, (name, _) in zip(weights, rewards)), parts
    return total


# ---------------------------------------------------------------------------------------------- agent

AGENT_CALL_REWARD = 0.1  # per tool call that ran (its result is not an "Error: ..." message)
AGENT_CALL_CAP = 0.3  # at most this much from calls, so calling tools in a loop does not pay
AGENT_BAD_CALL_PENALTY = 0.2  # per malformed <tool_call> block (never run)
AGENT_ANSWER_REWARD = 1.0  # times the share of the expected answers ("gt") found in the final answer
AGENT_UNFINISHED_PENALTY = 0.5  # the trajectory ended without a final answer (max turns hit, or truncated)


@dataclass
class AgentTurns:
    """What the agent reward needs of a multi-turn trajectory."""
    replies: list[str]  # the assistant replies' texts, in order
    tool_results: list[str]  # the result of every call that was run, in order
    finished: bool  # the last reply stopped with its stop token and called no tool


def agent_reward_parts(turns: AgentTurns, record: dict) -> dict[str, float]:
    """The agent reward's terms (MiniMind's shape, our weights above) and their sum under "total":
        calls  = min(AGENT_CALL_REWARD * calls that ran, AGENT_CALL_CAP)
        bad    = -AGENT_BAD_CALL_PENALTY * malformed blocks
        answer = AGENT_ANSWER_REWARD * share of record["gt"] found in the last reply's content
        unfinished = -AGENT_UNFINISHED_PENALTY when not turns.finished"""
    gt = record.get("gt")
    if not gt:
        raise NanoforgeError('the agent reward needs "gt" (the expected answers) in every prompt record; '
                             f"{record.get('_where') or 'a prompt record'} has none")
    expected = [gt] if isinstance(gt, str) else list(gt)
    thinking_open = bool(record.get("thinking_open"))
    parsed = [parse_reply(text, thinking_open) for text in turns.replies]
    ran = sum(not result.startswith("Error:") for result in turns.tool_results)
    final = parsed[-1].content if parsed else ""
    parts = {"calls": min(AGENT_CALL_REWARD * ran, AGENT_CALL_CAP),
             "bad": -AGENT_BAD_CALL_PENALTY * sum(len(reply.errors) for reply in parsed),
             "answer": AGENT_ANSWER_REWARD * sum(answer_found(final, g) for g in expected) / len(expected),
             "unfinished": 0.0 if turns.finished else -AGENT_UNFINISHED_PENALTY}
    return {**parts, "total": sum(parts.values())}


def agent_reward(turns: AgentTurns, record: dict) -> float:
    """The agent reward of a trajectory (see agent_reward_parts)."""
    return agent_reward_parts(turns, record)["total"]


def answer_found(text: str, expected: str) -> bool:
    """Whether `expected` appears in `text`, case-insensitively; an end of it that is a letter or digit must
    not continue a word or number in the text ("72" is not found in "1720", "0.72" or "72.5")."""
    pattern = re.escape(expected.strip().casefold())
    if re.match(r"[A-Za-z0-9]", expected.strip()):
        pattern = r"(?<![A-Za-z0-9])(?<!\d[.,])" + pattern
    if re.search(r"[A-Za-z0-9]$", expected.strip()):
        pattern += r"(?![A-Za-z0-9])(?![.,]\d)"
    return re.search(pattern, text.casefold()) is not None
