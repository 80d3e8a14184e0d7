"""Shared fixtures: the real test data beside the repo, and a small tokenizer trained on it.

The data lives in ../shared/data (see its README.md); it is never copied into the repo. Tests that need it
skip with the reason when it is absent, unless NANOFORGE_REQUIRE_SHARED=1 (CI sets it) makes that a failure.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
_SESSION_CACHE: str | None = None


def pytest_configure(config):
    """Tests write only to temporary folders: the measured-CPU-peak cache (and matplotlib's font cache) of
    every run, in this process and the subprocesses it starts, go to one temporary folder for the session."""
    global _SESSION_CACHE
    import tempfile
    _SESSION_CACHE = tempfile.mkdtemp(prefix="nanoforge-test-cache-")
    os.environ["NANOFORGE_CACHE_DIR"] = os.path.join(_SESSION_CACHE, "nanoforge")
    os.environ["MPLCONFIGDIR"] = os.path.join(_SESSION_CACHE, "matplotlib")


def pytest_unconfigure(config):
    import shutil
    if _SESSION_CACHE:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def _missing_shared_data(what: str = "this test") -> None:
    """Skip (or fail under NANOFORGE_REQUIRE_SHARED=1) because ../shared/data is not there."""
    reason = (f"{what} needs the shared test data at {SHARED_DATA} (a checkout of the project's shared/ "
              "folder beside the repo); it is absent")
    if os.environ.get("NANOFORGE_REQUIRE_SHARED") == "1":
        pytest.fail(reason + " and NANOFORGE_REQUIRE_SHARED=1 is set")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to ../shared/data; skips the test when it is absent (fails when NANOFORGE_REQUIRE_SHARED=1)."""
    if not SHARED_DATA.is_dir():
        _missing_shared_data()
    return SHARED_DATA


# A few lines of our own, so tokenizer-dependent tests still run on a machine without ../shared.
_FALLBACK_TEXTS = [
    "Once upon a time there was a little robot who liked to count the stars at night.",
    "The quick brown fox jumps over the lazy dog, and the dog does not mind at all.",
    "春天来了，小河里的冰化了，岸边的柳树也发芽了。",
    "我们明天一起去图书馆看书吧，那里很安静。",
    "Numbers like 3.14159 and 2024 appear in text too; so do symbols: #, %, & and emoji 🙂.",
]


_WORDS = ("the a little robot river star night king queen stone fire garden window bread music teacher "
          "student city mountain rain morning letter friend train book happy quiet bright slowly found carried "
          "watched opened counted painted remembered under over behind across through before after because "
          "while although seven twenty yellow green old new small large warm cold").split()


def _fallback_sentence(rng) -> str:
    """A made-up sentence: English words, or random CJK ideographs (each 3 UTF-8 bytes, so a small byte-level
    BPE cannot merge them all and splits some characters across tokens, as with real Chinese)."""
    if rng.random() < 0.35:
        return "".join(chr(0x4E00 + rng.randrange(3000)) for _ in range(rng.randint(6, 24))) + "。"
    words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
    return " ".join(words).capitalize() + rng.choice(".!?")


def _write_fallback_corpus(directory: Path) -> list[Path]:
    """Pretraining text and SFT conversations of our own (seeded), so tests run without ../shared: the fixed
    lines above plus varied made-up sentences, enough to pack, batch and split like the real data."""
    import random
    rng = random.Random(1234)
    pretrain = directory / "fallback_pretrain.jsonl"
    with open(pretrain, "w", encoding="utf-8") as f:
        for i in range(600):
            text = " ".join(_fallback_sentence(rng) for _ in range(rng.randint(1, 6)))
            if i % 3 == 0:
                text = f"{_FALLBACK_TEXTS[i % len(_FALLBACK_TEXTS)]} {text}"
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    sft = directory / "fallback_sft.jsonl"
    with open(sft, "w", encoding="utf-8") as f:
        for i in range(400):
            conversation = []
            if i % 4 == 0:
                conversation.append({"role": "system", "content": "You are a helpful assistant."})
            for _ in range(8 if i % 20 == 0 else rng.choice((1, 1, 1, 2))):  # some run past 512 tokens
                conversation.append({"role": "user", "content": _fallback_sentence(rng)})
                conversation.append({"role": "assistant", "content": " ".join(
                    _fallback_sentence(rng) for _ in range(rng.randint(1, 4)))})
            f.write(json.dumps({"conversations": conversation}, ensure_ascii=False) + "\n")
    return [pretrain, sft]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """Directory of a vocab-512 byte-level BPE tokenizer trained on ../shared/data/tiny/*.jsonl (or, without
    the shared data, on a small corpus written here)."""
    from nanoforge.tokenizer import train_tokenizer

    work = tmp_path_factory.mktemp("tiny_tokenizer")
    if SHARED_DATA.is_dir():
        files = sorted((SHARED_DATA / "tiny").glob("*.jsonl"))
    elif os.environ.get("NANOFORGE_REQUIRE_SHARED") == "1":
        _missing_shared_data("tiny_tokenizer")
    else:
        files = _write_fallback_corpus(work)
    train_tokenizer(files, vocab_size=512, out_dir=work / "tokenizer")
    return work / "tokenizer"


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    """The tiny tokenizer (nanoforge.tokenizer.Tokenizer); its files are in the `tiny_tokenizer_dir` fixture."""
    from nanoforge.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)
