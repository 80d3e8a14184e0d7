"""RL prompt records: each shape, each error with its path:line: field message, GSM8K, resumable order."""
from __future__ import annotations

import json

import pytest

from conftest import _missing_shared_data, shared_data_dir
from nanoforge.data.jsonl import DataError
from nanoforge.core.errors import NanoforgeError
from nanoforge.rl.prompts import PromptIterator, PromptRecord, read_prompts

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def _write(tmp_path, lines, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line, ensure_ascii=False)) + "\n"
                            for line in lines), encoding="utf-8")
    return path


def test_chat_prompt_ending_in_a_user_turn_keeps_extra_fields(tmp_path):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = _write(tmp_path, [{"conversations": conversation, "answer": 4, "topic": "math"}])
    [record] = read_prompts(path)
    assert record.messages == conversation
    assert (record.answer, record.gt, record.tools) == ("4", None, None)
    assert record.extra == {"topic": "math"}
    assert record.source == f"{path}:1"
    assert record.reward_record() == {"topic": "math", "messages": conversation, "answer": "4", "gt": None,
                                      "_where": f"{path}:1"}


def test_minimind_rlaif_placeholder_assistant_turn_is_dropped(tmp_path):
    user = {"role": "user", "content": "你好，请介绍一下自己。"}
    path = _write(tmp_path, ["", {"conversations": [user, {"role": "assistant", "content": ""}]}])
    [record] = read_prompts(path)  # the blank first line is skipped
    assert record.messages == [user] and record.source.endswith(":2")


def test_gsm8k_record_gives_one_user_message_and_the_number_after_hashes(tmp_path):
    path = _write(tmp_path, [{"question": "How many?", "answer": "48/2 = <<48/2=24>>24\n#### 1,072"},
                             {"question": "And now?", "answer": "72"}])
    first, second = read_prompts(path)
    assert first.messages == [{"role": "user", "content": "How many?"}]
    assert first.answer == "1072" and second.answer == "72"


def test_agentic_record_with_gt_and_tools_on_the_system_message(tmp_path):
    system = {"role": "system", "content": "Use tools.", "tools": json.dumps(TOOLS)}
    user = {"role": "user", "content": "What is 17*23?"}
    path = _write(tmp_path, [{"conversations": [system, user], "gt": ["391"]},
                             {"question": "Capital of France?", "gt": "Paris"}])
    agentic, plain = read_prompts(path)
    assert agentic.messages == [system, user] and agentic.gt == ["391"] and agentic.tools == TOOLS
    assert plain.gt == ["Paris"] and plain.answer is None


def test_a_prompt_may_end_with_tool_results_but_not_with_a_calling_assistant(tmp_path):
    call = {"name": "calculator", "arguments": {"expression": "17*23"}}
    system = {"role": "system", "content": "Use tools.", "tools": TOOLS}
    head = [system, {"role": "user", "content": "17*23?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    path = _write(tmp_path, [{"conversations": head + [{"role": "tool", "content": "391"}], "gt": "391"},
                             {"conversations": head, "gt": "391"}])
    with pytest.raises(DataError, match=r':2: "conversations"\[2\].content: the prompt ends with an assistant'):
        read_prompts(path)
    [record] = read_prompts(path, limit=1)
    assert record.messages[-1] == {"role": "tool", "content": "391"} and record.tools == TOOLS


