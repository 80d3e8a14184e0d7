"""Byte-level BPE tokenizers: train one, load any `tokenizer.json`, render chats with ChatML (with thinking and
tool calls in MiniMind-3's format for the tokenizers nanoforge trains).

Why byte-level BPE (GPT-2, section 2.2): the 256 bytes are always in the vocabulary, so every string encodes and
decodes back exactly, with no <unk>; HF `tokenizers` does the work, and its `tokenizer.json` every tool reads.

The chat template, stored next to the tokenizer in HF's format, is the one definition of how a conversation
becomes text: `apply_chat_template` renders the string SFT trained on, and `render_chat` masks that string.

Control tokens come only from the template: text inside a message's content that spells a special token
(`<|im_end|>`, `<|im_start|>`, `<|endoftext|>`, ...) is encoded as plain text, so a user cannot forge a
system or assistant turn and a training record that quotes ChatML keeps its loss mask. Here, and only here,
the ids differ from HF's apply_chat_template + encode (which would make those real control tokens)."""
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from nanoforge.chat.template import (CHAT_TEMPLATE, IM_END, THINKING_TOOLS_TEMPLATE, TOOL_TAGS, ChatTemplateError,
                                     assistant_mask, assistant_turns, check_disguise, compile_template, disguise,
                                     without_empty_think)
from nanoforge.chat.pieces import PIECE_CHARS, text_pieces
from nanoforge.core.checksums import LISTING, verify_file, write_checksums
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import os_error_in, read_json, write_json
from nanoforge.chat.messages import normalize_conversation

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|reserved_{i}|>" for i in range(13)]
EOS_TOKEN, IM_START = SPECIAL_TOKENS[:2]

# How `tokenizer train` cuts text into pieces before BPE (the pattern Qwen2's tokenizers use; llama.cpp knows
# it as the "qwen2" pre-tokenizer). Unlike GPT-2's pattern, a run of newlines is one piece whatever follows it,
# so "</think>\n\n" ends a generation prompt with the same tokens that training saw before the answer (GPT-2's
# splits "\n\nText" into "\n", "\n", "Text" but a trailing "\n\n" into one token); digits are one piece each.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
DEFAULT_MODEL_MAX_LENGTH = 32768
PLAIN_TEXT_SUFFIXES = (".txt", ".text", ".md")


# ---------------------------------------------------------------------------------------------- class

