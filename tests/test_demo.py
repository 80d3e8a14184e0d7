"""`nanoforge demo`: the corpus it builds from the documentation on this machine, the scoring of its replies, the
step timing that sizes it, and the whole pipeline end to end at a shrunk scale."""
import json
import math
import re
from pathlib import Path

import pytest
import torch

from nanoforge.core.config import build_config
from nanoforge.demo import pipeline as demo
from nanoforge.demo import corpus as demo_corpus
from nanoforge.demo import score as demo_score
from nanoforge.demo import sizing as demo_sizing
from nanoforge.data.jsonl import validate_record
from nanoforge.core.errors import NanoforgeError
from nanoforge.chat.tokenizer import load_tokenizer

SFT_SIZE = 300
# what score_line prints: "in-set 9/13 exact ...; held-out 4/6 name ... (chance 0.3/6), 0/6 exact"
SCORE_LINE = re.compile(r"in-set (\d+)/(\d+) exact first sentence or signature; held-out (\d+)/(\d+) name the "
                        r"module or an argument \(chance (\d+\.\d)/(\d+)\), (\d+)/(\d+) exact")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo_corpus.build_demo_corpus(tmp_path_factory.mktemp("corpus"), sft_size=SFT_SIZE)


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
        assert len(assistant["content"]) <= max(demo_corpus.MAX_ANSWER_CHARS, 60 + demo_corpus.MAX_SIGNATURE_CHARS)
    assert len(convs) == SFT_SIZE and len({r["conversations"][0]["content"] for r in convs}) == SFT_SIZE
    assert 100_000 <= sum(len(r["text"]) for r in docs) <= 1_000_000 and len(docs) > 500
    assert any(r["text"].startswith("json.dumps(obj, *, skipkeys=False") for r in docs)
    modules = {r["text"].split()[1] for r in docs if r["text"].startswith("module ")}
    assert {m.split(".")[0] for m in modules} <= set(demo_corpus.DEMO_MODULES)


def test_questions_asked_in_set_and_held_out(corpus):
    pretrain_path, sft_path, questions = corpus
    assert [(q["name"], q["kind"]) for q in questions] == list(demo_corpus.IN_SET + demo_corpus.HELD_OUT)
    docs = read_jsonl(pretrain_path)
    pairs = [(r["conversations"][0]["content"], r["conversations"][1]["content"]) for r in read_jsonl(sft_path)]
    every_val = round(1 / demo.VAL_FRACTION)  # prepare sends records every_val-1, 2*every_val-1, ... to val
    for q in questions:
        assert q["expected"] and q["question"].endswith("?") and q["keywords"]
        position = next(i for i, r in enumerate(docs) if r["text"].startswith(q["name"]))
        assert position < every_val - 1  # its documentation is in pretraining's training split
        mentions = re.compile(re.escape(q["name"]) + r"(?![\w.])")
        if q["held_out"]:
            assert not any(mentions.search(question + answer) for question, answer in pairs)
        else:
            assert pairs.index((q["question"], q["expected"])) < every_val - 1  # trained on, exactly
    json_dumps = next(q for q in questions if q["name"] == "json.dumps")
    assert json_dumps["kind"] == "what" and {"json", "obj", "indent"} <= set(json_dumps["keywords"])
    copyfile = next(q for q in questions if q["name"] == "shutil.copyfile")
    assert copyfile["expected"] == "shutil.copyfile(src, dst, *, follow_symlinks=True)"
    assert copyfile["keywords"] == ["src", "dst", "follow_symlinks"]  # not the module: the question names it


def test_corpus_is_deterministic(corpus, tmp_path):
    again = demo_corpus.build_demo_corpus(tmp_path, sft_size=SFT_SIZE)
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
    entries = {e.name: e for e in demo_corpus.module_docs("pkg.mod", source)}
    assert set(entries) == {"pkg.mod", "pkg.mod.Box", "pkg.mod.Box.put", "pkg.mod.Box.make", "pkg.mod.Box.full"}
    assert entries["pkg.mod.Box"].signature == "(size, *, color='red')"
    assert entries["pkg.mod.Box.put"].signature == "(item, /, where=None)"
    assert entries["pkg.mod.Box.make"].signature == "(self_like)"
    assert entries["pkg.mod.Box.full"].signature == ""
    assert demo_corpus.pretrain_text(entries["pkg.mod.Box"]).startswith("class pkg.mod.Box(size, *, color='red')\n\n")
    assert demo_corpus.module_docs("broken", "def f(:\n") == []
    assert demo_corpus.argument_names("(item, /, where=None, *args, key, **kw)") == ["item", "where", "args", "key",
                                                                                     "kw"]
    assert demo_corpus.argument_names("") == []


