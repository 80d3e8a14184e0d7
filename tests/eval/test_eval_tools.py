"""Generative evaluation with tools: the batched tool loop (infer/toolloop.py), `eval --gsm8k` (eval/gsm8k.py)
and `eval --toolcall` (eval/toolcall.py), checked against answers known by hand and against the tool run
(tests/tool_run.py), a tiny model SFT'd to call the calculator."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import _missing_shared_data, shared_data_dir
from nanoforge.data.jsonl import DataError
from nanoforge.eval.gsm8k import extract_answer, gold_answer, numbers_equal, read_gsm8k
from nanoforge.eval.toolcall import calls_match, read_toolcall, same_answer, valid_call
from nanoforge.eval.options import EvalOptions
from nanoforge.eval.run import run_eval
from nanoforge.infer.generate import SamplingConfig
from nanoforge.infer.turns import converse
from nanoforge.weights.load import load_model
from nanoforge.chat.calculator import evaluate
from tool_run import QUESTIONS, conversation, question, write_tool_sft

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


# ---------------------------------------------------------------------------------------------- answers


def test_gold_answer_is_the_number_after_the_marks():
    assert gold_answer("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 18") == "18"
    assert gold_answer("so 1000 in all\n#### 1,000") == "1000"
    assert gold_answer("#### -3") == "-3"
    assert gold_answer("a #### 5 b\n#### 7") == "7"  # the last mark
    assert gold_answer("The answer is 18") is None
    assert gold_answer("#### eighteen") is None
    assert gold_answer("#### ") is None


@pytest.mark.parametrize("content, expected", [
    ("The answer is 84.", "84"),
    ("She has 1,000 apples and eats 3.", "3"),  # the last number
    ("She has 3 apples, then 1,000.", "1000"),
    ("So she makes $18.00 a day.", "18.00"),
    ("90-37 = 53", "53"),
    ("the change is -5 degrees", "-5"),
    ("step 1: 12 * 2 = 24\n#### 24\nI hope that helps, 99 times over", "24"),  # #### wins over the last number
    ("#### $1,234 in total", "1234"),
    ("#### none\nbut it is 7", "7"),  # no number after the mark: the last number
    ("I do not know.", None),
    ("", None),
])
def test_extract_answer(content, expected):
    assert extract_answer(content) == expected


def test_numbers_match_by_value():
    assert numbers_equal("18", "18.0") and numbers_equal("1,000", "1000") and numbers_equal("-3", "-3.00")
    assert numbers_equal(extract_answer("#### 18.0"), gold_answer("... #### 18"))
    assert not numbers_equal("18", "19") and not numbers_equal("18", "-18")
    assert not numbers_equal(None, "1") and not numbers_equal("abc", "abc")


# ---------------------------------------------------------------------------------------------- bad files


def _write(path: Path, lines) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines),
                    encoding="utf-8")
    return path


GOOD = {"question": "What is 2 + 2?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"}


@pytest.mark.parametrize("bad, message", [
    ({"question": "What is 2 + 2?", "answer": "it is 4"}, '"answer": must end with \'#### N\''),
    ('{"question": "What is 2 + 2?", "answer": ', "invalid JSON"),
    ({"question": 5, "answer": "#### 4"}, '"question": must be a non-empty string (got int 5)'),
    ({"question": "What?", "answer": ["#### 4"]}, '"answer": must be a non-empty string (got list'),
    ({"answer": "#### 4"}, '"question": must be a non-empty string (missing)'),
    (["What?", "#### 4"], "a record must be a JSON object"),
])
def test_bad_gsm8k_records_name_file_line_and_field(tmp_path, bad, message):
    path = _write(tmp_path / "bad.jsonl", [GOOD, "", bad])
    with pytest.raises(DataError) as e:
        read_gsm8k(path)
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value)


def test_bad_files_fail_through_the_cli_before_the_model_loads(tmp_path):
    def nf(*args):
        return subprocess.run([sys.executable, "-m", "nanoforge", *map(str, args)], capture_output=True, text=True,
                              cwd=ROOT)

    gsm = _write(tmp_path / "gsm.jsonl", [GOOD, {"question": "What is 1 + 1?", "answer": "2"}])
    r = nf("eval", tmp_path / "no-run", "--gsm8k", gsm)
    assert r.returncode == 1 and f"{gsm}:2: \"answer\": must end with '#### N'" in r.stderr, r.stderr
    calls = _write(tmp_path / "calls.jsonl", [{"conversations": [{"role": "user", "content": "hi"},
                                                                 {"role": "bot", "content": "hello"}]}])
    r = nf("eval", tmp_path / "no-run", "--toolcall", calls)
    assert r.returncode == 1 and f'{calls}:1: "conversations"[1].role' in r.stderr, r.stderr
    r = nf("eval", tmp_path / "no-run", "--gsm8k", gsm, "--tools", "abacus")
    assert r.returncode == 1 and "--tools: unknown tool 'abacus'" in r.stderr, r.stderr
    r = nf("eval", tmp_path / "no-run", "--toolcall", calls, "--max-turns", 0)
    assert r.returncode == 2 and "argument --max-turns: 0 must be >= 1" in r.stderr, r.stderr


def test_the_real_gsm8k_format_is_read():
    shared = shared_data_dir()
    if shared is None or not (shared / "gsm8k" / "test.jsonl").is_file():
        _missing_shared_data("reading GSM8K's test file")
    path = shared / "gsm8k" / "test.jsonl"
    problems = read_gsm8k(path, limit=8)
    assert len(problems) == 8 and all(to_int(p.gold) is not None for p in problems)
    assert problems[0].question.startswith("Janet") and problems[0].gold == "18"
    assert problems[7].where == f"{path}:8"
    # for these problems the gold answer is what the worked steps' last calculator annotation computes
    with open(path, encoding="utf-8") as f:
        records = [json.loads(next(f)) for _ in range(8)]
    for record, problem in zip(records, problems):
        last = re.findall(r"<<([^=<>]+)=([^<>]+)>>", record["answer"])[-1]
        assert numbers_equal(evaluate(last[0]), last[1]) and numbers_equal(last[1], problem.gold)


def to_int(text):
    try:
        return int(text)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------- the tool loop


# Every test from here on needs the tool run, built once per session (about 40 s on 2 idle cores, more on busy
# ones): marked slow, so that `make test` stays quick; CI runs them.


@pytest.fixture(scope="module")
def tool_model(tool_run_dir):
    model, tokenizer, _ = load_model(tool_run_dir, "cpu")
    return model, tokenizer


def run_tool_loop(model, tokenizer, conversations, cfg, **loop_args):
    """The conversations through infer/turns.py, all at once."""
    return converse(model, tokenizer, conversations, cfg, len(conversations), **loop_args)[0]


def _asks(system=True):
    return [([SYSTEM] if system else []) + [{"role": "user", "content": question(*q)}] for q in QUESTIONS]


@pytest.mark.slow
@pytest.mark.parametrize("think", [False, True])
def test_batched_loop_equals_one_at_a_time(tool_model, think):
    model, tokenizer = tool_model
    cfg = SamplingConfig(temperature=0, max_new_tokens=96)
    conversations = _asks()
    batched = run_tool_loop(model, tokenizer, conversations, cfg, tools=["calculator"], think=think)
    alone = [run_tool_loop(model, tokenizer, [c], cfg, tools=["calculator"], think=think)[0] for c in conversations]
    grouped, _ = converse(model, tokenizer, conversations, cfg, 5, tools=["calculator"], think=think)
    for b, a, g in zip(batched, alone, grouped):
        assert b.messages == a.messages == g.messages and b.end == a.end == g.end
        assert b.ids == a.ids == g.ids and b.texts == a.texts
    assert conversations == _asks()  # the inputs are not modified
    # the tool run calls the calculator and then answers; every call's result is the calculator's own
    assert sum(r.turns >= 2 for r in batched) >= 9
    for r in batched:
        calls = {c["id"]: c for m in r.messages for c in m.get("tool_calls", [])}
        assert len(calls) == sum(len(reply.tool_calls) for reply in r.replies)  # ids unique in the conversation
        for message in r.messages:
            if message["role"] == "tool":
                arguments = json.loads(calls[message["tool_call_id"]]["function"]["arguments"])
                assert message["content"] == evaluate(arguments["expression"])
        if r.end == "answer":
            assert r.final_content == r.messages[-1]["content"] and not r.replies[-1].tool_calls


@pytest.mark.slow
def test_loop_ends_rows_that_do_not_fit_and_stops_at_max_turns(tool_model):
    model, tokenizer = tool_model
    cfg = SamplingConfig(temperature=0, max_new_tokens=64)
    long = [SYSTEM, {"role": "user", "content": "What is 1 + 1? " * 300}]
    conversations = _asks()[:3]
    rollouts = run_tool_loop(model, tokenizer, [conversations[0], long, conversations[1], conversations[2]], cfg,
                             tools=["calculator"])
    assert rollouts[1].end == "context" and rollouts[1].turns == 0 and rollouts[1].messages == long
    alone = run_tool_loop(model, tokenizer, conversations, cfg, tools=["calculator"])
    assert [r.messages for r in rollouts[:1] + rollouts[2:]] == [r.messages for r in alone]

    once = run_tool_loop(model, tokenizer, conversations, cfg, tools=["calculator"], max_turns=1)
    for r, full in zip(once, alone):
        assert r.turns == 1 and r.replies[0] == full.replies[0]
        if r.replies[0].tool_calls:  # still calling after its one turn: the tool results have no reply
            assert r.end == "max_turns" and r.messages[-1]["role"] == "tool" and not r.finished


# ---------------------------------------------------------------------------------------------- eval --toolcall


@pytest.mark.slow
def test_toolcall_eval_on_the_tool_runs_own_conversations(tool_model, tmp_path):
    model, tokenizer = tool_model
    path = write_tool_sft(tmp_path / "tools.jsonl")
    lines = []
    result = run_eval((model, tokenizer), EvalOptions(toolcall=path, max_new_tokens=64, batch_size=8, quiet=True,
                                                      precision="fp32"),
                      log=lines.append)["toolcall"]
    assert result["records"] == result["records_with_calls"] == result["answer_records"] == 2 * len(QUESTIONS)
    assert result["parse_rate"] >= 0.9 and result["valid_call_rate"] >= 0.9 and result["no_call_agreement"] is None
    assert "parse rate" in lines[0] and "answer accuracy (24 records)" in lines[0]

    # the same numbers, computed directly: each record on its own through the loop, compared by hand
    cases = read_toolcall(path)
    cfg = SamplingConfig(temperature=0, max_new_tokens=64)
    parsed = matched = correct = 0
    for case, (a, op, b) in zip(cases, [q for q in QUESTIONS for _ in (0, 1)]):
        assert case["calls"] == [("calculator", {"expression": f"{a} {op} {b}"})]
        assert case["answer"] == f"The answer is {evaluate(f'{a} {op} {b}')}."
        rollout = run_tool_loop(model, tokenizer, [case["prompt"]], cfg, tools=["calculator"])[0]
        first = rollout.replies[0]
        parsed += bool(first.tool_calls) and not first.errors
        matched += [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first.tool_calls] \
            == case["calls"]
        correct += rollout.final_content.strip() == case["answer"]
    n = len(cases)
    assert result["parse_rate"] == parsed / n and result["call_match_rate"] == matched / n
    assert result["answer_accuracy"] == correct / n


def test_toolcall_records_and_call_checks_by_hand(tmp_path):
    schema = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"]}}}
    calling = [{"role": "system", "content": "Be brief.", "tools": json.dumps([schema])},
               {"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": json.dumps(
                   [{"name": "lookup", "arguments": json.dumps({"city": "Oslo"})}])},
               {"role": "tool", "content": "4 C"},
               {"role": "assistant", "content": "<think>\nit is cold\n</think>\n\nIt is 4 C."}]
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    path = _write(tmp_path / "calls.jsonl", [{"conversations": calling}, {"conversations": plain}])
    first, second = read_toolcall(path)
    assert first["prompt"] == calling[:2] and first["schemas"] == {"lookup": schema["function"]}
    assert first["calls"] == [("lookup", {"city": "Oslo"})] and first["answer"] == "It is 4 C."
    assert second == {"where": f"{path}:2", "prompt": plain[:1], "schemas": {}, "calls": [], "answer": "Hello!"}
    assert len(read_toolcall(path, limit=1)) == 1

    def call(name, arguments):
        return {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    schemas = first["schemas"]
    assert valid_call(call("lookup", {"city": "Oslo", "unit": "C"}), schemas)
    assert not valid_call(call("lookup", {"unit": "C"}), schemas)  # a required argument missing
    assert not valid_call(call("weather", {"city": "Oslo"}), schemas)  # not a declared tool
    reference = [("lookup", {"city": "Oslo"}), ("lookup", {"city": "Bergen"})]
    assert calls_match([call("lookup", {"city": "Bergen"}), call("lookup", {"city": "Oslo"})], reference)
    assert not calls_match([call("lookup", {"city": "Oslo"})], reference)
    assert not calls_match([call("lookup", {"city": "Oslo", "unit": "C"}), call("lookup", {"city": "Bergen"})],
                           reference)


def test_same_answer_ignores_only_whitespace():
    assert same_answer("  The answer is\n 84. ", "The answer is 84.")
    assert not same_answer("The answer is 84", "The answer is 84.")


# ---------------------------------------------------------------------------------------------- eval --gsm8k


def _questions_file(path: Path) -> Path:
    """tool_run's questions as GSM8K records with their true answers."""
    records = []
    for a, op, b in QUESTIONS:
        truth = evaluate(f"{a} {op} {b}")
        steps = f"{a} {op} {b} = <<{a}{op}{b}={truth}>>{truth}"
        records.append({"question": question(a, op, b), "answer": f"{steps}\n#### {truth}"})
    return _write(path, records)


