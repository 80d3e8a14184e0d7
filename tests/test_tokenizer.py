"""Tokenizer: special ids, exact round trips on every real data file, save/load, foreign tokenizer.json files,
and the chat template with its assistant loss mask on real multi-turn conversations."""
from __future__ import annotations

import json
import math
import os

import pytest

from nanoforge.chat.template import THINKING_TOOLS_TEMPLATE, TOOL_TAGS
from nanoforge.data.jsonl import DataError
from nanoforge.core.errors import NanoforgeError
from nanoforge.data.sources import train_tokenizer
from nanoforge.chat.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, ChatTemplateError, Tokenizer, load_tokenizer

# Round trips check about this many bytes of each file, records sampled evenly over the file (all 55 MB
# take ~25 s on 2 cores); NANOFORGE_FULL_ROUNDTRIP=1 checks every record.
ROUNDTRIP_BYTES_PER_FILE = None if os.environ.get("NANOFORGE_FULL_ROUNDTRIP") == "1" else 400_000


def _write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def _texts_of_record(record) -> list[str]:
    if "text" in record:
        return [record["text"]]
    messages = record.get("conversations", []) + record.get("chosen", []) + record.get("rejected", [])
    return [m["content"] for m in messages]


def _sampled_texts(path, max_bytes):
    """All texts of a JSONL file, or of every k-th record so that about max_bytes are checked."""
    stride = 1 if max_bytes is None else max(1, math.ceil(path.stat().st_size / max_bytes))
    texts = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i % stride == 0:
                texts.extend(_texts_of_record(json.loads(line)))
    return texts


def _conversations(path, limit=None):
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            yield json.loads(line)["conversations"]