def test_first_sentence_is_short_prose_that_ends():
    assert demo_corpus.first_sentence("Return the median\nof the data.\n\nMore.") == "Return the median of the data."
    assert demo_corpus.first_sentence("Return the median. Then more.") == "Return the median."
    assert demo_corpus.first_sentence("Copy a tree, e.g. a directory. More.") == "Copy a tree, e.g. a directory."
    assert demo_corpus.first_sentence("Return the foo.bar of x. More.") == "Return the foo.bar of x."
    assert demo_corpus.first_sentence("word " * 80 + "end.") is None  # too long for an answer
    assert demo_corpus.first_sentence("Implementation of JSONDecoder") is None  # no sentence end
    assert demo_corpus.first_sentence("makedirs(name [, mode=0o777][, exist_ok=False]).") is None
    assert demo_corpus.first_sentence(">>> f(1)\n2") is None
    assert demo_corpus.first_sentence("Short.") is None


def test_qa_pairs_ask_what_it_does_and_how_to_call_it():
    entry = demo_corpus.DocEntry("json.dumps", "function", "(obj, *, indent=None)",
                                 "Serialize obj to a JSON formatted str. More.\n\nDetails.")
    assert demo_corpus.qa_pairs(entry) == {"what": ("What does json.dumps do?",
                                                    "Serialize obj to a JSON formatted str."),
                                    "call": ("How do I call json.dumps?", "json.dumps(obj, *, indent=None)")}
    long = demo_corpus.DocEntry("m.f", "function", "(" + "a, " * 60 + "b)", "Do it.\n\nMore.")
    assert set(demo_corpus.qa_pairs(long)) == set()  # "Do it." is too short, the signature too long
    cls = demo_corpus.DocEntry("m.Box", "class", "(size)", "A box for things.")
    assert demo_corpus.qa_pairs(cls) == {"what": ("What is m.Box?", "A box for things.")}


def sample(question, reply, expected, held_out, keywords):
    return {"question": question, "reply": reply, "expected": expected, "held_out": held_out, "keywords": keywords}


def test_a_demo_step_is_timed_by_the_training_loop_itself():
    """The demo sizes its stages from steps of train/loop.py (not a hand-written step), on the threads asked
    for, which are given back after."""
    mcfg, tcfg = build_config("tiny", overrides={"vocab_size": 64, "device": "cpu"})
    before = torch.get_num_threads()
    seconds = demo_sizing.measure_step_seconds(mcfg, tcfg, "fp32", threads=1, steps=2, warmup=1)
    assert 0 < seconds < 10 and torch.get_num_threads() == before
    fixed = demo_sizing.size_pretraining(mcfg, tcfg, 60.0, "fp32", 30)  # what a scale fixes is kept, unmeasured
    assert (fixed.precision, fixed.pretrain_steps, fixed.step_s) == ("fp32", 30, 0.0)


def test_scoring_counts_exact_in_set_and_keywords_held_out_against_chance():
    assert demo_score.held_out_hit("Serialize obj to a JSON string.", ["json"])  # any case, a word of its own
    assert not demo_score.held_out_hit("Return the objects.", ["obj"])  # not inside another word
    assert demo_score.held_out_hit("shutil.copy(src, dst)", ["follow_symlinks", "dst"])
    samples = [
        sample("What does a.f do?", "Return f.", "Return f.", False, ["a"]),  # exact
        sample("What does a.g do?", "Return f.", "Return g.", False, ["a"]),  # not exact
        sample("How do I call a.h?", "a.h(x, y)", "a.h(x, y)", False, []),  # exact
        sample("What does json.dumps do?", "Serialize to JSON.", "Serialize obj.", True, ["obj", "json"]),  # hit
        sample("How do I call b.k?", "b.k(src)", "b.k(src, dst)", True, ["src", "dst"]),  # hit
        sample("How do I call c.m?", "c.m()", "c.m(path)", True, ["path"]),  # miss
        sample("How do I call d.n?", "d.n(path)", "d.n(path)", True, ["path"]),  # hit and exact
    ]
    score = demo_score.score_replies(samples)
    assert (score["in_set"], score["in_set_n"], score["held_out"], score["held_out_n"]) == (2, 3, 3, 4)
    assert score["held_out_exact"] == 1
    # chance: each held-out question's keywords against the 6 other replies: json.dumps 0, b.k 0, c.m 1
    # (d.n's "path"), d.n 0 -> 1/6
    assert score["chance"] == pytest.approx(1 / 6)
    line = demo_score.score_line(score)
    assert line == ("in-set 2/3 exact first sentence or signature; held-out 3/4 name the module or an argument "
                    "(chance 0.2/4), 1/4 exact")
    assert SCORE_LINE.fullmatch(line)


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


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys):
    """The whole pipeline at the "test" scale: a report, a pretraining validation loss below a uniform guess,
    the replies printed, and the score line at the end and in the report (its numbers are not asserted: a
    model this small trained this briefly learns little)."""
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
    assert len(rows) == len(demo_corpus.IN_SET + demo_corpus.HELD_OUT) and out.count("\n  A: ") == len(rows)
    assert "Q (held out of SFT" in out and f"report: {report}" in out
    score = out.split("\nscore: ")[-1].split("\n")[0]
    m = SCORE_LINE.fullmatch(score)
    assert m and (m[2], m[4]) == (str(len(demo_corpus.IN_SET)), str(len(demo_corpus.HELD_OUT)))
    assert int(m[1]) <= int(m[2]) and int(m[3]) <= int(m[4]) and float(m[5]) <= int(m[6])
    assert score in text