@pytest.mark.slow
def test_gsm8k_eval_with_and_without_the_calculator(tool_model, tmp_path):
    model, tokenizer = tool_model
    path = _questions_file(tmp_path / "gsm.jsonl")
    truths = [evaluate(" ".join(map(str, q))) for q in QUESTIONS]
    assert [p.gold for p in read_gsm8k(path)] == truths
    cfg = SamplingConfig(temperature=0, max_new_tokens=64)
    for tools in (["calculator"], []):
        lines = []
        result = run_eval((model, tokenizer), EvalOptions(gsm8k=path, tools=",".join(tools), max_new_tokens=64,
                          batch_size=5, quiet=True, precision="fp32"), log=lines.append)["gsm8k"]
        # fp32 as the direct loop below: the eval's auto is bf16 on a CPU with native bf16, and an untrained
        # model's greedy ties flip on its rounding
        direct = run_tool_loop(model, tokenizer, [[{"role": "user", "content": question(*q)}] for q in QUESTIONS],
                               cfg, tools=tools)
        right = [re.findall(r"\d+", r.final_content)[-1:] == [t] for r, t in zip(direct, truths)]
        assert result["accuracy"] == sum(right) / len(right)
        assert [row["correct"] for row in result["per_record"]] == right
        assert result["mean_turns"] == sum(r.turns for r in direct) / len(direct)
        assert "accuracy" in lines[0] and "tokens/s" in lines[0]
        if tools:
            calls = sum(len(reply.tool_calls) for r in direct for reply in r.replies)
            assert result["tool_calls"] == calls > 0 and result["tool_call_parse_rate"] >= 0.9
            assert result["mean_turns"] >= 1.5 and "tool-call parse rate" in lines[0]
        else:
            assert "tool_calls" not in result and "tool-call parse rate" not in lines[0]
            # a call without tools gets an error result the model can read, never a run calculator
            results = [m["content"] for r in direct for m in r.messages if m["role"] == "tool"]
            assert all(c.startswith("Error: unknown tool 'calculator'") for c in results)