class Tokenizer:
    """A `tokenizers.Tokenizer` plus what nanoforge needs around it: special ids, chat template, hash."""

    def __init__(self, inner, chat_template: str | None = None, config: dict | None = None):
        self._tok = inner
        self.config = dict(config or {})  # the tokenizer_config.json it was loaded with, if any
        self.chat_template = chat_template if chat_template is not None else CHAT_TEMPLATE
        self.vocab_size = inner.get_vocab_size(with_added_tokens=True)
        # <|endoftext|> when present (ours, MiniMind's, Qwen's); else whatever the config calls eos
        eos_name = EOS_TOKEN if inner.token_to_id(EOS_TOKEN) is not None else _token_text(self.config.get("eos_token"))
        self.eos_id = self.pad_id = inner.token_to_id(eos_name) if eos_name else None
        self.im_start_id = inner.token_to_id(IM_START)
        self.im_end_id = inner.token_to_id(IM_END)
        self.model_max_length = int(self.config.get("model_max_length") or DEFAULT_MODEL_MAX_LENGTH)
        self.sha256 = hashlib.sha256(_canonical_json(inner.to_str()).encode("utf-8")).hexdigest()
        self._compiled_template = None
        self._plain_tok = None  # a copy that encodes special-token text as plain text, made on first need

    @functools.cached_property
    def split_pattern(self) -> str | None:
        """How text is cut before BPE, in llama.cpp's names: "qwen2" (SPLIT_PATTERN, what `tokenizer train`
        writes), "gpt-2" (a ByteLevel pre-tokenizer with GPT-2's pattern: older nanoforge tokenizers, MiniMind's),
        or None for anything else."""
        pre = json.loads(self._tok.to_str()).get("pre_tokenizer") or {}
        if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
            return "gpt-2"
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
        if (len(parts) == 2 and parts[0].get("type") == "Split" and parts[0].get("pattern") == {"Regex": SPLIT_PATTERN}
                and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex", True)):
            return "qwen2"
        return None

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, sha256={self.sha256[:12]})"

    def __getstate__(self):
        # Sent to worker processes by `prepare`; the compiled Jinja template does not pickle.
        return {**self.__dict__, "_compiled_template": None, "_plain_tok": None}

    @property
    def stop_ids(self) -> list[int]:
        """The tokens that end a reply, for every command that generates (chat, generate, eval, serve, RL): end of
        text, <|im_end|>, and <|im_start|> (a model opening the next turn has finished its own)."""
        return [t for t in (self.eos_id, self.im_end_id, self.im_start_id) if t is not None]

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool calls and results (MiniMind-3's format, ours since it)."""
        return "<tool_call>" in (self.chat_template or "")

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's string length (a byte-level one's is its bytes): n times this holds n tokens' text."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)))

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer`, for the rare caller that needs offsets or the vocab."""
        return self._tok

    # ---- encode / decode

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False: no post-processor (BOS/EOS) is ever added behind our back; the data
        # pipeline appends eos itself and the chat template spells out its special tokens.
        if len(text) <= PIECE_CHARS:
            return self._tok.encode(text, add_special_tokens=False).ids
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts with the Rust batch encoder (multi-threaded unless TOKENIZERS_PARALLELISM=false),
        PIECE_CHARS characters at a time (encode_pieces)."""
        out: list[list[int]] = [[] for _ in texts]
        for index, ids in self.encode_pieces(texts):
            out[index].extend(ids)
        return out

    def encode_pieces(self, texts: Sequence[str]) -> Iterator[tuple[int, list[int]]]:
        """(index of the text, its next ids) for `texts` in order, encoded in batches of about PIECE_CHARS
        characters, a longer text in pieces cut where its ids are the whole text's (chat/pieces.py): the
        encoder's memory is bounded by the batch, whatever the texts' lengths. Every text has a piece."""
        batch, where, chars = [], [], 0
        for index, text in enumerate(texts):
            for piece in text_pieces(text, self.split_pattern):
                batch.append(piece)
                where.append(index)
                chars += len(piece)
                if chars >= PIECE_CHARS:
                    yield from zip(where, self._encode_many(batch))
                    batch, where, chars = [], [], 0
        if batch:
            yield from zip(where, self._encode_many(batch))

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        fast = getattr(self._tok, "encode_batch_fast", None)  # tokenizers >= 0.21: skips offset tracking
        return [e.ids for e in (fast or self._tok.encode_batch)(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    # ---- save

    def save(self, directory: str | os.PathLike) -> Path:
        """Write tokenizer.json and an HF-compatible tokenizer_config.json (AutoTokenizer can load the dir), and
        their checksums.sha256 (load_tokenizer checks it)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        try:
            self._tok.save(str(directory / "tokenizer.json"), pretty=True)
        except Exception as e:  # tokenizers reports an OS error (a full disk) as a bare Exception
            raise (os_error_in(e, directory / "tokenizer.json") or e) from None
        write_json(directory / "tokenizer_config.json", self.hf_config())
        write_checksums(directory / LISTING, [directory / "tokenizer.json", directory / "tokenizer_config.json"])
        return directory

    def hf_config(self) -> dict:
        """tokenizer_config.json contents in the shape transformers' PreTrainedTokenizerFast expects."""
        fields = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
        added = {str(token_id): {k: getattr(token, k) for k in fields}
                 for token_id, token in sorted(self._tok.get_added_tokens_decoder().items())}
        eos = self.id_to_token(self.eos_id) if self.eos_id is not None else None
        chatml = [t for t in (IM_START, IM_END) if self._tok.token_to_id(t) is not None]
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            # MiniMind's choices for bos/unk (users know them); eos/pad follow our eos_id.
            "bos_token": _token_text(self.config.get("bos_token")) or (IM_START if IM_START in chatml else None),
            "eos_token": eos, "pad_token": eos, "unk_token": _token_text(self.config.get("unk_token")) or eos,
            "additional_special_tokens": chatml, "added_tokens_decoder": added, "chat_template": self.chat_template,
            "model_max_length": self.model_max_length, "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
        }

    # ---- chat

    def render_text(self, messages: Sequence[dict], add_generation_prompt: bool = False, tools=None, *,
                    drop_empty_think: bool = False, **template_kwargs) -> str:
        """The conversation as text, exactly as HF `apply_chat_template(messages, tools=tools,
        add_generation_prompt=..., tokenize=False, **template_kwargs)` renders it (`open_thinking` and
        `enable_thinking` are such kwargs). A JSON-string `tool_calls` or `tools`, and `tools` carried by the
        opening system message, are parsed first (chat/messages.py); shape errors name the message and field.
        drop_empty_think=True removes the empty think block from every assistant turn (without_empty_think:
        SFT data with and without one, as MiniMind-3 trains); never part of HF's render."""
        messages, tools = normalize_conversation(messages, tools)
        if self._compiled_template is None:
            self._compiled_template = compile_template(self.chat_template)
        try:  # with the special-token names HF passes to templates (bos_token, eos_token, ...)
            text = self._compiled_template.render(**template_kwargs, messages=messages, tools=tools,
                                                  add_generation_prompt=add_generation_prompt, **self._template_names)
        except NanoforgeError:
            raise
        except Exception as e:  # jinja2 errors and whatever the template's own expressions raise
            raise ChatTemplateError(f"the chat template could not render this conversation: {e}") from e
        return without_empty_think(text) if drop_empty_think else text

    @functools.cached_property
    def _template_names(self) -> dict:
        config = self.hf_config()
        return {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "additional_special_tokens")}

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False, tools=None,
                    **template_kwargs) -> tuple[list[int], list[int]]:
        """Token ids of the rendered conversation and a loss mask: 1 on each assistant turn (its think block,
        content, tool calls and closing <|im_end|>), 0 elsewhere (system, user, tool results, the
        `<|im_start|>assistant\\n` header, the `\\n` after <|im_end|>, the generation prompt).

        The whole rendered string is encoded in one call, so the ids equal what HF apply_chat_template +
        encode gives (but for special-token text in a message or tool, object keys included, which stays plain
        text: see the module docstring); the mask comes from the character offsets of that one encoding."""
        ids, mask, _ = self.render_chat_with_text(messages, add_generation_prompt, tools, **template_kwargs)
        return ids, mask

    def render_chat_with_text(self, messages: Sequence[dict], add_generation_prompt: bool = False, tools=None,
                              *, drop_empty_think: bool = False, **template_kwargs):
        """render_chat plus the rendered text (`prepare` counts its UTF-8 bytes for bits per byte).
        drop_empty_think: as render_text's (the mask then covers the shorter turns)."""
        ids, mask, text = self.render_chat_arrays(messages, add_generation_prompt, tools,
                                                  drop_empty_think=drop_empty_think, **template_kwargs)
        return ids.tolist(), mask.tolist(), text

    def render_chat_arrays(self, messages: Sequence[dict], add_generation_prompt: bool = False, tools=None,
                           *, drop_empty_think: bool = False, **template_kwargs):
        """render_chat_with_text with the ids and mask as numpy arrays (int64, uint8), as `prepare` stores them:
        a long conversation is encoded in pieces (chat/pieces.py), so its memory is a few arrays of its tokens."""
        if self.im_start_id is None or self.im_end_id is None:
            raise ChatTemplateError(
                "this tokenizer has no <|im_start|>/<|im_end|> tokens, so it cannot render ChatML "
                "conversations; use a tokenizer trained by `nanoforge tokenizer train` or another ChatML one")
        messages, tools = normalize_conversation(messages, tools)
        template_kwargs = {**template_kwargs, "drop_empty_think": drop_empty_think}
        text = self.render_text(messages, add_generation_prompt, tools, **template_kwargs)
        ids, offsets = self._encode_offsets(self._tok, text)
        found = self._specials_of(ids, offsets)
        structural = self._structural_tokens(text, found, messages, tools, add_generation_prompt, template_kwargs)
        if structural != found:
            ids, offsets = self._encode_with_structure(text, structural)
        expected = sum(m["role"] == "assistant" for m in messages)
        spans = assistant_turns(text, structural, self.im_start_id, self.im_end_id, expected)
        mask = assistant_mask(ids, offsets, spans, self.im_end_id, text)
        return ids, mask, text

    def _encode_offsets(self, tok, text: str, at: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Ids and (n, 2) int32 character offsets (counted from `at`) of `text` encoded by `tok`, piece by piece
        (chat/pieces.py: the ids of one encoding of the whole)."""
        ids, offsets = [], []
        for piece in text_pieces(text, self.split_pattern):
            encoding = tok.encode(piece, add_special_tokens=False)
            ids.append(np.array(encoding.ids, dtype=np.int64))
            offsets.append(np.array(encoding.offsets, dtype=np.int32).reshape(-1, 2) + at)
            at += len(piece)
        return np.concatenate(ids), np.concatenate(offsets)

    # ---- chat: keeping the text of messages plain

    @functools.cached_property
    def _special_tokens(self) -> tuple[frozenset, tuple]:
        """Ids and texts of the added tokens marked special (<|im_start|>, <|im_end|>, <|endoftext|>, ...).
        Added tokens with special=False (MiniMind's <think>, <tool_call>) are ordinary vocabulary: a message
        may use them, and HF encodes them as the same single tokens inside any text."""
        added = {i: t for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        return frozenset(added), tuple(t.content for t in added.values() if t.content)

    def _specials_of(self, ids: np.ndarray, offsets: np.ndarray) -> list[tuple[int, int, int]]:
        at = np.flatnonzero(np.isin(ids, list(self._special_tokens[0])))
        return [(int(offsets[i, 0]), int(offsets[i, 1]), int(ids[i])) for i in at]

    def _structural_tokens(self, text, found, messages, tools, add_generation_prompt, template_kwargs):
        """The control tokens the template itself put in `text`, as (start, end, id).

        When no string in the conversation (an object key neither) spells a special token, they are the special
        tokens `found` in the one normal encoding. Otherwise the conversation is rendered again with every such
        text replaced by as many filler characters (same length, no control token), which must give the same
        text but for those places; the special tokens of that render's encoding are the template's own."""
        strings = self._special_tokens[1]
        fill = next((c for c in "#~@%^" if not any(c in s for s in strings)), "#")
        hidden, fields = disguise(messages, strings, fill, "messages")
        hidden_tools, tool_fields = disguise(tools, strings, fill, "tools")
        if not fields + tool_fields:
            return found
        disguised = self.render_text(hidden, add_generation_prompt, hidden_tools, **template_kwargs)
        check_disguise(text, disguised, strings, fields + tool_fields)
        return self._specials_of(*self._encode_offsets(self._tok, disguised))

    def _plain_text_tokenizer(self):
        """A second `tokenizers.Tokenizer` that encodes special-token text like any other text. A separate
        object (never the shared one toggled), since the server encodes from several threads at once."""
        if self._plain_tok is None:
            from tokenizers import Tokenizer as HFTokenizer

            plain = HFTokenizer.from_str(self._tok.to_str())
            try:
                plain.encode_special_tokens = True
            except AttributeError:  # tokenizers < 0.15 cannot split special tokens
                raise ChatTemplateError("a message contains special-token text (e.g. <|im_end|>), and this version "
                                        "of the `tokenizers` package cannot encode it as plain text; upgrade it "
                                        "(pip install -U tokenizers)") from None
            self._plain_tok = plain
        return self._plain_tok

    def _encode_with_structure(self, text: str, structural) -> tuple[np.ndarray, np.ndarray]:
        """Ids and offsets of `text` whose control tokens are exactly the `structural` ones.

        The text between two structural tokens is encoded in one piece with special tokens disabled: exactly
        what one normal encode does between special tokens (the same pre-tokenization and merges), except
        that special-token text inside a message stays text. Non-special added tokens (<think>, <tool_call>)
        are still matched, as they are everywhere else."""
        plain = self._plain_text_tokenizer()
        ids, offsets, cursor = [], [], 0
        for start, end, token in list(structural) + [(len(text), len(text), None)]:
            if start > cursor:
                piece_ids, piece_offsets = self._encode_offsets(plain, text[cursor:start], cursor)
                ids.append(piece_ids)
                offsets.append(piece_offsets)
            if token is not None:
                ids.append(np.array([token], dtype=np.int64))
                offsets.append(np.array([[start, end]], dtype=np.int32))
            cursor = max(cursor, end)
        return np.concatenate(ids), np.concatenate(offsets)


def _canonical_json(text: str) -> str:
    """One spelling of a tokenizer.json, whatever indentation or key order it was saved with."""
    return json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------------------------------------- load

def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a directory holding tokenizer.json (+ optional tokenizer_config.json / chat_template.jinja),
    or a tokenizer.json file (its sibling config is used too). Any HF tokenizer.json loads."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path)
    if not path.exists():
        raise NanoforgeError(f"{path}: no such tokenizer file or directory")
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise NanoforgeError(f"{path}: no tokenizer.json in this directory; train one with "
                             "`nanoforge tokenizer train` or point at a tokenizer.json")
    for read in (file, file.parent / "tokenizer_config.json", file.parent / "chat_template.jinja"):
        if read.is_file():
            verify_file(read)  # against the checksums.sha256 written with it, where there is one
    try:
        inner = HFTokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception for any parse problem
        raise NanoforgeError(f"{file}: not a valid tokenizer.json ({e})") from None
    if reason := _forgeable_special_token(inner):
        raise NanoforgeError(f"{file}: {reason}")
    config_file = file.parent / "tokenizer_config.json"
    config = read_json(config_file, "tokenizer_config.json") if config_file.is_file() else {}
    return Tokenizer(inner, chat_template=_read_chat_template(file.parent, config), config=config)


def _forgeable_special_token(inner) -> str | None:
    """Why text in a message could become a control token with this tokenizer, or None. Rendering keeps message
    text plain by finding the special tokens' exact spellings in it (Tokenizer._structural_tokens), which holds
    when a special token matches only its own text: not when it is matched after a normalizer ("normalized": true
    with NFKC, say, turns fullwidth ＜｜im_end｜＞ into <|im_end|>), nor when its text, encoded as plain text,
    merges back into a special token."""
    normalizer = (json.loads(inner.to_str()).get("normalizer") or {}).get("type")
    specials = {i: t for i, t in inner.get_added_tokens_decoder().items() if t.special and t.content}
    for token in specials.values():
        if normalizer and token.normalized:
            return (f"its special token {token.content!r} is matched after the {normalizer} normalizer "
                    '("normalized": true), so message text that normalizes to it (fullwidth look-alikes, say) would '
                    'become that control token; set "normalized": false on its special tokens in added_tokens')
    if not hasattr(inner, "encode_special_tokens"):  # tokenizers < 0.15: rendering says so when it matters
        return None
    was, inner.encode_special_tokens = inner.encode_special_tokens, True  # not yet shared with anything
    try:
        for token in specials.values():
            if forged := set(inner.encode(token.content, add_special_tokens=False).ids) & set(specials):
                return (f"its special token {token.content!r}, encoded as plain text, gives special token id(s) "
                        f"{sorted(forged)}: message text could not stay text; use a tokenizer whose vocabulary "
                        "does not merge up to its special tokens")
    finally:
        inner.encode_special_tokens = was
    return None


def _read_chat_template(directory: Path, config: dict) -> str | None:
    """The template from chat_template.jinja (newer transformers) or tokenizer_config.json, else ours."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# ---------------------------------------------------------------------------------------------- train

def train_bpe(texts: Iterable[str], vocab_size: int = 6400, out_dir: str | os.PathLike | None = None,
              min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE tokenizer on a stream of texts (data/sources.py's train_tokenizer reads files).

    The texts are streamed through `train_from_iterator`, so their size is limited by disk, not memory.
    The special tokens take ids 0..15; the 256 byte symbols are all in the initial alphabet, so any text
    round-trips even if some bytes never occur in the training files. The six thinking and tool tags
    (<think>, <tool_call>, ...) take the last six ids, as added tokens that are not special, and the tokenizer
    gets the template that renders thinking and tool calls (chat_template.THINKING_TOOLS_TEMPLATE)."""
    from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    minimum = len(SPECIAL_TOKENS) + 256 + len(TOOL_TAGS)
    if vocab_size < minimum:
        raise NanoforgeError(f"vocab_size {vocab_size} is too small: byte-level BPE needs the 256 bytes plus "
                             f"{len(SPECIAL_TOKENS)} special tokens and {len(TOOL_TAGS)} tags, so at least {minimum}")
    inner = HFTokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TOOL_TAGS), min_frequency=min_frequency,
                                  special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    inner.train_from_iterator(texts, trainer=trainer)
    inner.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_TAGS])
    tokenizer = Tokenizer(inner, chat_template=THINKING_TOOLS_TEMPLATE)
    if out_dir is not None:
        tokenizer.save(out_dir)
    return tokenizer
