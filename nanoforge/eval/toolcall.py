"""`eval --toolcall FILE`: does the model call the right tool with the right arguments, and answer right?

The file holds SFT records (validated as `prepare --kind sft` does, tools declared on the opening system
message). Each record's prompt is the conversation up to its first assistant message, decoded greedily through
the tool loop (infer/turns.py: built-in tools run for real, any other gets an "Error: ..." result); its
reference is that message's tool calls and the last assistant message's content (think block taken off).

Metrics (the model's first reply against the reference's first assistant message):
    parse rate         replies with a tool call and no malformed block, over records whose reference calls tools
    valid-call rate    calls naming a declared tool with every required argument key, over all first-reply calls
    call-match rate    replies whose calls equal the reference's (names and parsed arguments, any order), over
                       records whose reference calls tools
    no-call agreement  replies calling no tool, over records whose reference calls none
    answer accuracy    final contents equal to the reference's (stripped, whitespace runs as one space), over
                       records whose reference calls only built-in tools (the only reproducible results)"""
import json
from typing import Callable

from nanoforge.core import safejson
from nanoforge.chat.messages import call_function, tool_function
from nanoforge.data.jsonl import iter_records
from nanoforge.eval.common import Progress, fitting, format_table
from nanoforge.infer.generate import SamplingConfig
from nanoforge.infer.turns import Conversation, converse
from nanoforge.chat.replies import parse_reply
from nanoforge.chat.messages import normalize_conversation
from nanoforge.chat.calculator import BUILTIN_TOOLS


def read_toolcall(path, limit: int | None = None) -> list[dict]:
    """One case per SFT record: prompt messages, declared schemas by name, reference calls and answer; each
    record normalised as `prepare` renders it (chat/messages.py: JSON-string tools and tool_calls parsed)."""
    cases = []
    for line_no, record in iter_records(path, "sft"):
        if limit is not None and len(cases) >= limit:
            break
        messages, declared = normalize_conversation(record["conversations"])
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        calls = [call_function(c) for c in messages[first].get("tool_calls") or []]
        final = parse_reply(messages[-1].get("content") or "", thinking_open=False).content
        cases.append({"where": f"{path}:{line_no}", "prompt": messages[:first],
                      "schemas": {tool_function(t)["name"]: tool_function(t) for t in declared or []},
                      "calls": [(c["name"], safejson.loads(c["arguments"]) if isinstance(c["arguments"], str)
                                 else c["arguments"]) for c in calls], "answer": final})
    return cases


def valid_call(call: dict, schemas: dict) -> bool:
    """A parsed call (OpenAI shape) names a declared tool and gives every required argument."""
    name = call["function"]["name"]
    if name not in schemas:
        return False
    arguments = safejson.loads(call["function"]["arguments"])
    required = (schemas[name].get("parameters") or {}).get("required") or []
    return isinstance(arguments, dict) and all(key in arguments for key in required)


def calls_match(calls: list[dict], reference: list[tuple[str, dict]]) -> bool:
    """The parsed calls equal the reference's (name, arguments) pairs, in any order."""
    key = lambda pair: json.dumps(pair, sort_keys=True)  # noqa: E731
    got = [(c["function"]["name"], safejson.loads(c["function"]["arguments"])) for c in calls]
    return sorted(map(key, got)) == sorted(map(key, reference))


def same_answer(content: str, reference: str) -> bool:
    return " ".join(content.split()) == " ".join(reference.split())