def _masked_runs(ids, mask):
    """Contiguous runs of masked token ids."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def assistant_turn(tokenizer, content):
    """What the mask covers of an assistant message without reasoning or tool calls: its content and
    <|im_end|> (plain ChatML), behind an empty think block with the thinking template (which also drops the
    content's leading newlines)."""
    if "<think>" not in tokenizer.chat_template:
        return content + "<|im_end|>"
    return "<think>\n\n</think>\n\n" + content.lstrip("\n") + "<|im_end|>"


def assert_mask_is_assistant_content(tokenizer, messages, add_generation_prompt=False):
    """ids equal encode(rendered text); each masked run decodes to one assistant turn + <|im_end|>."""
    ids, mask = tokenizer.render_chat(messages, add_generation_prompt)
    assert ids == tokenizer.encode(tokenizer.render_text(messages, add_generation_prompt))
    assert len(mask) == len(ids) and set(mask) <= {0, 1}
    expected = [assistant_turn(tokenizer, m["content"]) for m in messages if m["role"] == "assistant"]
    assert [tokenizer.decode(run) for run in _masked_runs(ids, mask)] == expected


# ---------------------------------------------------------------------------------------------- ids


def test_special_tokens_take_the_first_ids(tiny_tokenizer):
    assert len(SPECIAL_TOKENS) == 16
    assert [tiny_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(16))
    assert (tiny_tokenizer.eos_id, tiny_tokenizer.im_start_id, tiny_tokenizer.im_end_id) == (0, 1, 2)
    assert tiny_tokenizer.pad_id == tiny_tokenizer.eos_id
    assert tiny_tokenizer.vocab_size == 512


def test_special_tokens_in_text_encode_to_one_id(tiny_tokenizer):
    ids = tiny_tokenizer.encode("a<|im_start|>user\nhi<|im_end|><|endoftext|>")
    assert ids.count(1) == 1 and ids.count(2) == 1 and ids[-1] == 0
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == "auser\nhi"


def test_unseen_bytes_round_trip_through_the_byte_alphabet(tiny_tokenizer):
    text = "Ünïcödé ☃ 𝔘 \x00\x07 \t\r\n 한국어 العربية 🙂🙃 \ufeff"
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


def test_encode_batch_equals_encode(tiny_tokenizer):
    texts = ["hello world", "你好，世界", "", "  leading spaces", "trailing\n\n"]
    assert tiny_tokenizer.encode_batch(texts) == [tiny_tokenizer.encode(t) for t in texts]


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.slow
def test_round_trip_on_every_shared_data_file(shared_data, tiny_tokenizer):
    files = sorted((shared_data / "minimind").glob("*.jsonl")) + sorted((shared_data / "tiny").glob("*.jsonl"))
    assert len(files) >= 20
    for path in files:
        texts = _sampled_texts(path, ROUNDTRIP_BYTES_PER_FILE)
        assert texts, path
        decoded = [tiny_tokenizer.decode(ids) for ids in tiny_tokenizer.encode_batch(texts)]
        bad = next((i for i, (a, b) in enumerate(zip(texts, decoded)) if a != b), None)
        assert bad is None, f"{path.name}: text {bad} does not round-trip: {texts[bad][:80]!r}"
    shakespeare = (shared_data / "text" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    blocks = [shakespeare[i:i + 20000] for i in range(0, len(shakespeare), 20000)]
    assert "".join(tiny_tokenizer.decode(ids) for ids in tiny_tokenizer.encode_batch(blocks)) == shakespeare


# ---------------------------------------------------------------------------------------------- save / load


def test_save_load_keeps_everything(tmp_path, tiny_tokenizer, tiny_tokenizer_dir):
    tiny_tokenizer.save(tmp_path / "copy")
    again = load_tokenizer(tmp_path / "copy")
    from_file = load_tokenizer(tmp_path / "copy" / "tokenizer.json")
    for other in (again, from_file):
        assert other.sha256 == tiny_tokenizer.sha256
        assert other.vocab_size == tiny_tokenizer.vocab_size
        assert other.chat_template == THINKING_TOOLS_TEMPLATE
        assert (other.eos_id, other.im_start_id, other.im_end_id) == (0, 1, 2)
        assert other.encode("The 春眠不觉晓 test.") == tiny_tokenizer.encode("The 春眠不觉晓 test.")
    again.save(tmp_path / "copy2")
    assert (tmp_path / "copy2" / "tokenizer.json").read_bytes() == (tmp_path / "copy" / "tokenizer.json").read_bytes()
    assert load_tokenizer(tmp_path / "copy2").sha256 == tiny_tokenizer.sha256


def test_sha256_ignores_formatting_but_not_content(tmp_path, tiny_tokenizer, tiny_tokenizer_dir):
    raw = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    compact = tmp_path / "compact.json"
    compact.write_text(json.dumps(raw, separators=(",", ":")), encoding="utf-8")
    assert load_tokenizer(compact).sha256 == tiny_tokenizer.sha256
    raw["model"]["merges"] = raw["model"]["merges"][:-1]
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(raw), encoding="utf-8")
    assert load_tokenizer(changed).sha256 != tiny_tokenizer.sha256


def test_tokenizer_config_is_hf_compatible(tiny_tokenizer_dir):
    config = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["eos_token"] == config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] == "<|im_start|>"
    assert config["chat_template"] == THINKING_TOOLS_TEMPLATE
    assert config["clean_up_tokenization_spaces"] is False
    assert isinstance(config["model_max_length"], int)
    decoder = config["added_tokens_decoder"]
    assert [decoder[str(i)]["content"] for i in range(16)] == SPECIAL_TOKENS
    assert all(decoder[str(i)]["special"] for i in range(16))
    tags = {d["content"]: d for d in decoder.values() if d["content"] in TOOL_TAGS}  # vocabulary, not control
    assert sorted(tags) == sorted(TOOL_TAGS) and not any(d["special"] for d in tags.values())


def test_transformers_renders_and_encodes_the_same(tiny_tokenizer_dir, tiny_tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "again"}]
    for prompt in (False, True):
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert text == tiny_tokenizer.render_text(messages, prompt)
        assert hf.encode(text, add_special_tokens=False) == tiny_tokenizer.encode(text)
    assert hf.eos_token_id == tiny_tokenizer.eos_id


# ---------------------------------------------------------------------------------------------- loading others


