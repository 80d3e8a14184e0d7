"""Strict JSONL reading: every kind of bad input names its file, line and field; BOM and CRLF just work;
and all real data in ../shared/data passes."""
from __future__ import annotations

import json
import pickle

import pytest

from nanoforge.chat.messages import RecordError
from nanoforge.data.jsonl import DataError, SkipCounter, iter_records, validate_record
from nanoforge.core.errors import NanoforgeError

U, A, S = "user", "assistant", "system"


def msg(role, content="x"):
    return {"role": role, "content": content}


def conv(*roles):
    return [msg(r, f"{r} {i}") for i, r in enumerate(roles)]


GOOD = {
    "pretrain": {"text": "hello"},
    "sft": {"conversations": conv(S, U, A, U, A)},
    "dpo": {"chosen": conv(U, A, U, A), "rejected": conv(U, A, U) + [msg(A, "worse")]},
}

# (kind, bad line, field expected in the error, words expected in the message)
BAD_RECORDS = [
    ("pretrain", '{"text": "unterminated', None, "invalid JSON"),
    ("pretrain", '[{"text": "in a list"}]', None, "must be a JSON object, got a list"),
    ("pretrain", '"just a string"', None, "must be a JSON object, got a string"),
    ("pretrain", '{"content": "wrong key"}', None, 'missing "text"'),
    ("pretrain", '{"text": 42}', '"text"', "must be a string, got a number"),
    ("pretrain", '{"text": null}', '"text"', "must be a string, got null"),
    ("pretrain", '{"text": ""}', '"text"', "is empty"),
    ("sft", '{"messages": []}', None, 'missing "conversations"'),
    ("sft", '{"conversations": []}', '"conversations"', "empty conversation"),
    ("sft", '{"conversations": {"role": "user"}}', '"conversations"', "must be a list of messages"),
    ("sft", json.dumps({"conversations": [msg(U), "hi"]}), '"conversations"[1]', "must be an object"),
    ("sft", json.dumps({"conversations": [msg(U), {"role": A}]}), '"conversations"[1]', 'missing "content"'),
    ("sft", json.dumps({"conversations": [msg(U), {"role": A, "content": ["x"]}]}),
     '"conversations"[1].content', "must be a string, got a list"),
    ("sft", json.dumps({"conversations": [msg(U), msg(A), msg(U), msg("bot")]}),
     '"conversations"[3].role', '"bot" is not one of system, user, assistant'),
    ("sft", json.dumps({"conversations": [msg(U), msg(U), msg(A)]}),
     '"conversations"[1].role', 'expected "assistant" after "user", got "user"'),
    ("sft", json.dumps({"conversations": [msg(S), msg(S), msg(U), msg(A)]}),
     '"conversations"[1].role', 'expected "user" after "system", got "system"'),
    ("sft", json.dumps({"conversations": [msg(A), msg(U), msg(A)]}),
     '"conversations"[0].role', 'expected "system" or "user" as the first message, got "assistant"'),
    ("sft", json.dumps({"conversations": [msg(U), msg(A), msg(S), msg(A)]}),
     '"conversations"[2].role', 'expected "user" after "assistant", got "system"'),
    ("sft", json.dumps({"conversations": [msg(U), msg(A), msg(U)]}),
     '"conversations"', 'must end with an assistant message, ends with "user"'),
    ("dpo", json.dumps({"chosen": conv(U, A)}), None, 'missing "rejected"'),
    ("dpo", json.dumps({"chosen": conv(U, U), "rejected": conv(U, A)}), '"chosen"[1].role', "expected"),
    ("dpo", json.dumps({"chosen": conv(U, A), "rejected": []}), '"rejected"', "empty conversation"),
    ("dpo", json.dumps({"chosen": conv(U, A, U, A), "rejected": [msg(U, "other")] + conv(U, A, U, A)[1:3] +
                        [msg(A, "worse")]}), '"rejected"[0]', "must share every message but the final"),
    ("dpo", json.dumps({"chosen": conv(U, A, U, A), "rejected": conv(U, A)}), '"rejected"',
     'has 2 messages but "chosen" has 4'),
    ("dpo", json.dumps({"chosen": conv(U, A), "rejected": conv(U, A)}), '"rejected"[1].content',
     "identical to the final"),
]