def evaluate_toolcall(model, tokenizer, cases: list[dict], think: bool = False, batch_size: int = 8,
                      max_new_tokens: int = 256, max_turns: int = 4, precision: str = "fp32",
                      progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """The metrics of the module docstring on cases (`read_toolcall`, which run_eval calls before loading the
    model); prints a table through `log` and returns them with one row per record."""
    cfg = SamplingConfig(temperature=0, max_new_tokens=max_new_tokens)
    bar = Progress(progress, "toolcall records", len(cases))
    conversations, seconds = _converse_by_tools(model, tokenizer, cases, cfg, batch_size, bar, think=think,
                                                max_turns=max_turns, precision=precision)
    bar.close()
    cases, conversations, too_long = fitting(cases, [c["where"] for c in cases], conversations, "records", model,
                                             max_new_tokens, log)
    rows = [_graded(c, r) for c, r in zip(cases, conversations)]
    result = _summary(rows, conversations, seconds)
    result.update(think=think, too_long=len(too_long), too_long_records=too_long, per_record=rows)
    log(format_table([f"toolcall ({len(rows)} records)", "value"], _table_rows(result)))
    return result


def _converse_by_tools(model, tokenizer, cases, cfg, batch_size, bar, **loop_args) -> tuple[list[Conversation], float]:
    """Run the cases through the tool loop, grouped by which built-in tools they declare (the loop runs one set
    of tools per call); the conversations in the cases' order and the seconds spent."""
    groups: dict[tuple, list[int]] = {}
    for i, case in enumerate(cases):
        groups.setdefault(tuple(sorted(set(case["schemas"]) & set(BUILTIN_TOOLS))), []).append(i)
    conversations: list[Conversation | None] = [None] * len(cases)
    seconds, done = 0.0, 0
    for tools, members in groups.items():
        got, spent = converse(model, tokenizer, [cases[i]["prompt"] for i in members], cfg, batch_size,
                                    lambda n: bar.update(done + n), tools=tools, **loop_args)  # noqa: B023 (called at once)
        for i, conversation in zip(members, got):
            conversations[i] = conversation
        seconds, done = seconds + spent, done + len(members)
    return conversations, seconds


def _graded(case: dict, conversation: Conversation) -> dict:
    first = conversation.replies[0] if conversation.replies else None
    calls = first.tool_calls if first else []
    runnable = all(name in BUILTIN_TOOLS and name in case["schemas"] for name, _ in case["calls"])
    return {"where": case["where"], "reference_calls": len(case["calls"]), "calls": len(calls),
            "parsed": bool(first and calls and not first.errors),
            "valid_calls": sum(valid_call(c, case["schemas"]) for c in calls),
            "match": calls_match(calls, case["calls"]), "scored_answer": runnable,
            "correct": runnable and same_answer(conversation.final_content, case["answer"]),
            "turns": conversation.turns, "end": conversation.end, "content": conversation.final_content}


def _rate(rows: list[dict], key: str) -> float | None:
    return sum(bool(r[key]) for r in rows) / len(rows) if rows else None


def _summary(rows: list[dict], conversations: list[Conversation], seconds: float) -> dict:
    calling = [r for r in rows if r["reference_calls"]]
    silent = [r for r in rows if not r["reference_calls"]]
    made = sum(r["calls"] for r in rows)
    tokens = sum(r.new_tokens for r in conversations)
    return {"records": len(rows), "records_with_calls": len(calling), "parse_rate": _rate(calling, "parsed"),
            "valid_call_rate": sum(r["valid_calls"] for r in rows) / made if made else None,
            "call_match_rate": _rate(calling, "match"),
            "no_call_agreement": sum(r["calls"] == 0 for r in silent) / len(silent) if silent else None,
            "answer_records": sum(r["scored_answer"] for r in rows),
            "answer_accuracy": _rate([r for r in rows if r["scored_answer"]], "correct"),
            "mean_turns": sum(r.turns for r in conversations) / len(rows),
            "new_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}


def _table_rows(result: dict) -> list[list[str]]:
    def show(value):
        return "n/a" if value is None else f"{value:.4f}"
    return [["parse rate", show(result["parse_rate"])], ["valid-call rate", show(result["valid_call_rate"])],
            ["call-match rate", show(result["call_match_rate"])],
            ["no-call agreement", show(result["no_call_agreement"])],
            [f"answer accuracy ({result['answer_records']} records)", show(result["answer_accuracy"])],
            ["records with reference calls", f"{result['records_with_calls']}"],
            ["mean turns", f"{result['mean_turns']:.2f}"], ["new tokens", f"{result['new_tokens']:,}"],
            ["tokens/s", f"{result['tokens_per_s']:,.1f}"],
            ["too long for the context (not scored)", f"{result['too_long']:,}"]]
