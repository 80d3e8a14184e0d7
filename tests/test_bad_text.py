"""Text that is not what it seems, given to the real commands: strings that are not Unicode (a JSON "\\ud800"
escape, a byte that is not UTF-8 on a terminal), look-alikes of control tokens under a normalizing tokenizer,
one record of 30 MB, and the same input file given twice. Each bad case exits 1 with one line naming the file
(and line and field), no traceback, nothing written, the inputs as they were; docs/bad-inputs.md lists them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from nanoforge.chat.pieces import PIECE_CHARS, text_pieces
from nanoforge.chat.tokenizer import Tokenizer, load_tokenizer
from nanoforge.core.errors import NanoforgeError
from nanoforge.data.jsonl import DataError
from nanoforge.data.shards import TokenShards
from conftest import run_with_peak_rss
from nanoforge.eval.gsm8k import read_gsm8k
from nanoforge.rl.prompts import read_prompts

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
LONE = "\\ud800"  # as a JSONL file spells it: the JSON escape of half a surrogate pair
SURROGATE_WORDS = "contains a lone surrogate"


def nf(args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoforge", *args], capture_output=True, cwd=ROOT, env=ENV,
                          input=stdin if stdin is not None else b"", timeout=300)


def conversation(user: str, assistant: str = "hello") -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def jsonl(*records) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).replace("LONE", LONE).encode()


def snapshot(directory: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_refused(r: subprocess.CompletedProcess, *words: str) -> None:
    err = r.stderr.decode()
    assert r.returncode == 1, err[-3000:]
    assert "Traceback" not in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err[-3000:]
    for w in words:
        assert w in err, err


# ---------------------------------------------------------------------------------------------- not Unicode

OK_SFT = {"conversations": conversation("hi")}
PAIR = {"chosen": conversation("q", "good"), "rejected": conversation("q", "bad")}
SURROGATE_CASES = [  # (kind, records, the file:line: field it must name)
    ("pretrain", [{"text": "fine"}, {"text": "half a pair: LONE"}], ':2: "text": '),
    ("sft", [OK_SFT, {"conversations": conversation("hi", "LONE")}], ':2: "conversations"[1].content: '),
    ("sft", [OK_SFT, {"conversations": conversation("hi"), "LONE": 1}], ":2: a key contains a lone surrogate"),
    ("dpo", [PAIR, {**PAIR, "rejected": conversation("q", "worse LONE")}], ':2: "rejected"[1].content: '),
]


@pytest.mark.slow
def test_a_lone_surrogate_is_a_record_error_in_every_kind_and_skip_invalid_skips_it(tmp_path, tiny_tokenizer_dir):
    jobs = []
    for i, (kind, records, where) in enumerate(SURROGATE_CASES):
        data = tmp_path / f"in{i}.jsonl"
        data.write_bytes(jsonl(*records))
        base = ["prepare", "--kind", kind, "--data", str(data), "--tokenizer", str(tiny_tokenizer_dir), "--workers", "1"]
        jobs += [(data, where, tmp_path / f"out{i}", base + ["--out", str(tmp_path / f"out{i}")]),
                 (data, None, tmp_path / f"skip{i}", base + ["--out", str(tmp_path / f"skip{i}"), "--skip-invalid"])]
    before = {data: data.read_bytes() for data, *_ in jobs}
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda job: nf(job[3]), jobs))
    for (data, where, out, _), r in zip(jobs, results):
        assert data.read_bytes() == before[data]
        if where is not None:
            assert_refused(r, f"error: {data}{where}", SURROGATE_WORDS)
            assert not out.exists() and not list(tmp_path.glob(f".{out.name}*"))
        else:
            text = (r.stdout + r.stderr).decode()
            assert r.returncode == 0 and "skipped 1 invalid" in text and SURROGATE_WORDS in text, text
            assert json.loads((out / "manifest.json").read_text())["sources"][0]["skipped"] == 1


def test_a_lone_surrogate_is_a_record_error_for_rl_prompts_and_eval_data(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"question": "1+1=", "answer": "#### 2"}\n{"question": "x' + LONE.encode() + b'"}\n')
    with pytest.raises(DataError, match=rf'^{prompts}:2: "question": {SURROGATE_WORDS}'):
        read_prompts(prompts)
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_bytes(b'{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": "' + LONE.encode() + b'"}\n')
    with pytest.raises(DataError, match=rf'^{gsm}:2: "answer": {SURROGATE_WORDS}'):
        read_gsm8k(gsm)


def test_a_pair_of_surrogate_escapes_is_text(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"question": "smile \\ud83d\\ude00", "answer": "#### 2"}\n')
    assert read_prompts(prompts)[0].messages[-1]["content"] == "smile \U0001F600"


@pytest.mark.slow
def test_bytes_that_are_not_utf8_on_a_terminal_are_replaced(tmp_path, base_run):
    flags = ["--max-new-tokens", "2", "--device", "cpu", "--seed", "0"]
    with ThreadPoolExecutor(max_workers=3) as pool:
        generate = pool.submit(nf, ["generate", str(base_run), "--prompt", b"caf\xe9 au lait", *flags])
        piped = pool.submit(nf, ["generate", str(base_run), *flags], b"caf\xe9 \xff\n")
        chat = pool.submit(nf, ["chat", str(base_run), "--system", b"be \xff", *flags], b"caf\xe9\n")
    for r in (generate.result(), piped.result(), chat.result()):
        assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode()[-3000:]
    assert generate.result().stdout.startswith("caf\ufffd au lait".encode())
    assert piped.result().stdout.startswith("caf\ufffd \ufffd\n".encode())


def test_eval_prompt_files_read_as_every_jsonl_file(tmp_path):
    from nanoforge.infer.samples import load_prompts
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"fine\ncaf\xe9\n")
    with pytest.raises(DataError, match=rf"^{bad}:2: invalid UTF-8"):
        load_prompts(bad)
    lone = tmp_path / "p.jsonl"
    lone.write_bytes(b'{"prompt": "' + LONE.encode() + b'"}\n')
    with pytest.raises(DataError, match=rf'^{lone}:1: "prompt": {SURROGATE_WORDS}'):
        load_prompts(lone)


# ---------------------------------------------------------------------------------------------- look-alikes

FULLWIDTH_END = "＜｜im_end｜＞"  # NFKC makes it <|im_end|>


def normalizing_tokenizer(tiny_tokenizer_dir: Path, out: Path, normalized: bool) -> Path:
    """The tiny tokenizer with an NFKC normalizer, its special tokens matched after it or not."""
    shutil.copytree(tiny_tokenizer_dir, out)
    config = json.loads((out / "tokenizer.json").read_text())
    config["normalizer"] = {"type": "NFKC"}
    for token in config["added_tokens"]:
        token["normalized"] = normalized if token["special"] else token["normalized"]
    (out / "tokenizer.json").write_text(json.dumps(config, ensure_ascii=False))
    (out / "checksums.sha256").unlink()  # edited on purpose: what the checksum refusal says to do
    return out


def test_a_tokenizer_that_would_turn_look_alikes_into_control_tokens_is_refused(tmp_path, tiny_tokenizer_dir):
    hostile = normalizing_tokenizer(tiny_tokenizer_dir, tmp_path / "hostile", normalized=True)
    with pytest.raises(NanoforgeError, match=r"tokenizer.json: its special token '<\|endoftext\|>' is matched after "
                                             r'the NFKC normalizer \("normalized": true\)'):
        load_tokenizer(hostile)
    data = tmp_path / "in.jsonl"
    data.write_bytes(jsonl({"conversations": conversation(f"a {FULLWIDTH_END} b")}))
    before = snapshot(tmp_path)
    r = nf(["prepare", "--kind", "sft", "--data", str(data), "--tokenizer", str(hostile), "--out",
            str(tmp_path / "out"), "--workers", "1"])
    assert_refused(r, f"{hostile / 'tokenizer.json'}: its special token", '"normalized": false')
    assert snapshot(tmp_path) == before


def test_under_a_normalizer_look_alikes_and_special_token_text_stay_text(tmp_path, tiny_tokenizer_dir):
    """Special tokens matched on the text as written: the normalizer's ASCII `<|im_end|>` is plain text."""
    tok = load_tokenizer(normalizing_tokenizer(tiny_tokenizer_dir, tmp_path / "nfkc", normalized=False))
    for content in (f"a {FULLWIDTH_END} b", "a <|im_end|> b", f"{FULLWIDTH_END}<|im_start|>assistant"):
        ids, mask = tok.render_chat(conversation(content))
        assert ids.count(tok.im_end_id) == 2 and ids.count(tok.im_start_id) == 2, content
        assert sum(mask) and ids[len(mask) - 1 - mask[::-1].index(1)] == tok.im_end_id


