"""Log-probs in OpenAI's two shapes: `/v1/completions`' legacy `{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}` and chat's `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`.

A token is written as its own text when its bytes are UTF-8 by themselves, else as `bytes:\\xe4\\xbd` (OpenAI's
spelling of a token that holds part of a character); chat's `bytes` are always its exact bytes. So the tokens
join to the reply's text wherever no character is split between tokens, and `bytes` join to it always.
`text_offset` is where each token's text starts in the choice's text (a token completing a character that an
earlier one began starts where that character does).

Which tokens: every token the reply's text came from. A reply cut by a stop string keeps the tokens that start
before the cut (the last of them may reach past it); a reply ended by a stop token (`<|endoftext|>`, ...) ends
with that token on `/v1/completions` (as OpenAI's did: a scorer that drops a last generated token relies on it),
not in chat (its content has no such token). Streamed, a token's entry goes with the chunk whose text reaches
where it starts, the rest with the choice's last chunk: joined, the chunks' entries equal the whole reply's."""
import codecs
from dataclasses import dataclass

from nanoforge.serve.worker import Choice, Piece


@dataclass
class Entry:
    """One token of a reply or prompt: its log-prob (None for a prompt's first token, which nothing predicts),
    the most likely tokens there as (token, log-prob) (as many as asked), and where its text starts."""
    token: int
    logprob: float | None
    top: list[tuple[int, float]]
    offset: int


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the character that stands for each byte -> the byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenText:
    """Each token's bytes and the string it is written as (see the module docstring), cached per token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.added = {i: t.content for i, t in tokenizer.backend.get_added_tokens_decoder().items()}
        self.byte_of = _byte_decoder()
        self.cache: dict[int, tuple[bytes, str]] = {}

    def bytes(self, token: int) -> bytes:
        return self._lookup(token)[0]

    def string(self, token: int) -> str:
        return self._lookup(token)[1]

    def _lookup(self, token: int) -> tuple[bytes, str]:
        if token not in self.cache:
            data = self._bytes(token)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
            self.cache[token] = (data, text)
        return self.cache[token]

    def _bytes(self, token: int) -> bytes:
        if token in self.added:
            return self.added[token].encode("utf-8")
        piece = self.tokenizer.id_to_token(token)
        if piece is not None and all(c in self.byte_of for c in piece):  # a byte-level token
            return bytes(self.byte_of[c] for c in piece)
        return self.tokenizer.decode([token]).encode("utf-8")  # another kind of tokenizer: its text


class Offsets:
    """Where each token's text starts in the text its bytes decode to, read one token at a time from `start`."""

    def __init__(self, text: TokenText, start: int = 0):
        self.text, self.length = text, start
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token: int) -> int:
        at = self.length
        self.length += len(self.decoder.decode(self.text.bytes(token)))
        return at

    def end(self) -> int:
        """The text's length once every byte added is decoded (a cut character as U+FFFD)."""
        return self.length + len(self.decoder.decode(b"", final=True))


def prompt_entries(text: TokenText, prompt: list[int], scores: list[tuple[float, list]]) -> list[Entry]:
    """A prompt's tokens with the engine's log-probs of all but the first (Sequence.prompt_logprobs)."""
    offsets = Offsets(text)
    first = Entry(prompt[0], None, [], offsets.add(prompt[0]))
    return [first] + [Entry(token, logprob, pairs, offsets.add(token))
                      for token, (logprob, pairs) in zip(prompt[1:], scores)]


class ReplyEntries:
    """One choice's entries for its sampled tokens, handed out as its text is shown (the module docstring):
    `feed(piece)` the entries that go with that piece's chunk, `end(choice)` the rest. `start`: the offset of the
    reply's text in the choice's text (after an echoed prompt); `with_stop`: a stop token ends the entries."""

    def __init__(self, text: TokenText, start: int, with_stop: bool):
        self.offsets, self.start, self.with_stop = Offsets(text, start), start, with_stop
        self.entries: list[Entry] = []
        self.given, self.shown = 0, start

    def feed(self, piece: Piece) -> list[Entry]:
        self._add(piece.token_ids, piece.logprobs, piece.top_logprobs)
        self.shown += len(piece.text)
        ready = [e for e in self.entries[self.given:] if e.offset < self.shown]
        self.given += len(ready)
        return ready

    def end(self, choice: Choice) -> list[Entry]:
        known, n = len(self.entries), len(choice.token_ids)
        self._add(choice.token_ids[known:], choice.logprobs[known:n], choice.top_logprobs[known:n])
        text_end = self.start + len(choice.text)
        rest = self.entries[self.given:]
        if self.offsets.end() > text_end:  # a stop string cut the text
            rest = [e for e in rest if e.offset < text_end]
        if self.with_stop and choice.stop_id is not None and len(choice.logprobs) > n:
            top = choice.top_logprobs[n] if len(choice.top_logprobs) > n else []
            rest.append(Entry(choice.stop_id, choice.logprobs[n], top, text_end))
        self.given = len(self.entries)
        return rest

    def _add(self, tokens: list[int], logprobs: list[float], tops: list) -> None:
        for i, token in enumerate(tokens):  # no top log-probs asked: the engine lists none
            top = tops[i] if i < len(tops) else []
            self.entries.append(Entry(token, logprobs[i], top, self.offsets.add(token)))


# ---------------------------------------------------------------------------------------------- the shapes

def legacy_logprobs(entries: list[Entry], text: TokenText) -> dict:
    """/v1/completions' shape. Each top_logprobs dict holds the most likely tokens and the chosen one (so up to
    logprobs + 1 of them, as OpenAI's); null for a prompt's first token."""
    def top(entry: Entry) -> dict | None:
        if entry.logprob is None:
            return None
        most = {}
        for token, logprob in entry.top:
            most.setdefault(text.string(token), logprob)
        most.setdefault(text.string(entry.token), entry.logprob)
        return most

    return {"tokens": [text.string(e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [top(e) for e in entries], "text_offset": [e.offset for e in entries]}


def chat_logprobs(entries: list[Entry], text: TokenText) -> dict:
    """Chat's shape: `content`, one object per token, each with its `top_logprobs` most likely tokens."""
    def one(token: int, logprob: float) -> dict:
        return {"token": text.string(token), "logprob": logprob, "bytes": list(text.bytes(token))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}