@pytest.mark.parametrize("line, where, message", [
    ('{"conversations": [', ':2', "invalid JSON"),
    ({"prompt": "hi"}, ':2', 'expected "conversations"'),
    ({"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
     ':2: "conversations"[1].content', "ends with an assistant turn that has content"),
    ({"conversations": [{"role": "user", "content": 3}]}, ':2: "conversations"[0].content', "must be a string"),
    ({"conversations": [{"role": "bot", "content": "hi"}]}, ':2: "conversations"[0].role', '"bot" is not one of'),
    ({"conversations": [{"role": "system", "content": "hi"}]}, ':2: "conversations"', "needs a user turn"),
    ({"conversations": "hi"}, ':2: "conversations"', "must be a list"),
    ({"question": 7, "answer": "7"}, ':2: "question"', "must be a string"),
    ({"question": "q", "answer": ["7"]}, ':2: "answer"', "must be a string"),
    ({"question": "q", "answer": "work #### "}, ':2: "answer"', 'nothing after "####"'),
    ({"question": "q", "gt": [1]}, ':2: "gt"[0]', "must be a string"),
    ({"question": "q", "gt": []}, ':2: "gt"', "non-empty list"),
    ([1, 2], ':2', "must be a JSON object"),
    ('{"question": "q", "gt": ' + "[" * 1000 + "]" * 1000 + "}", ':2', "invalid JSON: nested deeper than 100 levels"),
    ('{"question": "q", "answer": ' + "7" * 5000 + "}", ':2', "invalid JSON: a number of 5000 digits"),
    ({"conversations": [{"role": "system", "content": "s", "tools": "[" * 1000}, {"role": "user", "content": "q"}]},
     ':2: "conversations"[0].tools', "not valid JSON: nested deeper than 100 levels at column 101"),
])
def test_errors_name_file_line_and_field(tmp_path, line, where, message):
    path = _write(tmp_path, [{"question": "fine", "answer": "#### 1"}, line])
    with pytest.raises(DataError) as error:
        read_prompts(path)
    text = str(error.value)
    assert text.startswith(f"{path}{where}") and message in text, text


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_prompts(tmp_path / "absent.jsonl")
    with pytest.raises(DataError, match="is empty"):
        read_prompts(_write(tmp_path, [""]))


def test_reads_the_first_gsm8k_records():
    shared = shared_data_dir()
    if shared is None or not (shared / "gsm8k" / "train.jsonl").is_file():
        _missing_shared_data("reading GSM8K prompts")
    records = read_prompts(shared / "gsm8k" / "train.jsonl", limit=3)
    assert len(records) == 3
    assert records[0].messages[0]["content"].startswith("Natalia sold clips to 48 of her friends")
    assert [r.answer for r in records] == ["72", "10", "5"]


# ---------------------------------------------------------------------------------------------- order


def _records(n):
    return [PromptRecord([{"role": "user", "content": str(i)}], source=str(i)) for i in range(n)]


def _ids(prompts):
    return [p.source for p in prompts]


def test_each_epoch_is_a_permutation_and_a_resumed_iterator_continues_exactly():
    records = _records(10)
    whole = PromptIterator(records, prompts_per_step=3, seed=5)
    steps = [_ids(whole.next_prompts()) for _ in range(8)]  # 24 prompts: crosses two epoch ends
    flat = sum(steps, [])
    assert sorted(flat[:10]) == sorted(map(str, range(10))) and flat[:10] != flat[10:20]
    first = PromptIterator(records, prompts_per_step=3, seed=5)
    for _ in range(4):
        first.next_prompts()
    state = json.loads(json.dumps(first.state_dict()))  # as it goes through state.json
    resumed = PromptIterator(records, prompts_per_step=3, seed=5)
    resumed.load_state_dict(state)
    assert [_ids(resumed.next_prompts()) for _ in range(4)] == steps[4:]
    assert PromptIterator(records, 3, seed=6).next_prompts() != steps[0]


def test_ranks_take_disjoint_slices_of_the_single_process_order():
    records = _records(12)
    single = PromptIterator(records, prompts_per_step=4, seed=1)
    ranks = [PromptIterator(records, prompts_per_step=2, seed=1, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        assert _ids(ranks[0].next_prompts()) + _ids(ranks[1].next_prompts()) == _ids(single.next_prompts())


def test_resume_refuses_other_prompts_or_seed_and_too_few_prompts():
    saved = PromptIterator(_records(10), 2, seed=0).state_dict()
    with pytest.raises(NanoforgeError, match="num_prompts=10"):
        PromptIterator(_records(11), 2, seed=0).load_state_dict(saved)
    with pytest.raises(NanoforgeError, match="seed=0"):
        PromptIterator(_records(10), 2, seed=1).load_state_dict(saved)
    with pytest.raises(NanoforgeError, match="one step takes 6"):
        PromptIterator(_records(5), 3, seed=0, rank=0, world_size=2)


def test_odd_but_accepted_tool_fields_read_as_prepare_reads_them(tmp_path, tiny_tokenizer):
    from nanoforge.rl.agent import agent_prompt

    user = {"role": "user", "content": "Hi"}
    path = _write(tmp_path, [{"conversations": [{"role": "system", "content": "Be brief.", "tools": " \n "}, user],
                              "gt": "x"},
                             {"conversations": [user, {"role": "assistant", "content": "", "tool_calls": "[]"}]}])
    spaced, placeholder = read_prompts(path)
    assert spaced.tools == [] and placeholder.messages == [user]  # an empty tool_calls list is a placeholder
    plain = PromptRecord([{"role": "system", "content": "Be brief."}, user], tools=[])
    assert agent_prompt(tiny_tokenizer, spaced, ["calculator"], False) == \
        agent_prompt(tiny_tokenizer, plain, ["calculator"], False)