def _train_minimind_shaped(directory):
    """A ByteLevel BPE with only MiniMind's three special tokens at ids 0..2 and a config with its own
    ChatML-style template (a default system prompt; the user turn opens the assistant turn)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    inner = HFTokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    inner.train_from_iterator(["hello there, 你好 世界", "a small corpus for a tiny test tokenizer"] * 50, trainer)
    directory.mkdir()
    inner.save(str(directory / "tokenizer.json"))
    template = (
        "{% if messages[0]['role'] == 'system' %}"
        "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
        "{% else %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'user' %}"
        "{{ '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n<|im_start|>assistant\\n' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
        "{% endfor %}")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
              "chat_template": template, "model_max_length": 32768}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return template


def test_loads_a_minimind_shaped_tokenizer(tmp_path):
    template = _train_minimind_shaped(tmp_path / "minimind")
    tok = load_tokenizer(tmp_path / "minimind")
    assert (tok.eos_id, tok.im_start_id, tok.im_end_id, tok.pad_id) == (0, 1, 2, 0)
    vocab = json.loads((tmp_path / "minimind" / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    assert tok.vocab_size == len(vocab) > 259
    assert tok.chat_template == template
    assert tok.decode(tok.encode("hello 你好 ☃")) == "hello 你好 ☃"
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "你好 世界"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "hello there"}]
    assert tok.render_text(messages).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert_mask_is_assistant_content(tok, messages)
    tok.save(tmp_path / "resaved")
    assert load_tokenizer(tmp_path / "resaved").sha256 == tok.sha256


def test_tokenizer_without_chatml_tokens_loads_but_cannot_render_chat(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    inner = HFTokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    inner.train_from_iterator(["plain text only"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    inner.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.eos_id == 0 and tok.im_start_id is None and tok.im_end_id is None
    with pytest.raises(NanoforgeError, match="no <\\|im_start\\|>/<\\|im_end\\|> tokens"):
        tok.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])


def test_missing_or_corrupt_tokenizer_files_name_the_path(tmp_path, tiny_tokenizer_dir):
    with pytest.raises(NanoforgeError, match="nope"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(NanoforgeError, match="empty_dir: no tokenizer.json"):
        load_tokenizer(tmp_path / "empty_dir")
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(NanoforgeError, match="bad.json: not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")
    broken = tmp_path / "broken_config"
    broken.mkdir()
    (broken / "tokenizer.json").write_bytes((tiny_tokenizer_dir / "tokenizer.json").read_bytes())
    (broken / "tokenizer_config.json").write_text("{", encoding="utf-8")
    with pytest.raises(NanoforgeError, match="tokenizer_config.json: not a valid"):
        load_tokenizer(broken)


# ---------------------------------------------------------------------------------------------- training


def test_trains_on_sft_dpo_and_plain_text(tmp_path):
    sft = _write_jsonl(tmp_path / "sft.jsonl", [{"conversations": [
        {"role": "system", "content": "zzsystemzz"}, {"role": "user", "content": "qquserqq"},
        {"role": "assistant", "content": "xxanswerxx"}]}] * 20)
    dpo = _write_jsonl(tmp_path / "dpo.jsonl", [{
        "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "goodgoodgood"}],
        "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "badbadbad"}]}] * 20)
    text = tmp_path / "book.txt"
    text.write_text("wordywordy lines\n" * 200, encoding="utf-8")
    tok = train_tokenizer([sft, dpo, text], vocab_size=400, out_dir=tmp_path / "tok")
    for word in ("zzsystemzz", "xxanswerxx", "goodgoodgood", "badbadbad", "wordywordy"):
        assert len(tok.encode(word)) == 1, word  # frequent words become single tokens: they were seen
    assert load_tokenizer(tmp_path / "tok").sha256 == tok.sha256


def test_training_rejects_bad_input_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        train_tokenizer([bad], vocab_size=300)
    unknown = _write_jsonl(tmp_path / "unknown.jsonl", [{"text": "ok"}, {"prompt": "what kind is this"}])
    with pytest.raises(DataError, match=r"unknown\.jsonl:2: cannot tell the kind"):
        train_tokenizer([unknown], vocab_size=300)
    with pytest.raises(NanoforgeError, match="at least 278"):
        train_tokenizer([bad], vocab_size=100)
    with pytest.raises(DataError, match="no such file"):
        train_tokenizer([tmp_path / "missing.jsonl"], vocab_size=300)


# ---------------------------------------------------------------------------------------------- chat


@pytest.fixture(scope="module")
def chatml_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with the plain ChatML template of older nanoforge tokenizers (no think block)."""
    return Tokenizer(tiny_tokenizer.backend, chat_template=CHAT_TEMPLATE)