@pytest.mark.slow
def test_gsm8k_through_the_cli_writes_json(tool_run_dir, tool_model, tmp_path):
    path = _questions_file(tmp_path / "gsm.jsonl")
    out = tmp_path / "result.json"
    r = subprocess.run([sys.executable, "-m", "nanoforge", "eval", str(tool_run_dir), "--gsm8k", str(path),
                        "--tools", "calculator", "--limit", "4", "--max-new-tokens", "64", "--json", str(out),
                        "--quiet"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "gsm8k (4 problems, tools: calculator)" in r.stdout and "accuracy" in r.stdout
    got = json.loads(out.read_text())["gsm8k"]
    here = run_eval(tool_model, EvalOptions(gsm8k=path, tools="calculator", limit=4, max_new_tokens=64, quiet=True),
                    log=lambda *a: None)["gsm8k"]
    assert got["file"] == str(path) and got["problems"] == 4
    assert [row["content"] for row in got["per_record"]] == [row["content"] for row in here["per_record"]]
    assert got["accuracy"] == here["accuracy"]


# ---------------------------------------------------------------------------------------------- odd shapes, long records


def _odd_and_plain_records(tmp_path: Path) -> tuple[Path, Path]:
    """Records in shapes `prepare` accepts but spells oddly (a whitespace `tools` string, an empty-string
    `tool_calls`, a call with both an empty "function" and a "name"), and the same records spelt plainly."""
    plain = [conversation(*q, think=False) for q in QUESTIONS[:3]]
    odd = json.loads(json.dumps(plain))
    for record in odd:
        call = record[2]["tool_calls"][0]
        record[2]["tool_calls"] = [{"function": {}, "name": "calculator", "arguments": call["function"]["arguments"]}]
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    plain.append([SYSTEM, *chat])
    odd.append([{**SYSTEM, "tools": " \n "}, chat[0], {**chat[1], "tool_calls": ""}])
    return (_write(tmp_path / "odd.jsonl", [{"conversations": c} for c in odd]),
            _write(tmp_path / "plain.jsonl", [{"conversations": c} for c in plain]))


def test_toolcall_reads_odd_shapes_as_prepare_does(tmp_path, tiny_tokenizer):
    from nanoforge.data.prepare import prepare_dataset

    odd, plain = _odd_and_plain_records(tmp_path)
    def seen(path):  # what eval --toolcall takes from each record: its rendered prompt and the references
        return [(tiny_tokenizer.render_text(c["prompt"], add_generation_prompt=True), c["schemas"], c["calls"],
                 c["answer"]) for c in read_toolcall(path)]
    assert seen(odd) == seen(plain)
    # and prepare renders both files to the same tokens and masks
    for path in (odd, plain):
        prepare_dataset("sft", [path], tiny_tokenizer, tmp_path / path.stem, val_fraction=0.0, workers=1,
                        log=lambda *a: None)
    shards = [sorted(p for p in (tmp_path / name).iterdir() if p.suffix in (".bin", ".idx", ".mask"))
              for name in ("odd", "plain")]
    assert len(shards[0]) == 3 and [p.read_bytes() for p in shards[0]] == [p.read_bytes() for p in shards[1]]


def _eval_cli(run_dir: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoforge", "eval", str(run_dir), *map(str, args),
                           "--max-new-tokens", "64", "--quiet"], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.slow
def test_toolcall_cli_scores_odd_shapes_and_skips_a_record_longer_than_the_context(tool_run_dir, tool_model,
                                                                                   tmp_path):
    odd, plain = _odd_and_plain_records(tmp_path)
    long = {"conversations": [{"role": "user", "content": "What is 1 + 1? " * 140_000},  # 2 MB
                              {"role": "assistant", "content": "2"}]}
    with open(odd, "a", encoding="utf-8") as f:
        f.write(json.dumps(long) + "\n")
    r = _eval_cli(tool_run_dir, "--toolcall", odd, "--json", tmp_path / "odd.json")
    assert r.returncode == 0, r.stderr
    assert f"1 of 5 records skipped, not scored: the prompt and --max-new-tokens 64 do not fit the model's " \
           f"context (512 tokens); first: {odd}:5" in r.stdout
    assert "toolcall (4 records)" in r.stdout and re.search(r"too long for the context \(not scored\) +1", r.stdout)
    got = json.loads((tmp_path / "odd.json").read_text())["toolcall"]
    here = run_eval(tool_model, EvalOptions(toolcall=plain, max_new_tokens=64, quiet=True), log=lambda *a: None)["toolcall"]
    assert (got["records"], got["too_long"], got["too_long_records"]) == (4, 1, [f"{odd}:5"])
    strip = lambda rows: [{k: v for k, v in row.items() if k != "where"} for row in rows]  # noqa: E731
    assert strip(got["per_record"]) == strip(here["per_record"])
    assert got["call_match_rate"] == here["call_match_rate"] and got["parse_rate"] == here["parse_rate"]


@pytest.mark.slow
def test_gsm8k_cli_skips_a_question_longer_than_the_context(tool_run_dir, tool_model, tmp_path):
    path = _questions_file(tmp_path / "gsm.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines()[:3]
    huge = {"question": "What is 1 + 1? " * 140_000, "answer": "#### 2"}  # 2 MB, never tokenized whole
    _write(path, [lines[0], huge, lines[1], lines[2]])
    r = _eval_cli(tool_run_dir, "--gsm8k", path, "--tools", "calculator", "--json", tmp_path / "out.json")
    assert r.returncode == 0, r.stderr
    assert "1 of 4 problems skipped, not scored" in r.stdout and f"first: {path}:2" in r.stdout
    got = json.loads((tmp_path / "out.json").read_text())["gsm8k"]
    _write(path, lines)
    here = run_eval(tool_model, EvalOptions(gsm8k=path, tools="calculator", max_new_tokens=64, quiet=True),
                    log=lambda *a: None)["gsm8k"]
    assert (got["problems"], got["too_long"], here["too_long"]) == (3, 1, 0)
    assert got["accuracy"] == here["accuracy"]  # over the three that fit
    assert [row["where"] for row in got["per_record"]] == [f"{path}:{n}" for n in (1, 3, 4)]
