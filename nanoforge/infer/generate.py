"""Generation for callers with a list of prompts or one prompt to stream: thin wrappers over the engine
(infer/engine/), which does all decoding.

`generate` returns token ids, `complete` also the text cut at the first stop string and why each reply ended,
`stream`/`stream_completion` yield one prompt's text as it is decoded. Multi-turn conversations with tools are
infer/turns.py's. Sampling follows HF transformers' logits processors' order (engine/sampler.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from nanoforge.core.device import eval_mode
from nanoforge.infer.options import SamplingConfig
from nanoforge.infer.engine import Engine, Request
from nanoforge.infer.engine.sampler import seed_for
from nanoforge.infer.engine.text import cut_at_stop

__all__ = ["Completion", "SamplingConfig", "complete", "cut_at_stop", "generate", "stream",
           "stream_completion"]
MAX_BATCH = 64  # sequences decoded together by one call; more wait for a free slot


# -------------------------------------------------------------------------------------- public entry points

@dataclass
class Completion:
    """One prompt's reply: the text (cut before a stop string), the new token ids, and why it ended:
    "stop" (a stop id or stop string) or "length" (max_new_tokens or the end of the model's context).
    stop_id: the stop token that ended it (not in token_ids), None when none did; RL trains on it too.
    logprobs: each sampled token's log-prob (the stop token's last)."""
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_id: int | None = None
    logprobs: list[float] = field(default_factory=list)


def generate(model, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, stop_ids: Sequence[int] | None = None,
             tokenizer=None, precision: str = "fp32") -> list[list[int]]:
    """The new tokens for each prompt (token id lists of any lengths), prompts not included.

    A row stops at the first token in `stop_ids` (not returned) or after cfg.max_new_tokens tokens. With
    cfg.stop_strings (which need `tokenizer`) a row also stops at the token whose text completes a stop
    string; that token is returned, since a stop string can end inside a token; `complete` gives the cut text."""
    return [c.token_ids for c in complete(model, tokenizer, prompts, cfg, stop_ids, precision)]


def complete(model, tokenizer, prompts: Sequence[Sequence[int]], cfg: SamplingConfig,
             stop_ids: Sequence[int] | None = None, precision: str = "fp32",
             seeds: Sequence[int | None] | None = None) -> list[Completion]:
    """`generate`, plus each reply's text cut before the first stop string and why it ended. Identical prompts
    share one prefill. `seeds`: one per prompt (default: cfg.seed mixed with the prompt's index, cfg.seed itself
    for the first)."""
    if len(prompts) == 0:
        return []
    cfg.validate()
    groups: dict[tuple, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    requests, rows_of, stops = [], [], tuple(stop_ids or ())
    for key, rows in groups.items():
        row_seeds = [seeds[i] if seeds is not None else seed_for(cfg.seed, i) for i in rows]
        for at in range(0, len(rows), MAX_BATCH):
            requests.append(Request(list(key), cfg, stops, n=len(rows[at:at + MAX_BATCH]),
                                    seeds=row_seeds[at:at + MAX_BATCH]))
            rows_of += rows[at:at + MAX_BATCH]
    engine = Engine(model, tokenizer, precision, max_batch=min(MAX_BATCH, len(prompts)))
    with eval_mode(model):
        done = [seq for group in engine.run(requests) for seq in group]
    out: list[Completion] = [None] * len(prompts)  # type: ignore[list-item]
    for row, seq in zip(rows_of, done):
        out[row] = _completion(seq)
    return out


def _completion(seq) -> Completion:
    return Completion(seq.text, list(seq.new_ids), seq.finish_reason, seq.stop_id, list(seq.logprobs))


def stream(model, tokenizer, prompt_ids: Sequence[int], cfg: SamplingConfig,
           stop_ids: Sequence[int] | None = None, precision: str = "fp32") -> Iterator[str]:
    """Yield one prompt's reply as text pieces as soon as they are safe to show.

    Joined, the pieces equal `complete(...)[0].text` for the same arguments. A piece is held back while the
    text ends in an incomplete UTF-8 character (a byte-level token can carry part of one, e.g. a third of a
    Chinese character, which decodes to U+FFFD) or in something that could be the start of a stop string."""
    pieces = stream_completion(model, tokenizer, prompt_ids, cfg, stop_ids, precision)
    yield from (piece for piece in pieces if isinstance(piece, str))


def stream_completion(model, tokenizer, prompt_ids: Sequence[int], cfg: SamplingConfig,
                      stop_ids: Sequence[int] | None = None, precision: str = "fp32",
                      keep_going: Callable[[], bool] | None = None) -> Iterator[str | Completion]:
    """`stream`'s pieces, then one `Completion` (the whole text, the new token ids, the finish reason).

    `keep_going()` is asked after each token: False ends the reply there with finish reason "length" (a
    deadline); it may also raise to abandon the reply. Each step runs in its own eval/inference block, never
    across a `yield`: a caller doing other work between pieces (a training loop taking samples) must not
    find them still on."""
    engine = Engine(model, tokenizer, precision, max_batch=1)
    (seq,) = engine.submit(Request(list(prompt_ids), cfg, tuple(stop_ids or ())))
    while not seq.done:
        with eval_mode(model):
            engine.step()
        piece = seq.reply.take(final=seq.done)
        if piece:
            yield piece
        if not seq.done and keep_going is not None and not keep_going():
            engine.cancel(seq, "length")
            seq.reply.finish()
            if piece := seq.reply.take(final=True):
                yield piece
    yield _completion(seq)
