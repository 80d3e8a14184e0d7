"""Text generation: sampling with a KV cache, batches of prompts of different lengths, stop tokens and stop
strings, and streaming that never shows half a character or a piece of a stop string.

One decoding loop (`_token_steps`) serves everything: `generate` runs it for a batch and returns token ids,
`complete` also returns the text cut at the first stop string, and `stream` yields one prompt's text as it is
decoded (`sample_with_logprobs`, for RL, steps the same decoding state and also returns each sampled token's
log-prob). Sampling follows HF transformers' logits processors' order: repetition penalty on the raw logits,
then temperature, top-k, top-p, and a draw from what is left.

Prompts of different lengths are left-padded into one batch so that every row's next token sits in the last
column; the model's `attention_mask` hides the padding and keeps each row's RoPE positions those of the prompt
alone, so a prompt gives the same tokens in a batch as on its own."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from nanoforge.core.config import PRECISIONS
from nanoforge.core.device import autocast_context
from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.defaults import SamplingConfig, is_int


# -------------------------------------------------------------------------------------- public entry points

@dataclass
class Completion:
    """One prompt's reply: the text (cut before a stop string), the new token ids, and why it ended:
    "stop" (a stop id or stop string) or "length" (max_new_tokens or the end of the model's context).
    stop_id: the stop token that ended it (not in token_ids), None when none did; RL trains on it too."""
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_id: int | None = None


def generate(model, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, stop_ids: Sequence[int] | None = None,
             use_cache: bool = True, tokenizer=None, precision: str = "fp32") -> list[list[int]]:
    """The new tokens for each prompt (token id lists of any lengths), prompts not included.

    A row stops at the first token in `stop_ids` (not returned) or after cfg.max_new_tokens tokens. With
    cfg.stop_strings (which need `tokenizer`) a row also stops at the token whose text completes a stop
    string; that token is returned, since a stop string can end inside a token; `complete` gives the cut text.
    `use_cache=False` recomputes the whole sequence every step: slow, for checking the cache against."""
    return [ids for ids, _, _ in _generate_rows(model, prompts, cfg, stop_ids, use_cache, tokenizer, precision)]


def complete(model, tokenizer, prompts: Sequence[Sequence[int]], cfg: SamplingConfig,
             stop_ids: Sequence[int] | None = None, precision: str = "fp32") -> list[Completion]:
    """`generate`, plus each reply's text cut before the first stop string and why it ended."""
    return [Completion(cut_at_stop(tokenizer.decode(ids), cfg.stop_strings), ids, reason, stop)
            for ids, reason, stop in _generate_rows(model, prompts, cfg, stop_ids, True, tokenizer, precision)]


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
    """`stream`'s pieces, then one `Completion` (the whole text, the new token ids, the finish reason), which
    a server needs for `usage` and `finish_reason`.

    `keep_going()` is asked after each token: False ends the reply there with finish reason "length" (a
    request deadline); it may also raise to abandon the reply (a client that went away).
    The text is re-decoded from all new tokens each step (as HF's TextStreamer does), because only whole byte
    sequences decode correctly; replies are short enough for that to be cheap."""
    stop_set = set(stop_ids or ())
    emitted, ids, reason = "", [], "length"
    for (token,) in _token_steps(model, [prompt_ids], cfg, True, precision):
        if token in stop_set:
            reason = "stop"
            break
        ids.append(token)
        text = tokenizer.decode(ids)
        cut = _stop_index(text, cfg.stop_strings)
        if cut is not None:
            if cut > len(emitted) and text.startswith(emitted):
                yield text[len(emitted):cut]
            yield Completion(text[:cut], ids, "stop")
            return
        safe = _safe_prefix_length(text, cfg.stop_strings)
        # Only ever extend what was shown: a decoder that rewrote earlier text would otherwise duplicate it.
        if safe > len(emitted) and text.startswith(emitted):
            yield text[len(emitted):safe]
            emitted = text[:safe]
        if keep_going is not None and not keep_going():
            break
    text = tokenizer.decode(ids)
    if len(text) > len(emitted) and text.startswith(emitted):
        yield text[len(emitted):]  # the held-back tail: it was not a stop string after all
    yield Completion(text, ids, reason)


def sample_with_logprobs(model, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, stop_ids: Sequence[int],
                         generator: torch.Generator | None = None,
                         precision: str = "fp32") -> list[tuple[list[int], list[float], bool]]:
    """One reply per prompt, all generated together, for RL: (sampled ids, each one's log-prob, stopped?) per
    row. A row that stopped ends with its stop token (kept: RL trains on it); one that did not was cut at
    max_new_tokens or the end of the context. The log-prob is log_softmax(logits / T) of the sampled token
    (T = 1 for greedy rows), the unfiltered tempered distribution; `generator` draws every token (None: the
    decoding state's own, seeded from cfg.seed, else the global RNG)."""
    cfg.validate()
    if cfg.repetition_penalty != 1.0:
        raise NanoforgeError("sample_with_logprobs samples from the model's own distribution: "
                             "repetition_penalty must be 1")
    if precision not in PRECISIONS:
        raise NanoforgeError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    if len(prompts) == 0:
        return []
    device = next(model.parameters()).device
    temperature = cfg.temperature or 1.0
    stops = set(stop_ids)
    with _step_context(model, device, precision):
        state = _DecodeState(model, prompts, cfg, True, device, precision)
    generator = generator if generator is not None else state.generator
    tokens_of: list[list[int]] = [[] for _ in prompts]
    logprobs_of: list[list[float]] = [[] for _ in prompts]
    stopped = [False] * len(prompts)
    for _ in range(state.n_new):
        with _step_context(model, device, precision):
            logits = state._next_logits()  # (B, V) float32
            tokens = sample_next(logits, cfg, generator)  # (B,)
            chosen = torch.log_softmax(logits / temperature, dim=-1).gather(1, tokens[:, None])[:, 0]  # (B,)
            state.pending = tokens[:, None]
        for i, (token, logprob) in enumerate(zip(tokens.tolist(), chosen.tolist())):
            if not stopped[i]:  # a stopped row is still computed with the batch; its tokens are ignored
                tokens_of[i].append(token)
                logprobs_of[i].append(logprob)
                stopped[i] = token in stops
        if all(stopped):
            break
    return list(zip(tokens_of, logprobs_of, stopped))


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string."""
    cut = _stop_index(text, stop_strings)
    return text if cut is None else text[:cut]


# ------------------------------------------------------------------------------------------------- stopping

def _stop_index(text: str, stop_strings: Sequence[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(found) if found else None


def _safe_prefix_length(text: str, stop_strings: Sequence[str]) -> int:
    """How much of `text` can be shown now: not a trailing U+FFFD (an unfinished character), and not a
    suffix that a stop string starts with (the next token may complete it)."""
    end = len(text.rstrip("\ufffd"))
    hold = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, end), hold, -1):  # longest first; shorter than hold can't matter
            if text.endswith(s[:n], 0, end):
                hold = n
                break
    return end - hold


def _generate_rows(model, prompts, cfg, stop_ids, use_cache, tokenizer,
                   precision) -> list[tuple[list[int], str, int | None]]:
    """Run the decoding loop for a batch until every row has stopped; (new ids, finish reason, the stop id
    that ended it or None) per row."""
    if cfg.stop_strings and tokenizer is None:
        raise NanoforgeError("stop_strings need the tokenizer to read the generated text: pass tokenizer=")
    if len(prompts) == 0:
        return []
    stop_set = set(stop_ids or ())
    rows: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)
    stopped_by: list[int | None] = [None] * len(prompts)
    for tokens in _token_steps(model, prompts, cfg, use_cache, precision):
        for i, token in enumerate(tokens):
            if reasons[i] is not None:
                continue  # a finished row keeps being computed with the batch; its tokens are ignored
            if token in stop_set:
                reasons[i], stopped_by[i] = "stop", token
                continue
            rows[i].append(token)
            if cfg.stop_strings and _stop_index(tokenizer.decode(rows[i]), cfg.stop_strings) is not None:
                reasons[i] = "stop"
        if all(r is not None for r in reasons):
            break
    return [(ids, reason or "length", stop) for ids, reason, stop in zip(rows, reasons, stopped_by)]


# ---------------------------------------------------------------------------------------- the decoding loop

def _token_steps(model, prompts, cfg: SamplingConfig, use_cache: bool, precision: str) -> Iterator[list[int]]:
    """Yield the next token of every row, step after step, until max_new_tokens or the context is full.

    The work of each step runs inside its own inference_mode/autocast/eval block, never across a `yield`:
    those are thread-wide switches, and a caller doing other work between pieces of a stream (a server, a
    training loop taking samples) must not find them still on."""
    cfg.validate()
    if precision not in PRECISIONS:
        raise NanoforgeError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    device = next(model.parameters()).device
    with _step_context(model, device, precision):
        state = _DecodeState(model, prompts, cfg, use_cache, device, precision)
    for _ in range(state.n_new):
        with _step_context(model, device, precision):
            tokens = state.step()
        yield tokens


@contextlib.contextmanager
def _step_context(model, device: torch.device, precision: str):
    """No autograd, the chosen autocast, and the model in eval mode (no dropout), restored afterwards."""
    # Switching mode walks every module (about 1 ms for the mini model, a tenth of a decode step on a CPU),
    # so only a model found in training mode pays for it.
    was_training = model.training
    if was_training:
        model.eval()
    try:
        with torch.inference_mode(), autocast_context(device, precision):
            yield
    finally:
        if was_training:
            model.train()


class _DecodeState:
    """Everything one decoding run carries from step to step: the tokens so far, the padding mask, the cache,
    the tokens already seen (for the repetition penalty), the RNG and the last sampled tokens."""

    def __init__(self, model, prompts, cfg: SamplingConfig, use_cache: bool, device: torch.device,
                 precision: str = "fp32"):
        self.model, self.cfg, self.device = model, cfg, device
        lengths = _check_prompts(model, prompts)
        longest = max(lengths)
        limit = model.model.rotary_emb.n_positions
        if longest >= limit:
            raise NanoforgeError(f"the prompt is {longest} tokens but the model sees at most {limit}, which leaves "
                                 f"no room to generate; shorten the prompt to under {limit} tokens")
        # Every fed token takes a position; the last sampled one is never fed, so prompt + new <= limit.
        self.n_new = min(cfg.max_new_tokens, limit - longest)
        self.ids = torch.tensor([[0] * (longest - n) + list(p) for p, n in zip(prompts, lengths)],
                                dtype=torch.long, device=device)  # (B, P), left-padded
        # Without padding the model takes its fused causal path; with it, a mask hides the pad columns.
        self.mask = None if min(lengths) == longest else \
            torch.tensor([[0] * (longest - n) + [1] * n for n in lengths], dtype=torch.long, device=device)
        # The cache in the dtype attention computes in: a float32 cache under bf16 autocast is converted back to
        # bf16 in every layer at every step (the whole cache, 4x the memory traffic of decoding)
        cache_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision) if device.type == "cuda" else None
        self.cache = model.new_cache(len(prompts), max_len=longest + self.n_new, dtype=cache_dtype) \
            if use_cache else None
        self.seen = None
        if cfg.repetition_penalty != 1.0:
            real = self.ids if self.mask is None else torch.where(self.mask.bool(), self.ids, -1)
            self.seen = _token_presence(real, model.cfg.vocab_size)  # (B, V) bool
        self.generator = None if cfg.seed is None else torch.Generator(device=device).manual_seed(cfg.seed)
        self.pending: torch.Tensor | None = None  # (B, 1): sampled last step, not yet fed to the model

    def step(self) -> list[int]:
        logits = self._next_logits()  # (B, V) float32
        if self.seen is not None:
            logits = apply_repetition_penalty(logits, self.seen, self.cfg.repetition_penalty)
        tokens = sample_next(logits, self.cfg, self.generator)  # (B,)
        if self.seen is not None:
            self.seen[torch.arange(len(tokens), device=self.device), tokens] = True
        self.pending = tokens[:, None]
        return tokens.tolist()

    def _next_logits(self) -> torch.Tensor:
        """Logits for the token after everything so far. The first call reads the prompt (prefill); later
        calls feed the token sampled last (one position with the cache, the whole sequence without)."""
        if self.pending is None:
            new = self.ids
        else:
            self.ids = torch.cat([self.ids, self.pending], dim=1)
            if self.mask is not None:
                self.mask = torch.cat([self.mask, torch.ones_like(self.pending)], dim=1)
            new = self.pending if self.cache is not None else self.ids
        return self.model(new, cache=self.cache, attention_mask=self.mask)[:, -1, :].float()  # (B, T, V) -> (B, V)


def _check_prompts(model, prompts) -> list[int]:
    """The length of each prompt, after checking it holds token ids the model has embeddings for."""
    vocab = model.cfg.vocab_size
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise NanoforgeError(f"prompt {i} is empty; a model needs at least one token to continue from "
                                 f"(e.g. the tokenizer's eos_id, or a rendered chat prompt)")
        bad = [t for t in prompt if not is_int(t) or not 0 <= t < vocab]
        if bad:
            raise NanoforgeError(f"prompt {i} has token ids outside the model's vocabulary of {vocab}: "
                                 f"{bad[:5]}; was it encoded with this model's tokenizer?")
    return [len(prompt) for prompt in prompts]


# ------------------------------------------------------------------------------------------------- sampling

def _token_presence(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, T) ids, -1 for padding -> (B, V) bool, True where the row contains that token."""
    seen = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    seen.scatter_(1, torch.where(ids < 0, vocab, ids), True)  # padding lands in a spare last column
    return seen[:, :vocab].clone()


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty on the tokens marked in `seen` (B, V): positive logits / penalty, negative * penalty."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) float logits -> (B,) next token ids, by temperature, top-k and top-p."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / cfg.temperature
    if cfg.top_k > 0:
        logits = _keep_top_k(logits, cfg.top_k)
    if cfg.top_p < 1.0:
        logits = _keep_top_p(logits, cfg.top_p)
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1, generator=generator)[:, 0]


def _keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    # Exactly k tokens survive even when logits tie at the k-th value (a threshold would keep every tie).
    values, indices = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, indices, values)


def _keep_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the most likely tokens until their probability reaches p (always at least the top one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