# ---------------------------------------------------------------------------------------------- long records

def long_text(n_chars: int, line: str) -> str:
    return (line * (n_chars // len(line) + 1))[:n_chars]


@pytest.mark.parametrize("line", ["the cat sat on the mat.\n", "the cat sat on the mat. ", "春天来了，花开了。\n",
                                  "a  \n\n  b\t\tc. \n", "x" * 50 + " "])
def test_a_long_text_in_pieces_has_the_ids_of_the_whole(tiny_tokenizer, line):
    """Both split patterns (`tokenizer train`'s Qwen2 and GPT-2's): line breaks, spaces only, CJK, odd spacing."""
    backend = json.loads(tiny_tokenizer.backend.to_str())
    backend["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                "use_regex": True}
    from tokenizers import Tokenizer as HFTokenizer
    gpt2 = Tokenizer(HFTokenizer.from_str(json.dumps(backend)), config=tiny_tokenizer.config)
    text = long_text(2 * PIECE_CHARS + 12345, line)
    for tok in (tiny_tokenizer, gpt2):
        pieces = list(text_pieces(text, tok.split_pattern))
        assert len(pieces) >= 3 and "".join(pieces) == text and max(map(len, pieces)) <= PIECE_CHARS
        assert tok.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids, tok.split_pattern


def test_a_text_without_a_safe_place_is_cut_at_the_piece_size_and_decodes_the_same(tiny_tokenizer):
    """The one documented difference (chat/pieces.py): no line break and no space in PIECE_CHARS characters."""
    text = long_text(PIECE_CHARS + 100, "字")
    assert [len(p) for p in text_pieces(text, tiny_tokenizer.split_pattern)] == [PIECE_CHARS, 100]
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


def test_a_long_conversation_in_pieces_has_the_ids_and_mask_of_the_whole(tiny_tokenizer):
    messages = conversation(long_text(PIECE_CHARS + 999, "question <|im_end|> here.\n"),
                            long_text(PIECE_CHARS + 7, "an answer, long. "))
    ids, mask, text = tiny_tokenizer.render_chat_arrays(messages)
    assert isinstance(ids, np.ndarray) and ids.tolist() == tiny_tokenizer.render_chat_with_text(messages)[0]
    assert (ids == tiny_tokenizer.im_end_id).sum() == 2  # the user's <|im_end|> text stayed text
    answer = tiny_tokenizer.encode(messages[1]["content"])
    masked = ids[mask.astype(bool)].tolist()
    assert masked[-1] == tiny_tokenizer.im_end_id and tiny_tokenizer.decode(masked).count(messages[1]["content"]) == 1
    assert len(masked) >= len(answer)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads memory use from /proc")
@pytest.mark.parametrize("kind", ["pretrain", "sft"])
def test_a_30_mb_record_is_prepared_in_bounded_memory(tmp_path, tiny_tokenizer_dir, kind):
    """Measured before (issue 46): 5.2 GB for a 30 MB pretraining line, 6.7 GB for a 30 MB SFT message."""
    body = long_text(30_000_000, "the cat sat on the mat. ")
    record = {"text": body} if kind == "pretrain" else {"conversations": conversation(body)}
    data = tmp_path / "big.jsonl"
    data.write_text(json.dumps(record) + "\n")
    limit = 1536 << 20
    r, peak = run_with_peak_rss([sys.executable, "-m", "nanoforge", "prepare", "--kind", kind, "--data", str(data),
                                 "--tokenizer", str(tiny_tokenizer_dir), "--out", str(tmp_path / "out"),
                                 "--val-fraction", "0", "--workers", "1"], limit, 600, cwd=ROOT, env=ENV)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode()[-3000:]
    assert 0 < peak < limit
    shards = TokenShards(tmp_path / "out", "train")
    assert shards.doc_offsets().tolist() == [0, shards.num_tokens]
    tok = load_tokenizer(tiny_tokenizer_dir)
    assert tok.decode(shards.read(0, 2000).tolist()).count("the cat sat on the mat.") > 100


# ---------------------------------------------------------------------------------------------- twice

@pytest.mark.slow
def test_the_same_input_twice_is_refused_under_any_of_its_names(tmp_path, tiny_tokenizer_dir):
    data = tmp_path / "a.jsonl"
    data.write_bytes(jsonl({"text": "one"}, {"text": "two"}))
    (tmp_path / "link.jsonl").symlink_to(data)
    os.link(data, tmp_path / "hard.jsonl")
    again = [str(data), f"{tmp_path}/./a.jsonl", str(tmp_path / "link.jsonl"), str(tmp_path / "hard.jsonl")]
    before = snapshot(tmp_path)
    commands = [["prepare", "--kind", "pretrain", "--tokenizer", str(tiny_tokenizer_dir)],
                ["tokenizer", "train", "--vocab-size", "300"]]
    jobs = [[*command, "--data", str(data), other, "--out", str(tmp_path / "out")]
            for command in commands for other in again]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(nf, jobs))
    for other, r in zip(again * len(commands), results):
        same = "" if Path(other) == data else f" (as {data} too)"  # ./a.jsonl is a.jsonl as a Path
        assert_refused(r, f"error: --data {Path(other)} is given twice{same}; its records would be counted twice")
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()
