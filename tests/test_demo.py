"""`nanoforge demo`: the corpus it builds from the documentation on this machine, and the whole pipeline
end to end at a shrunk scale."""
import json
import math
import re
from pathlib import Path

import pytest

from nanoforge import demo
from nanoforge.data.jsonl import validate_record
from nanoforge.errors import NanoforgeError
from nanoforge.tokenizer import load_tokenizer

SMALL_MB = 1.6  # the standard library and the reference topics, not the dependencies: a few seconds


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo.build_demo_corpus(tmp_path_factory.mktemp("corpus"), max_mb=SMALL_MB)


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def test_corpus_records_are_valid_and_sized(corpus):
    pretrain_path, sft_path, questions = corpus
    docs, convs = read_jsonl(pretrain_path), read_jsonl(sft_path)
    for record in docs:
        validate_record("pretrain", record)
    for record in convs:
        validate_record("sft", record)
        user, assistant = record["conversations"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert assistant["content"] == assistant["content"].strip()  # leading whitespace breaks the loss mask
        assert len(assistant["content"]) <= demo.MAX_ANSWER_CHARS + 100  # signatures may run a little longer
    text_mb = sum(len(r["text"]) for r in docs) / 1e6
    assert SMALL_MB <= text_mb <= 1.5 * SMALL_MB  # docstrings up to the cap, plus names and signatures
    assert len(docs) > 1000 and len(convs) > 1000
    assert any(r["text"].startswith("json.dumps(obj, *, skipkeys=False") for r in docs)
    assert any(r["text"].startswith('The "assert" statement') for r in docs)  # pydoc_data reference topics


def test_held_out_questions_are_in_pretraining_only(corpus):
    pretrain_path, sft_path, questions = corpus
    assert {q["name"] for q in questions} == set(demo.HELD_OUT + demo.SEEN)
    docs = pretrain_path.read_text(encoding="utf-8")
    asked = {json.loads(line)["conversations"][0]["content"] for line in sft_path.read_text().splitlines()}
    for q in questions:
        assert q["expected"] and q["question"].endswith(("?", "."))
        assert json.dumps(q["name"])[1:-1] in docs  # its documentation was in pretraining
        assert (q["question"] in asked) == (not q["held_out"])
        mentions = re.compile(re.escape(q["name"]) + r"(?![\w.])")
        assert any(mentions.search(a) for a in asked) == (not q["held_out"])


def test_corpus_is_deterministic(corpus, tmp_path):
    again = demo.build_demo_corpus(tmp_path, max_mb=SMALL_MB)
    assert again[0].read_bytes() == corpus[0].read_bytes()
    assert again[1].read_bytes() == corpus[1].read_bytes()
    assert again[2] == corpus[2]


def test_module_docs_reads_public_definitions_and_signatures():
    source = '''"""A module."""
class Box:
    """Holds things."""
    def __init__(self, size, *, color="red"):
        """Make a box."""
    def put(self, item, /, where=None):
        """Put an item in. It stays there.

        Details nobody asks about."""
        def helper():
            """Nested: an implementation detail."""
    @staticmethod
    def make(self_like):
        """Static: keeps its first argument."""
    @property
    def full(self):
        """Whether the box is full."""
    def _private(self):
        """Hidden."""
def _hidden():
    """Hidden too."""
'''
    entries = {e.name: e for e in demo.module_docs("pkg.mod", source)}
    assert set(entries) == {"pkg.mod", "pkg.mod.Box", "pkg.mod.Box.put", "pkg.mod.Box.make", "pkg.mod.Box.full"}
    assert entries["pkg.mod.Box"].signature == "(size, *, color='red')"
    assert entries["pkg.mod.Box.put"].signature == "(item, /, where=None)"
    assert entries["pkg.mod.Box.make"].signature == "(self_like)"
    assert entries["pkg.mod.Box.full"].signature == ""
    assert demo.pretrain_text(entries["pkg.mod.Box"]).startswith("class pkg.mod.Box(size, *, color='red')\n\n")
    assert demo.module_docs("broken", "def f(:\n") == []


def test_first_paragraph_is_short_prose_that_ends():
    assert demo.first_paragraph("Return the median\nof the data.\n\nMore.") == "Return the median of the data."
    long = "First sentence is here. " + "word " * 80 + "end."
    assert demo.first_paragraph(long) == "First sentence is here."
    assert demo.first_paragraph("word " * 80) is None  # no sentence end to cut at
    assert demo.first_paragraph("makedirs(name [, mode=0o777][, exist_ok=False])") is None
    assert demo.first_paragraph(">>> f(1)\n2") is None
    assert demo.first_paragraph("Short.") is None


def test_sft_conversations_ask_about_the_thing():
    entry = demo.DocEntry("json.dumps", "function", "(obj)", "Serialize obj to a JSON formatted str.\n\nMore.")
    conversations = demo.sft_conversations(entry)
    question, answer = conversations[0]
    assert "json.dumps" in question["content"] and answer["content"] == "Serialize obj to a JSON formatted str."
    topic = demo.DocEntry('The "assert" statement', "topic", "", 'The "assert" statement\n****\n\nAssert '
                          "statements are a convenient way to insert debugging assertions.\n\nMore.")
    (question, answer), = demo.sft_conversations(topic)
    assert question["content"] == 'Explain the "assert" statement in Python.'
    assert answer["content"] == "Assert statements are a convenient way to insert debugging assertions."
    continued = demo.DocEntry('The "assert" statement', "topic", "", "Later paragraphs of the same topic.")
    assert demo.sft_conversations(continued) == []


def test_the_reference_topics_are_read_without_importing(tmp_path):
    stdlib = tmp_path
    (stdlib / "pydoc_data").mkdir()
    topics = {"b": "Second\n******\n\n" + "para. " * 300 + "\n\n" + "more. " * 300, "a": "First\n*****\n\nText."}
    (stdlib / "pydoc_data" / "topics.py").write_text(f"import sys; sys.exit(1)\ntopics = {topics!r}\n")
    entries = demo.reference_topics(stdlib)
    assert [e.name for e in entries] == ["First", "Second", "Second"]  # sorted by key, long topic cut in two
    assert all(len(e.doc) <= demo.TOPIC_CHUNK_CHARS + 100 for e in entries)
    assert entries[0].doc == "First\n*****\n\nText."


def test_work_dir_is_wiped_only_when_the_demo_made_it(tmp_path):
    work = tmp_path / "demo"
    demo.fresh_work_dir(work, quiet=True)
    (work / "old.txt").write_text("from the last run")
    demo.fresh_work_dir(work, quiet=True)
    assert not (work / "old.txt").exists() and (work / demo.DEMO_MARKER).is_file()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(NanoforgeError, match="not made by `nanoforge demo`"):
        demo.fresh_work_dir(foreign, quiet=True)
    assert (foreign / "thesis.tex").read_text() == "precious"


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(NanoforgeError, match="unknown demo scale"):
        demo.run_demo(tmp_path / "d", scale="huge")
    with pytest.raises(NanoforgeError, match="minutes"):
        demo.run_demo(tmp_path / "d", minutes=0)


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys):
    """The whole pipeline at the "test" scale: a report, a pretraining validation loss below a uniform guess,
    and the replies printed."""
    report = demo.run_demo(tmp_path / "demo", scale="test")
    out = capsys.readouterr().out
    assert report == tmp_path / "demo" / "report.md" and report.is_file()
    text = report.read_text()
    assert "## pretrain" in text and "## sft" in text and "## Sample replies" in text
    val = [json.loads(line)["val_loss"] for line in (tmp_path / "demo" / "pretrain" / "metrics.jsonl")
           .read_text().splitlines() if "val_loss" in line]
    vocab = load_tokenizer(tmp_path / "demo" / "tokenizer").vocab_size
    assert val and val[-1] < math.log(vocab) - 0.5  # well below what a uniform guess scores
    rows = [line for line in text.splitlines() if line.startswith("| ") and line.endswith((" yes |", " no |"))]
    assert rows and out.count("\n  A: ") == len(rows)  # every question asked got a printed reply
    assert "Q (held out of SFT)" in out and f"report: {report}" in out