def test_chat_template_renders_chatml(tiny_tokenizer, chatml_tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}]
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    assert chatml_tokenizer.render_text(messages) == expected
    assert chatml_tokenizer.render_text(messages[:2], add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    # what `tokenizer train` writes now: every assistant turn opens with a think block
    assert tiny_tokenizer.render_text(messages) == expected.replace("assistant\nA", "assistant\n<think>\n\n</think>\n\nA")
    assert tiny_tokenizer.render_text(messages[:2], add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("template", ["chatml", "thinking"])
def test_render_chat_mask_on_a_small_conversation(tiny_tokenizer, chatml_tokenizer, template):
    tokenizer = chatml_tokenizer if template == "chatml" else tiny_tokenizer
    messages = [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "ok"}, {"role": "assistant", "content": ""}]
    ids, mask = tokenizer.render_chat(messages)
    # the user turns repeat the assistant's words: only the assistant ones may be masked
    assert [tokenizer.decode(r) for r in _masked_runs(ids, mask)] == [assistant_turn(tokenizer, "ok"),
                                                                        assistant_turn(tokenizer, "")]
    header = tokenizer.encode("<|im_start|>assistant\n")
    start = ids.index(tokenizer.im_start_id, 1 + ids.index(tokenizer.im_start_id))
    assert ids[start:start + len(header)] == header and mask[start:start + len(header)] == [0] * len(header)
    assert ids[-1] == tokenizer.encode("\n")[0] and mask[-1] == 0  # the newline after <|im_end|>


@pytest.mark.parametrize("template", ["chatml", "thinking"])
def test_render_chat_with_generation_prompt_masks_nothing_after_the_last_answer(tiny_tokenizer, chatml_tokenizer,
                                                                                 template):
    tokenizer = chatml_tokenizer if template == "chatml" else tiny_tokenizer
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"}]
    ids, mask = tokenizer.render_chat(messages, add_generation_prompt=True)
    prompt = "<|im_start|>assistant\n" + ("" if template == "chatml" else "<think>\n\n</think>\n\n")
    assert tokenizer.decode(ids).endswith(prompt)
    assert [tokenizer.decode(r) for r in _masked_runs(ids, mask)] == [assistant_turn(tokenizer, "hello")]


@pytest.mark.parametrize("name", ["sft_zh_sharegpt_1k.jsonl", "sft_zh_kdconv.jsonl"])
def test_render_chat_mask_on_real_multi_turn_conversations(shared_data, tiny_tokenizer, chatml_tokenizer, name):
    checked = 0
    for conversation in _conversations(shared_data / "minimind" / name, limit=120):
        without_system = [m for m in conversation if m["role"] != "system"]
        system = {"role": "system", "content": "你是一个乐于助人的助手。Answer briefly."}
        with_system = [system] + without_system
        for tokenizer in (tiny_tokenizer, chatml_tokenizer):
            assert_mask_is_assistant_content(tokenizer, without_system)
            assert_mask_is_assistant_content(tokenizer, with_system)
            assert_mask_is_assistant_content(tokenizer, with_system[:-1], add_generation_prompt=True)
        checked += len(without_system) >= 4
    assert checked >= 50  # most of these are multi-turn


def test_mask_edge_crossed_by_a_token_is_an_error(tmp_path):
    corpus = tmp_path / "newlines.txt"
    corpus.write_text("a\n\n\nb\n" * 500, encoding="utf-8")  # makes "\n\n" a token
    tok = train_tokenizer([corpus], vocab_size=300)
    assert len(tok.encode("\n\n")) == 1
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "\n\nb"}]
    # plain ChatML puts the content right after the header's "\n"; the thinking template strips leading
    # newlines and opens every turn with the <think> token, so its edges are always clean
    with pytest.raises(ChatTemplateError, match="crosses the edge of an assistant message"):
        Tokenizer(tok.backend, chat_template=CHAT_TEMPLATE).render_chat(messages)
    assert_mask_is_assistant_content(tok, messages)


def test_template_that_alters_contents_masks_the_turn_it_renders(tiny_tokenizer):
    """The mask covers each assistant turn as the template renders it (MiniMind-3's strips newlines), so a
    template that trims contents is fine."""
    stripping = CHAT_TEMPLATE.replace("message['content']", "(message['content'] | trim)")
    tok = Tokenizer(tiny_tokenizer.backend, chat_template=stripping)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " padded "}]
    ids, mask = tok.render_chat(messages)
    assert [tok.decode(r) for r in _masked_runs(ids, mask)] == ["padded<|im_end|>"]
    with pytest.raises(ChatTemplateError, match=r"message 0 \(user\) field 'content': must be a string, got a number"):
        tiny_tokenizer.render_chat([{"role": "user", "content": 3}])
