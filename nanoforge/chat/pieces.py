"""Where a text may be cut so that tokenizing the parts gives the tokens of the whole: how `prepare` reads a
plain-text file in chunks (data/chunks.py), and how the tokenizer encodes a long text piece by piece
(chat/tokenizer.py), so that its memory is bounded by the piece, not by the text (the Rust encoder holds about
150 bytes per character of what it is given: a 30 MB record took 4 to 7 GB in one piece).

Why the places are safe: BPE merges never cross pre-tokens, and the pre-tokenizer's regex looks ahead, never
behind. Where no match of the whole text's pre-tokenization spans the cut, both parts are matched as the whole
was. The rules below (text_cut, _space_cut) name such places for GPT-2's split pattern and Qwen2's (the two
Tokenizer.split_pattern knows), and for any pre-tokenizer that splits at whitespace. Where the tokens may differ:
  - a stretch of PIECE_CHARS characters with no line break and no space or tab after a word (a whole language
    written without spaces, one line of 256K characters) is cut where it ends, inside a pre-token;
  - a tokenizer whose normalizer prepends to the text (the `Prepend` of Llama 2's converted tokenizer) prepends
    to each piece;
  - a special token that strips the whitespace beside it (`lstrip`/`rstrip` in tokenizer.json) right at a cut;
  - a non-ASCII space just before a cut may split that whitespace run differently (never the decoded text).
Texts of up to PIECE_CHARS characters are never cut, so none of this touches ordinary records."""
from __future__ import annotations

from typing import Iterator

PIECE_CHARS = 1 << 18  # characters encoded at a time: ~40 MB of the encoder's memory
# ASCII whitespace; the pre-tokenizer's \s also matches a few non-ASCII spaces (U+00A0, U+3000, ...)
_WHITESPACE = b" \t\n\r\x0b\x0c"


def text_cut(data: bytes, split_pattern: str | None = "gpt-2") -> int:
    """Where to cut `data` (UTF-8 text) so that tokenizing the two parts gives the tokens of the whole, for the
    tokenizer's split pattern (Tokenizer.split_pattern); 0 if there is no such place. GPT-2's pattern (and any
    other): just before the last whitespace run that holds a line break and follows a non-space character.
    Qwen2's ("qwen2", what `tokenizer train` writes): see _cut_after_line_break.

    Why there: GPT-2's regex ends a word, number or punctuation run at whitespace and starts a match at the first
    whitespace after one, looking ahead, never behind: cut before the whole run, both parts match as in the whole
    text (after the newline, "a  \\n" would make one pre-token of "  \\n"). A non-ASCII space just before the run
    (rare) can change how that run is split, never the decoded text. The cut is at an ASCII byte, so never inside
    a UTF-8 character."""
    if split_pattern == "qwen2":
        return _cut_after_line_break(data)
    newline = data.rfind(b"\n")
    return len(data[:newline].rstrip(_WHITESPACE)) if newline > 0 else 0  # 0 also when all before is whitespace


def _cut_after_line_break(data: bytes) -> int:
    """Just after the last line break that a non-space character follows. Qwen2's pattern never matches across
    that place: every alternative that can hold a line break ends at it (a newline run, punctuation with its
    trailing newlines), and none starts with one before a letter, digit or mark. Both parts start their
    matching there as the whole text does, and a piece ending in a line break is matched before any look-ahead
    alternative is tried. (Cutting before the whitespace, as for GPT-2, would split ".\\n\\n", one piece here.)"""
    newline = data.rfind(b"\n")
    while newline >= 0:
        lead = data[newline + 1:newline + 2]
        size = 1 if lead < b"\x80" else 2 if lead < b"\xe0" else 3 if lead < b"\xf0" else 4
        try:
            after = data[newline + 1:newline + 1 + size].decode("utf-8") if lead else ""
        except UnicodeDecodeError:  # cut off at the end of `data`, or not UTF-8: not a place to cut
            after = ""
        if len(after) == 1 and not after.isspace():
            return newline + 1
        newline = data.rfind(b"\n", 0, newline)
    return 0


def _space_cut(data: bytes) -> int:
    """Just before the last space or tab that follows a non-space character; 0 if none. In GPT-2's and Qwen2's
    patterns no alternative holds a non-space character followed by a space or tab (Qwen2's punctuation takes
    line breaks after it, never spaces), so a match starts there, as it does at the start of a text."""
    end = len(data)
    while True:
        at = max(data.rfind(b" ", 0, end), data.rfind(b"\t", 0, end))
        if at <= 0:
            return 0
        if data[at - 1:at] not in _WHITESPACE:
            return at
        end = at


def text_pieces(text: str, split_pattern: str | None, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of at most `size` characters (at least one piece; a text that fits is itself), each cut
    at the last place in it that text_cut gives, else before a space (_space_cut), else at `size` characters."""
    start = 0
    while len(text) - start > size:
        window = text[start:start + size].encode("utf-8")
        cut = text_cut(window, split_pattern) or _space_cut(window)
        cut = len(window[:cut].decode("utf-8")) if cut else size  # an ASCII byte: never inside a character
        yield text[start:start + cut]
        start += cut
    yield text[start:]
