"""A reply's text as its tokens arrive: decoded incrementally, cut at stop strings, shown only when safe.

Byte-level tokens can carry part of a UTF-8 character (a third of a Chinese character decodes to U+FFFD), so
tokens are decoded in small groups: the ones since the last clean boundary, until they decode without a
trailing U+FFFD. Each token is decoded about once, not the whole reply per token. A piece is shown (`take`) up
to where the text could still turn into a stop string (the next token may complete it)."""
from typing import Sequence

MAX_HELD_TOKENS = 8  # bytes that have not formed a character after this many tokens never will


class ReplyText:
    """The text of one reply so far (`text`, before any stop string), and how much of it was shown."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        self.tokenizer, self.stop_strings = tokenizer, list(stop_strings)
        self.longest_stop = max((len(s) for s in self.stop_strings), default=0)
        self.text, self.held, self.shown = "", [], 0
        self.stopped = False  # a stop string was found: `text` ends before it

    def add(self, token: int) -> bool:
        """Take the next token; True when a stop string has appeared (the text is then cut before it)."""
        self.held.append(token)
        piece = self.tokenizer.decode(self.held)
        if piece.endswith("\ufffd") and len(self.held) < MAX_HELD_TOKENS:
            return False
        self.held = []
        before = len(self.text)
        self.text += piece
        if self.stop_strings:
            cut = stop_index(self.text, self.stop_strings, max(0, before - self.longest_stop + 1))
            if cut is not None:
                self.text, self.stopped = self.text[:cut], True
        return self.stopped

    def finish(self) -> None:
        """No more tokens: whatever is held is shown as it decodes."""
        if self.held and not self.stopped:
            self.held, piece = [], self.tokenizer.decode(self.held)
            self.text += piece
            cut = stop_index(self.text, self.stop_strings, 0) if self.stop_strings else None
            if cut is not None:
                self.text, self.stopped = self.text[:cut], True

    def take(self, final: bool = False) -> str:
        """The text not shown yet that is safe to show (all of it when `final`)."""
        end = len(self.text) if final or self.stopped else self._safe_length()
        piece = self.text[self.shown:end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return piece

    def _safe_length(self) -> int:
        """Not a suffix that a stop string starts with."""
        text, hold = self.text, 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(text)), hold, -1):  # longest first; shorter than hold can't matter
                if text.endswith(s[:n]):
                    hold = n
                    break
        return len(text) - hold


def stop_index(text: str, stop_strings: Sequence[str], start: int = 0) -> int | None:
    """Where the earliest stop string begins in text[start:] (an index into text), None when none does."""
    found = [i for i in (text.find(s, start) for s in stop_strings) if i >= 0]
    return min(found) if found else None


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string."""
    cut = stop_index(text, stop_strings)
    return text if cut is None else text[:cut]