def write_lines(path, lines, end="\n"):
    path.write_text("".join(line + end for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("kind,bad,field,words", BAD_RECORDS, ids=[f"{c[0]}-{c[3][:30]}" for c in BAD_RECORDS])
def test_bad_record_names_file_line_and_field(tmp_path, kind, bad, field, words):
    good = json.dumps(GOOD[kind])
    path = write_lines(tmp_path / f"{kind}.jsonl", [good, good, "", bad, good])
    with pytest.raises(DataError) as caught:
        list(iter_records(path, kind))
    error = caught.value
    assert (error.path, error.line, error.field) == (str(path), 4, field)
    prefix = f"{path}:4: " + (f"{field}: " if field else "")
    assert str(error).startswith(prefix), str(error)
    assert words in str(error)
    assert isinstance(error, NanoforgeError)


def test_error_text_matches_the_style_guide_example():
    error = DataError('"bot" is not one of system, user, assistant', "data/sft.jsonl", 1042, '"conversations"[3].role')
    assert str(error) == 'data/sft.jsonl:1042: "conversations"[3].role: "bot" is not one of system, user, assistant'
    assert str(DataError("is empty (no records)", "a.jsonl")) == "a.jsonl: is empty (no records)"
    copy = pickle.loads(pickle.dumps(error))  # errors travel back from prepare's worker processes
    assert (copy.path, copy.line, copy.field, str(copy)) == (error.path, error.line, error.field, str(error))


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: invalid UTF-8") as caught:
        list(iter_records(path, "pretrain"))
    assert caught.value.line == 2


def test_json_array_file_gets_a_hint(tmp_path):
    path = tmp_path / "alpaca.json"
    path.write_text('[\n  {"text": "a"}\n]\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"alpaca\.json:1: invalid JSON.*JSON array: JSONL needs one JSON object"):
        list(iter_records(path, "pretrain"))


@pytest.mark.parametrize("content,words", [
    (b"", "is empty"),
    (b"\n  \n\r\n", "is empty"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00\x00", "binary file"),
    (b"\x1f\x8b\x08\x00\x00\x00\x00\x00", "gzip-compressed"),
])
def test_unreadable_files_name_the_path(tmp_path, content, words):
    path = tmp_path / "input.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=words) as caught:
        list(iter_records(path, "pretrain"))
    assert caught.value.path == str(path) and caught.value.line is None
    assert str(caught.value).startswith(f"{path}: ")


def test_missing_path_and_directory_name_the_path(tmp_path):
    with pytest.raises(DataError, match="no such file") as caught:
        list(iter_records(tmp_path / "missing.jsonl", "sft"))
    assert caught.value.path == str(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="is a directory") as caught:
        list(iter_records(tmp_path, "sft"))
    assert caught.value.path == str(tmp_path)


def test_unknown_kind_is_refused(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", ['{"text": "a"}'])
    with pytest.raises(NanoforgeError, match="unknown data kind 'rlhf'"):
        list(iter_records(path, "rlhf"))


def test_bom_crlf_and_blank_lines_just_work(tmp_path):
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n\r\n   \r\n{"text": "second\\r\\nline"}\r\n{"text": "last"}')
    records = list(iter_records(path, "pretrain"))
    assert records == [(1, {"text": "first"}), (4, {"text": "second\r\nline"}), (5, {"text": "last"})]


def test_a_bom_after_line_one_is_an_error(tmp_path):
    path = tmp_path / "joined.jsonl"
    path.write_bytes(b'{"text": "a"}\n\xef\xbb\xbf{"text": "b"}\n')
    with pytest.raises(DataError, match=r"joined\.jsonl:2: invalid JSON"):
        list(iter_records(path, "pretrain"))


def test_skip_invalid_counts_and_keeps_the_first_messages(tmp_path):
    good = json.dumps(GOOD["sft"])
    bad_role = json.dumps({"conversations": [msg(U), msg("bot")]})
    lines = [good, "{oops", good, bad_role, '{"text": "wrong kind"}', good] + ["[]"] * 10
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    counter = SkipCounter()
    records = list(iter_records(path, "sft", skip_invalid=True, counter=counter))
    assert [line for line, _ in records] == [1, 3, 6]
    assert counter.skipped == 13
    assert len(counter.examples) == counter.keep == 5
    assert counter.examples[0].startswith(f"{path}:2: invalid JSON")
    assert counter.examples[1].startswith(f'{path}:4: "conversations"[1].role: "bot" is not one of')
    assert "skipped 13 invalid record(s)" in counter.summary()


def test_all_invalid_with_skip_is_still_an_error(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", ["{", "{"])
    with pytest.raises(DataError, match="has no valid pretrain records"):
        list(iter_records(path, "pretrain", skip_invalid=True))


def test_validate_record_on_its_own():
    for kind, record in GOOD.items():
        validate_record(kind, record)
    validate_record("sft", {"conversations": conv(U, A), "id": 7})  # extra keys are allowed
    validate_record("sft", {"conversations": [{"role": U, "content": ""}, {"role": A, "content": "", "x": 1}]})
    with pytest.raises(RecordError) as caught:
        validate_record("sft", {"conversations": [msg(U), msg("bot")]})
    assert caught.value.field == '"conversations"[1].role'


def test_iter_records_streams_instead_of_reading_everything(tmp_path):
    path = write_lines(tmp_path / "big.jsonl", [json.dumps({"text": "a"})] * 3 + ["{broken"])
    records = iter_records(path, "pretrain")
    assert next(records) == (1, {"text": "a"})  # yields before it reaches the broken line 4


def test_all_shared_data_is_valid(shared_data):
    manifest = json.loads((shared_data / "minimind" / "MANIFEST.json").read_text(encoding="utf-8"))
    expected = _expected_record_counts(manifest)
    assert len(expected) >= 19
    files = sorted((shared_data / "minimind").glob("*.jsonl")) + sorted((shared_data / "tiny").glob("*.jsonl"))
    for path in files:
        kind = path.name.split("_")[0]
        count = sum(1 for _ in iter_records(path, kind))
        if path.name in expected:
            assert count == expected[path.name], path.name
        assert count > 0


def _expected_record_counts(manifest) -> dict:
    """{file name: records} from shared/data/minimind/MANIFEST.json, whatever its exact shape."""
    counts = {}
    entries = manifest.get("files", manifest) if isinstance(manifest, dict) else manifest
    items = entries.items() if isinstance(entries, dict) else ((e.get("file") or e.get("name"), e) for e in entries)
    for name, entry in items:
        if isinstance(entry, dict) and isinstance(entry.get("records"), int) and name:
            counts[str(name).split("/")[-1]] = entry["records"]
    return counts
