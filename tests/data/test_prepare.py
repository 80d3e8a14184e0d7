"""prepare: JSONL -> shards end to end, parallel == serial byte for byte, atomic on errors; the memmap reader;
and the deterministic, resumable batch sources."""
from __future__ import annotations

import hashlib
import json
import math
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from nanoforge.data.batches import EvalBatches, PretrainBatches
from nanoforge.data.jsonl import DataError
from nanoforge.data.prepare import prepare_dataset
from nanoforge.data.shards import TokenShards, check_tokenizer
from nanoforge.core.errors import NanoforgeError
from nanoforge.data.sources import train_tokenizer
from nanoforge.chat.tokenizer import CHAT_TEMPLATE, Tokenizer

QUIET = dict(log=lambda message: None)


def is_val(i: int, fraction: float) -> bool:
    return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def read_texts(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def write_pretrain(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


def leftovers(parent, name):
    """Temporary or old directories a prepare run left next to out_dir."""
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.fixture
def pretrain_file(shared_data):
    return shared_data / "tiny" / "pretrain_tiny.jsonl"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, shared_data, tiny_tokenizer):
    """tiny pretrain data prepared once, with small shards so that reads cross shard boundaries."""
    out = tmp_path_factory.mktemp("prepared") / "pre"
    prepare_dataset("pretrain", [shared_data / "tiny" / "pretrain_tiny.jsonl"], tiny_tokenizer, out,
                    val_fraction=0.05, workers=1, max_shard_tokens=20_000, **QUIET)
    return out


# ---------------------------------------------------------------------------------------------- prepare


def test_prepare_pretrain_end_to_end(prepared, pretrain_file, tiny_tokenizer):
    texts = read_texts(pretrain_file)
    manifest = json.loads((prepared / "manifest.json").read_text(encoding="utf-8"))
    val_docs = [i for i in range(len(texts)) if is_val(i, 0.05)]
    assert len(val_docs) == 10 and val_docs[:2] == [19, 39]

    assert manifest["kind"] == "pretrain" and manifest["dtype"] == "uint16" and manifest["format_version"] == 1
    assert manifest["tokenizer"] == {"sha256": tiny_tokenizer.sha256, "vocab_size": 512, "eos_id": 0}
    [source] = manifest["sources"]
    assert source == {"path": str(pretrain_file.resolve()), "bytes": pretrain_file.stat().st_size,
                      "sha256": hashlib.sha256(pretrain_file.read_bytes()).hexdigest(), "records": 200,
                      "skipped": 0}
    assert manifest["stats"]["tokens_per_s"] > 0 and manifest["stats"]["mb_per_s"] > 0 and manifest["created"]

    expected = {"train": [], "val": []}
    for i, text in enumerate(texts):
        expected["val" if is_val(i, 0.05) else "train"].append(text)
    for split, split_texts in expected.items():
        shards = TokenShards(prepared, split)
        entry = manifest["splits"][split]
        docs = [tiny_tokenizer.encode(t) + [tiny_tokenizer.eos_id] for t in split_texts]
        assert shards.num_docs == entry["docs"] == len(split_texts)
        assert shards.num_tokens == entry["tokens"] == sum(map(len, docs))
        assert shards.num_bytes == entry["bytes"] == sum(len(t.encode("utf-8")) for t in split_texts)
        assert shards.dtype == np.uint16
        for i, doc in enumerate(docs):
            tokens, mask = shards.doc(i)
            assert tokens.tolist() == doc and mask is None
        stream = [t for doc in docs for t in doc]
        assert shards.read(0, shards.num_tokens).tolist() == stream
        for shard in entry["shards"]:
            assert (prepared / f"{shard['name']}.bin").stat().st_size == 2 * shard["tokens"]
            assert (prepared / f"{shard['name']}.idx").stat().st_size == 8 * (shard["docs"] + 1)
    assert len(manifest["splits"]["train"]["shards"]) >= 5  # small shards, so the reads above crossed them


def test_reads_across_shard_boundaries(prepared):
    shards = TokenShards(prepared, "train")
    everything = shards.read(0, shards.num_tokens)
    boundary = int(shards._token_starts[1])
    for start, length in ((boundary - 3, 7), (0, 1), (boundary, 20_001), (shards.num_tokens - 5, 5)):
        assert shards.read(start, length).tolist() == everything[start:start + length].tolist()
    with pytest.raises(IndexError):
        shards.read(shards.num_tokens - 2, 3)


def test_prepared_dir_is_self_contained(prepared, tiny_tokenizer, tmp_path):
    from nanoforge.chat.tokenizer import load_tokenizer

    assert load_tokenizer(prepared / "tokenizer").sha256 == tiny_tokenizer.sha256
    check_tokenizer(prepared, tiny_tokenizer)
    other = write_pretrain(tmp_path / "other.jsonl", ["a different corpus entirely"] * 20)
    with pytest.raises(NanoforgeError, match="prepared with a different tokenizer"):
        check_tokenizer(prepared, train_tokenizer([other], vocab_size=300))


def test_parallel_output_is_byte_identical(tmp_path, shared_data, tiny_tokenizer):
    files = [shared_data / "tiny" / "pretrain_tiny.jsonl", shared_data / "minimind" / "pretrain_zh_guwen.jsonl"]
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        outputs.append((out, prepare_dataset("pretrain", files, tiny_tokenizer, out, workers=workers,
                                             chunk_bytes=32 << 10, max_shard_tokens=200_000, **QUIET)))
    (a, manifest_a), (b, manifest_b) = outputs
    names = sorted(p.name for p in a.iterdir() if p.is_file() and p.name != "manifest.json")
    assert names == sorted(p.name for p in b.iterdir() if p.is_file() and p.name != "manifest.json")
    assert any(n.startswith("val_") for n in names) and len([n for n in names if n.endswith(".bin")]) > 2
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    for manifest in (manifest_a, manifest_b):
        del manifest["stats"], manifest["created"]
    assert manifest_a == manifest_b


def shakespeare_txt(shared_data, tmp_path, nbytes=120_000):
    """A real plain-text file: the start of TinyShakespeare, cut at a line end, with a few lines made
    awkward for chunk joins (trailing spaces, blank-line runs, a CRLF line, non-ASCII text)."""
    raw = (shared_data / "text" / "tinyshakespeare.txt").read_bytes()[:nbytes]
    text = raw[:raw.rfind(b"\n") + 1].decode("utf-8")
    text += "Trailing spaces   \n\n\n  indented\r\nCRLF line\nnaïve café — 日本語 \u00a0\nlast line, no newline"
    path = tmp_path / "shakespeare.txt"
    path.write_bytes(text.encode("utf-8"))
    return path, text


def test_plain_text_is_one_document_that_decodes_back_exactly(tmp_path, shared_data, tiny_tokenizer):
    path, text = shakespeare_txt(shared_data, tmp_path)
    whole = tiny_tokenizer.encode(text) + [tiny_tokenizer.eos_id]  # the file tokenized in one piece
    for workers, chunk_bytes in ((1, 1 << 20), (1, 4096), (2, 8192)):  # small chunks: many joins
        out = tmp_path / f"w{workers}_{chunk_bytes}"
        manifest = prepare_dataset("pretrain", [path], tiny_tokenizer, out, val_fraction=0.0, workers=workers,
                                   chunk_bytes=chunk_bytes, **QUIET)
        train = manifest["splits"]["train"]
        assert (train["docs"], train["bytes"]) == (1, len(text.encode("utf-8")))
        shards = TokenShards(out, "train")
        ids = shards.read(0, shards.num_tokens).tolist()
        assert ids == whole  # chunk joins change no token
        assert tiny_tokenizer.decode(ids[:-1]) == text
        assert shards.doc_offsets().tolist() == [0, len(ids)]


def test_plain_text_cuts_keep_tokens_for_gpt2_split_pattern_too(tmp_path, shared_data, tiny_tokenizer):
    """Older tokenizers (and MiniMind's) split with GPT-2's pattern, where a safe cut is elsewhere (before the
    whitespace, not after the line break): the same vocabulary with that pre-tokenizer joins back exactly too."""
    backend = json.loads(tiny_tokenizer.backend.to_str())
    backend["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                "use_regex": True}
    gpt2 = Tokenizer(HFTokenizer.from_str(json.dumps(backend)), config=tiny_tokenizer.config)
    assert gpt2.split_pattern == "gpt-2" and tiny_tokenizer.split_pattern == "qwen2"
    path, text = shakespeare_txt(shared_data, tmp_path)
    for tok in (gpt2, tiny_tokenizer):
        out = tmp_path / f"{tok.split_pattern}"
        prepare_dataset("pretrain", [path], tok, out, val_fraction=0.0, workers=1, chunk_bytes=2048, **QUIET)
        shards = TokenShards(out, "train")
        assert shards.read(0, shards.num_tokens).tolist() == tok.encode(text) + [tok.eos_id], tok.split_pattern


def test_plain_text_and_jsonl_mix_and_shards_never_split_the_text(tmp_path, shared_data, pretrain_file,
                                                                   tiny_tokenizer):
    path, text = shakespeare_txt(shared_data, tmp_path, nbytes=30_000)
    out, again = tmp_path / "out", tmp_path / "again.jsonl"  # a copy: the same file twice is refused
    shutil.copy(pretrain_file, again)
    manifest = prepare_dataset("pretrain", [pretrain_file, path, again], tiny_tokenizer, out,
                               val_fraction=0.0, workers=1, chunk_bytes=4096, max_shard_tokens=3000, **QUIET)
    n_jsonl = len(read_texts(pretrain_file))
    assert manifest["splits"]["train"]["docs"] == 2 * n_jsonl + 1
    shards = TokenShards(out, "train")
    ids, _ = shards.doc(n_jsonl)  # the text file is one document, in input order, whole in one shard
    assert tiny_tokenizer.decode(ids[:-1].tolist()) == text


def test_plain_text_with_bad_encoding_names_the_file_and_line(tmp_path, tiny_tokenizer):
    path = tmp_path / "latin1.txt"
    path.write_bytes("first line\n".encode() * 3000 + "caf\xe9 au lait\n".encode("latin-1") + b"more\n")
    for workers in (1, 2):
        out = tmp_path / "out"
        with pytest.raises(DataError) as caught:
            prepare_dataset("pretrain", [path], tiny_tokenizer, out, workers=workers, chunk_bytes=4096, **QUIET)
        assert str(caught.value).startswith(f"{path}:3001: invalid UTF-8")
        assert not out.exists() and leftovers(tmp_path, "out") == []
    with pytest.raises(DataError, match="plain text is pretraining data"):
        prepare_dataset("sft", [path], tiny_tokenizer, tmp_path / "sft", workers=1, **QUIET)


# ---- plain text: the file's tail is its validation split


def awkward_text(n_lines=400):
    """Our own plain text: numbered lines of varied length, with trailing spaces, blank-line runs, a CRLF
    line and non-ASCII text (the places where a cut could change tokens), no newline at the very end."""
    lines = []
    for i in range(n_lines):
        line = f"Line {i}: " + " ".join(["the", "cat", "sat", "on", "mat", "naïve", "café", "日本語"][:1 + i % 8])
        line += ["", "   ", "\r", "\n\n", " \u00a0"][i % 5]
        lines.append(line)
    return "\n".join(lines) + "\nlast line, no newline"


def expected_val_start(raw: bytes, fraction: float) -> int:
    """The rule: the val tail starts at the first line start at or after size - floor(fraction * size)."""
    target = len(raw) - math.floor(fraction * len(raw))
    return raw.index(b"\n", target - 1) + 1


def split_docs(out):
    """{split: [token ids of each document]} of a prepared directory."""
    result = {}
    for split in ("train", "val"):
        shards = TokenShards(out, split)
        result[split] = [shards.doc(i)[0].tolist() for i in range(shards.num_docs)]
    return result


def test_plain_text_tail_is_the_val_split(tmp_path, tiny_tokenizer):
    text = awkward_text()
    raw = text.encode("utf-8")
    path = tmp_path / "corpus.txt"
    path.write_bytes(raw)
    start = expected_val_start(raw, 0.1)
    assert raw[start - 1:start] == b"\n" and 0.09 * len(raw) < len(raw) - start <= 0.1 * len(raw)
    head, tail = raw[:start].decode("utf-8"), raw[start:].decode("utf-8")
    eos = tiny_tokenizer.eos_id
    logged = []
    manifest = prepare_dataset("pretrain", [path], tiny_tokenizer, tmp_path / "out", val_fraction=0.1, workers=1,
                               log=logged.append)
    docs = split_docs(tmp_path / "out")
    assert docs == {"train": [tiny_tokenizer.encode(head) + [eos]], "val": [tiny_tokenizer.encode(tail) + [eos]]}
    assert tiny_tokenizer.decode(docs["val"][0][:-1]) == tail and tiny_tokenizer.decode(docs["train"][0][:-1]) == head
    assert head + tail == text
    for split, part in (("train", head), ("val", tail)):
        entry = manifest["splits"][split]
        assert (entry["docs"], entry["tokens"], entry["bytes"]) == (1, len(docs[split][0]), len(part.encode()))
    assert manifest["sources"][0]["val_from_byte"] == start and manifest["sources"][0]["bytes"] == len(raw)
    assert any(f"val the last {len(raw) - start:,}" in line for line in logged), logged

    # many small chunks, split across workers: the same documents as one chunk (the split point falls in a
    # later chunk, and head pieces must not be cut past it)
    for workers, chunk_bytes in ((1, 700), (2, 1500)):
        out = tmp_path / f"w{workers}_{chunk_bytes}"
        again = prepare_dataset("pretrain", [path], tiny_tokenizer, out, val_fraction=0.1, workers=workers,
                                chunk_bytes=chunk_bytes, **QUIET)
        assert split_docs(out) == docs
        assert again["splits"] == manifest["splits"]


@pytest.mark.parametrize("fraction,start", [(0.1, 1800), (0.105, 1800), (0.095, 1820), (0.5, 1000)])
def test_plain_text_split_point_is_the_first_line_start_at_or_after_the_fraction(tmp_path, tiny_tokenizer,
                                                                                  fraction, start):
    raw = b"".join(b"line %03d of twenty.\n" % i for i in range(100))  # 20-byte lines, 2000 bytes
    assert len(raw) == 2000 and expected_val_start(raw, fraction) == start
    path = tmp_path / "lines.txt"
    path.write_bytes(raw)
    manifest = prepare_dataset("pretrain", [path], tiny_tokenizer, tmp_path / "out", val_fraction=fraction,
                               workers=1, chunk_bytes=256, **QUIET)
    assert manifest["sources"][0]["val_from_byte"] == start
    assert (manifest["splits"]["train"]["bytes"], manifest["splits"]["val"]["bytes"]) == (start, 2000 - start)
    docs = split_docs(tmp_path / "out")
    assert tiny_tokenizer.decode(docs["val"][0][:-1]) == raw[start:].decode()


@pytest.mark.parametrize("content,why", [
    (b"short\n", "too few"),  # floor(0.1 * 6) = 0 bytes to hold out
    (b"a first line\n" + b"one long last line without a break " * 20, "no line starts in its last"),
    (b"a first line\n" + b"ends exactly at a line break " * 20 + b"\n", "no line starts in its last"),
])
def test_plain_text_too_short_to_split_stays_whole_in_train(tmp_path, tiny_tokenizer, content, why):
    path = tmp_path / "small.txt"
    path.write_bytes(content)
    logged = []
    manifest = prepare_dataset("pretrain", [path], tiny_tokenizer, tmp_path / "out", val_fraction=0.1, workers=1,
                               chunk_bytes=64, log=logged.append)
    assert (manifest["splits"]["train"]["docs"], manifest["splits"]["val"]["docs"]) == (1, 0)
    assert split_docs(tmp_path / "out")["train"] == [tiny_tokenizer.encode(content.decode()) + [tiny_tokenizer.eos_id]]
    assert "val_from_byte" not in manifest["sources"][0]
    assert any("kept whole in train" in line and why in line for line in logged), logged


def test_plain_text_with_val_fraction_0_stays_one_document(tmp_path, tiny_tokenizer):
    text = awkward_text()
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8", newline="")
    logged = []
    manifest = prepare_dataset("pretrain", [path], tiny_tokenizer, tmp_path / "out", val_fraction=0.0, workers=1,
                               chunk_bytes=700, log=logged.append)
    assert split_docs(tmp_path / "out") == {"train": [tiny_tokenizer.encode(text) + [tiny_tokenizer.eos_id]],
                                            "val": []}
    assert manifest["sources"][0]["records"] == 1 and "val_from_byte" not in manifest["sources"][0]
    assert f"{path}: 1 records" in logged


def test_plain_text_does_not_shift_the_jsonl_split(tmp_path, tiny_tokenizer):
    """JSONL records are split by the per-record rule counted over JSONL records only, with or without .txt
    files among the inputs; JSONL-only output is what the rule gives."""
    texts_a = [f"record {i} of file a, " + "words " * (i % 7) for i in range(45)]
    texts_b = [f"record {i} of file b; " + "more " * (i % 5) for i in range(38)]
    a, b = write_pretrain(tmp_path / "a.jsonl", texts_a), write_pretrain(tmp_path / "b.jsonl", texts_b)
    txt = tmp_path / "corpus.txt"
    txt.write_text(awkward_text(100), encoding="utf-8", newline="")
    raw = txt.read_bytes()
    start = expected_val_start(raw, 0.1)
    eos = tiny_tokenizer.eos_id

    def doc(text):
        return tiny_tokenizer.encode(text) + [eos]

    jsonl = texts_a + texts_b
    rule = {"train": [doc(t) for i, t in enumerate(jsonl) if not is_val(i, 0.1)],
            "val": [doc(t) for i, t in enumerate(jsonl) if is_val(i, 0.1)]}
    prepare_dataset("pretrain", [a, b], tiny_tokenizer, tmp_path / "jsonl", val_fraction=0.1, workers=1, **QUIET)
    assert split_docs(tmp_path / "jsonl") == rule

    prepare_dataset("pretrain", [a, txt, b], tiny_tokenizer, tmp_path / "mixed", val_fraction=0.1, workers=1,
                    chunk_bytes=512, **QUIET)
    n_a = {split: sum(1 for i in range(len(texts_a)) if is_val(i, 0.1) == (split == "val")) for split in rule}
    head, tail = doc(raw[:start].decode()), doc(raw[start:].decode())
    assert split_docs(tmp_path / "mixed") == {
        "train": rule["train"][:n_a["train"]] + [head] + rule["train"][n_a["train"]:],
        "val": rule["val"][:n_a["val"]] + [tail] + rule["val"][n_a["val"]:]}


def test_pretrain_on_one_text_file_reports_val_loss(tmp_path, tiny_tokenizer_dir):
    from nanoforge.recipes.pretrain import pretrain

    path = tmp_path / "book.txt"
    path.write_text(awkward_text(600), encoding="utf-8", newline="")
    out = tmp_path / "run"
    pretrain([str(path)], out, preset="tiny", tokenizer=str(tiny_tokenizer_dir), quiet=True,
             overrides={"tensorboard": False, "precision": "fp32", "max_steps": 4, "eval_every": 2,
                        "save_every": 0, "log_every": 1, "warmup_steps": 1, "seq_len": 32, "val_fraction": 0.1,
                        "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64})
    assert json.loads((out / "data" / "manifest.json").read_text())["splits"]["val"]["docs"] == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4] and all(math.isfinite(r["val_loss"]) for r in val)


def test_tinyshakespeare_val_split_is_its_last_tenth(tmp_path, shared_data, tiny_tokenizer):
    path = shared_data / "text" / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    raw = path.read_bytes()
    start = expected_val_start(raw, 0.1)
    manifest = prepare_dataset("pretrain", [path], tiny_tokenizer, tmp_path / "out", val_fraction=0.1, **QUIET)
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    assert (train["docs"], val["docs"]) == (1, 1)
    assert (train["bytes"], val["bytes"]) == (start, len(raw) - start)
    assert 0.09 < val["tokens"] / (train["tokens"] + val["tokens"]) < 0.11
    shards = TokenShards(tmp_path / "out", "val")
    assert tiny_tokenizer.decode(shards.doc(0)[0][:-1].tolist()) == raw[start:].decode("utf-8")


def test_bad_line_fails_with_file_and_line_and_leaves_nothing(tmp_path, tiny_tokenizer):
    texts = [f"document number {i} " * 20 for i in range(400)]
    data = write_pretrain(tmp_path / "data.jsonl", texts)
    lines = data.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[299] = '{"text": 17}\n'  # line 300, in a later chunk than line 1
    lines[349] = "{broken\n"  # also bad, but later: the first bad line in input order is reported
    data.write_text("".join(lines), encoding="utf-8")
    out = tmp_path / "out"
    for workers in (1, 2):
        with pytest.raises(DataError) as caught:
            prepare_dataset("pretrain", [data], tiny_tokenizer, out, workers=workers, chunk_bytes=16 << 10, **QUIET)
        assert str(caught.value).startswith(f'{data}:300: "text": must be a string')
        assert (caught.value.line, caught.value.field) == (300, '"text"')
        assert not out.exists() and leftovers(tmp_path, "out") == []


def test_failed_rerun_leaves_the_old_output_untouched(tmp_path, pretrain_file, tiny_tokenizer):
    out = tmp_path / "out"
    prepare_dataset("pretrain", [pretrain_file], tiny_tokenizer, out, workers=1, **QUIET)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": ""}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: \"text\": is empty"):
        prepare_dataset("pretrain", [bad], tiny_tokenizer, out, workers=2, force=True, **QUIET)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert leftovers(tmp_path, "out") == []


def test_existing_output_needs_force(tmp_path, pretrain_file, tiny_tokenizer):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("someone's file", encoding="utf-8")
    with pytest.raises(NanoforgeError, match="not empty; pass --force"):
        prepare_dataset("pretrain", [pretrain_file], tiny_tokenizer, out, **QUIET)
    assert (out / "keep.txt").exists()
    prepare_dataset("pretrain", [pretrain_file], tiny_tokenizer, out, force=True, workers=1, **QUIET)
    assert not (out / "keep.txt").exists() and (out / "manifest.json").exists()
    assert leftovers(tmp_path, "out") == []
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is fine without force
    prepare_dataset("pretrain", [pretrain_file], tiny_tokenizer, empty, workers=1, **QUIET)


def test_interrupt_cleans_up(tmp_path, pretrain_file, tiny_tokenizer):
    def interrupt(message):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare_dataset("pretrain", [pretrain_file], tiny_tokenizer, tmp_path / "out", workers=1, log=interrupt)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path, "out") == []


def test_skip_invalid_counts_skipped_records(tmp_path, tiny_tokenizer):
    data = tmp_path / "mixed.jsonl"
    data.write_text('{"text": "one"}\n{"text": ""}\nnot json\n{"text": "two"}\n{"txt": "three"}\n', encoding="utf-8")
    messages = []
    manifest = prepare_dataset("pretrain", [data], tiny_tokenizer, tmp_path / "out", skip_invalid=True,
                               workers=1, val_fraction=0.0, log=messages.append)
    assert manifest["sources"][0]["records"] == 2 and manifest["sources"][0]["skipped"] == 3
    assert manifest["splits"]["train"]["docs"] == 2 and manifest["splits"]["val"]["docs"] == 0
    log = "\n".join(messages)
    assert "skipped 3 invalid" in log and f"{data}:2:" in log and f"{data}:3:" in log


def test_input_problems_are_reported_before_any_work(tmp_path, tiny_tokenizer):
    with pytest.raises(DataError, match="no such file"):
        prepare_dataset("pretrain", [tmp_path / "missing.jsonl"], tiny_tokenizer, tmp_path / "out", **QUIET)
    with pytest.raises(NanoforgeError, match="is a directory"):
        prepare_dataset("dpo", [tmp_path], tiny_tokenizer, tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists()


def test_large_vocabulary_uses_uint32(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    # byte symbols placed above 65536 so the ids only fit uint32
    vocab = {f"<unused{i}>": i for i in range(70_000)}
    for symbol in pre_tokenizers.ByteLevel.alphabet():
        vocab[symbol] = len(vocab)
    inner = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens(["<|endoftext|>"])
    tok = Tokenizer(inner)
    data = write_pretrain(tmp_path / "d.jsonl", ["big ids", "更大的词表"])
    manifest = prepare_dataset("pretrain", [data], tok, tmp_path / "out", val_fraction=0.0, workers=1, **QUIET)
    assert manifest["dtype"] == "uint32"
    shards = TokenShards(tmp_path / "out", "train")
    assert shards.doc(1)[0].tolist() == tok.encode("更大的词表") + [tok.eos_id]
    assert max(shards.read(0, shards.num_tokens)) > 65_535


def test_sft_prepare_stores_the_assistant_mask(tmp_path, shared_data, tiny_tokenizer):
    data = shared_data / "tiny" / "sft_tiny.jsonl"
    manifest = prepare_dataset("sft", [data], tiny_tokenizer, tmp_path / "sft", val_fraction=0.1, workers=2,
                               chunk_bytes=32 << 10, **QUIET)
    with open(data, encoding="utf-8") as f:
        conversations = [json.loads(line)["conversations"] for line in f]
    train = [c for i, c in enumerate(conversations) if not is_val(i, 0.1)]
    shards = TokenShards(tmp_path / "sft", "train")
    assert shards.num_docs == len(train) == manifest["splits"]["train"]["docs"]
    assert (tmp_path / "sft" / "train_00000.mask").stat().st_size == shards.num_tokens
    for i, conversation in enumerate(train):
        ids, mask = tiny_tokenizer.render_chat(conversation)
        tokens, stored_mask = shards.doc(i)
        assert tokens.tolist() == ids and stored_mask.tolist() == mask
    assert shards.read_mask(0, 10).dtype == np.uint8


def test_sft_prepare_reports_unmaskable_conversations(tmp_path):
    corpus = tmp_path / "newlines.txt"
    corpus.write_text("a\n\n\nb\n" * 500, encoding="utf-8")
    # plain ChatML (older tokenizers): the thinking template strips the leading newlines this needs
    tok = Tokenizer(train_tokenizer([corpus], vocab_size=300).backend, chat_template=CHAT_TEMPLATE)
    data = tmp_path / "sft.jsonl"
    good = {"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    bad = {"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "\n\nb"}]}
    data.write_text("\n".join(json.dumps(r) for r in (good, bad, good)) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r'sft\.jsonl:2: "conversations": token .* crosses the edge'):
        prepare_dataset("sft", [data], tok, tmp_path / "out", workers=1, **QUIET)
    manifest = prepare_dataset("sft", [data], tok, tmp_path / "out", workers=1, skip_invalid=True, **QUIET)
    assert manifest["sources"][0]["skipped"] == 1 and manifest["sources"][0]["records"] == 2


# ---------------------------------------------------------------------------------------------- reader


def test_corrupt_or_missing_shards_are_named(tmp_path, pretrain_file, tiny_tokenizer):
    out = tmp_path / "out"
    prepare_dataset("pretrain", [pretrain_file], tiny_tokenizer, out, workers=1, **QUIET)
    TokenShards(out, "train")
    with open(out / "train_00000.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(NanoforgeError, match=r"train_00000\.bin: 10 bytes but the manifest says"):
        TokenShards(out, "train")
    (out / "val_00000.idx").unlink()
    with pytest.raises(NanoforgeError, match=r"val_00000\.idx: missing"):
        TokenShards(out, "val")
    with pytest.raises(NanoforgeError, match="no split 'test'"):
        TokenShards(out, "test")
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    manifest["format_version"] = 99
    (out / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(NanoforgeError, match="format version 99"):
        TokenShards(out, "train")
    with pytest.raises(NanoforgeError, match="no manifest.json"):
        TokenShards(tmp_path, "train")


# ---------------------------------------------------------------------------------------------- batches


def take(batches, n):
    return [batches.next_batch() for _ in range(n)]


def same(a, b):
    return all(torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
               for x, y in zip(a, b, strict=True))


def test_pretrain_batches_shapes_and_windows(prepared):
    shards = TokenShards(prepared, "train")
    batches = PretrainBatches(shards, batch_size=4, seq_len=64, seed=3)
    batch = batches.next_batch()
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 64)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    first_window = int(torch.randperm(batches.num_windows, generator=torch.Generator().manual_seed(3))[0])
    expected = shards.read(first_window * 64, 65).astype(np.int64)
    assert batch["input_ids"][0].tolist() == expected[:-1].tolist()
    assert batch["labels"][0].tolist() == expected[1:].tolist()


def test_pretrain_batches_cover_each_window_once_per_epoch(prepared):
    shards = TokenShards(prepared, "train")
    windows = PretrainBatches(shards, batch_size=8, seq_len=512, seed=0).num_windows
    size = next(b for b in (8, 7, 6, 5) if windows % b)  # the epoch does not divide evenly: the last batch
    batches = PretrainBatches(shards, batch_size=size, seq_len=512, seed=0)  # runs into epoch 1
    starts = []
    for batch in take(batches, math.ceil(windows / size)):
        starts += [row[0] for row in batch["input_ids"].tolist()]
    everything = shards.read(0, shards.num_tokens)
    first_tokens = sorted(int(everything[k * 512]) for k in range(windows))
    assert sorted(starts[:windows]) == first_tokens
    assert batches.epoch == 1 and batches.cursor == size - windows % size


def test_pretrain_batches_are_deterministic_and_resume_exactly(prepared):
    shards = TokenShards(prepared, "train")
    reference = take(PretrainBatches(shards, batch_size=8, seq_len=512, seed=7), 70)  # ~2.5 epochs
    assert same(reference, take(PretrainBatches(shards, batch_size=8, seq_len=512, seed=7), 70))
    assert not same(reference[:3], take(PretrainBatches(shards, batch_size=8, seq_len=512, seed=8), 3))
    for stop in (1, 27, 28, 29, 55):
        first = PretrainBatches(shards, batch_size=8, seq_len=512, seed=7)
        take(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
        resumed = PretrainBatches(shards, batch_size=8, seq_len=512, seed=7)
        resumed.load_state_dict(state)
        assert same(reference[stop:], take(resumed, 70 - stop)), stop


def test_ranks_split_the_global_batch(prepared):
    shards = TokenShards(prepared, "train")
    single = take(PretrainBatches(shards, batch_size=6, seq_len=128, seed=1), 5)
    ranks = [take(PretrainBatches(shards, batch_size=3, seq_len=128, seed=1, rank=r, world_size=2), 5)
             for r in range(2)]
    for step in range(5):
        joined = torch.cat([ranks[0][step]["input_ids"], ranks[1][step]["input_ids"]])
        assert torch.equal(joined, single[step]["input_ids"])


def test_batch_errors_say_what_to_change(prepared):
    shards = TokenShards(prepared, "val")
    with pytest.raises(NanoforgeError, match="at least .* tokens; add data or lower --batch-size"):
        PretrainBatches(shards, batch_size=64, seq_len=512, seed=0)
    batches = PretrainBatches(TokenShards(prepared, "train"), batch_size=2, seq_len=64, seed=0)
    state = batches.state_dict()
    other = PretrainBatches(TokenShards(prepared, "train"), batch_size=2, seq_len=32, seed=0)
    with pytest.raises(NanoforgeError, match="seq_len=64 but this run has seq_len=32"):
        other.load_state_dict(state)


def test_eval_batches_are_consecutive_and_repeatable(prepared):
    shards = TokenShards(prepared, "val")
    evaluation = EvalBatches(shards, batch_size=4, seq_len=64, max_batches=3)
    batches = list(evaluation)
    assert len(batches) == 3
    assert same(batches, list(evaluation))
    assert batches[0]["input_ids"][1].tolist() == shards.read(64, 64).astype(np.int64).tolist()
    assert batches[2]["labels"][3].tolist() == shards.read(11 * 64 + 1, 64).astype(np.int64).tolist()
    assert evaluation.bytes_per_token == pytest.approx(shards.num_bytes / shards.num_tokens)
    small = EvalBatches(shards, batch_size=4, seq_len=1024, max_batches=100)
    windows = (shards.num_tokens - 1) // 1024
    assert sum(len(b["input_ids"]) for b in small) == windows  # a short last batch, nothing dropped
    with pytest.raises(NanoforgeError, match="fewer than one window"):
        EvalBatches(shards, batch_size=1, seq_len=shards.num_tokens, max_batches=1)


def test_parallel_reading_stays_bounded(tmp_path, tiny_tokenizer):
    """The reader must not run ahead of the workers (Pool.imap would read the whole input into memory)."""
    from nanoforge.data.chunks import ChunkTask, run_chunks

    pulled = []

    def tasks():
        for i in range(40):
            pulled.append(i)
            yield ChunkTask("pretrain", 0, "mem.jsonl", 1 + i, b'{"text": "some text"}\n', False)

    results = run_chunks(tasks(), tiny_tokenizer, workers=2)
    first = next(results)
    assert first.doc_lens.tolist() == [len(tiny_tokenizer.encode("some text")) + 1]
    assert len(pulled) <= 2 * 2 + 1
    assert sum(len(r.doc_lens) for r in results) == 39
    assert len(pulled) == 40
