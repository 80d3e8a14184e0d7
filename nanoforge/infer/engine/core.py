"""The generation engine: many sequences decoded together with continuous batching.

Each sequence holds a slot of the KV cache (model/slots.py) while it runs. Every `step` is one forward: one new
token for each decoding sequence, plus up to `prefill_chunk` tokens of prompts still being read, so a long
prompt is read over several steps while the others keep decoding. A sequence that ends (a stop token, a stop
string, its token limit, the model's context, or `cancel`) frees its slot at once, and a waiting one takes it at
the next step. The n samples of one request share their prompt: it is read once, its keys and values copied
to each sample's slot.

A sequence can be given more tokens after it ends (`extend`: a tool's result, the next user turn) and go on
generating from there: only the new tokens are read. Occupied slots are kept packed at the front of the
cache ([0, occupied)), so the decoding rows are one view of it, never a copy."""
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence as Seq

import torch

from nanoforge.core.config import PRECISIONS
from nanoforge.core.device import autocast_context
from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.options import SamplingConfig, is_int
from nanoforge.infer.engine.sampler import RowSampling, row_sampling, sample_rows, seed_for
from nanoforge.infer.engine.text import ReplyText
from nanoforge.model.slots import SlotCache, SlotStep


@dataclass
class Request:
    """What to generate: `n` continuations of `prompt` (token ids). Each sample stops at a token of `stop_ids`
    (kept apart, as `stop_id`), a stop string of `sampling` (needs the engine's tokenizer), its max_new_tokens or
    the end of the model's context. `seeds`: one per sample (default: from sampling.seed; None draws from torch's
    global RNG). `top_logprobs`: that many most likely tokens reported with each sampled one."""
    prompt: list[int]
    sampling: SamplingConfig
    stop_ids: Seq[int] = ()
    n: int = 1
    seeds: Seq[int | None] | None = None
    logit_bias: dict[int, float] | None = None
    top_logprobs: int = 0
    prompt_logprobs: bool = False  # also score the prompt: the log-prob of each prompt token after the first
    keep_slot: bool = False  # an ended sample keeps its slot (and cache) for `extend` until `release`


@dataclass(eq=False)
class Sequence:
    """One sample in the engine. `tokens` is everything fed or to be fed (prompt, sampled tokens, tokens added by
    `extend`); `sampled` marks which of them the model chose. `new_ids`/`logprobs` are this turn's sampled tokens
    and their log-probs (a stop token's log-prob included, the token itself in `stop_id`); `text` its text."""
    request: Request
    index: int
    tokens: list[int]
    sampling: RowSampling
    reply: ReplyText | None
    sampled: list[bool] = field(default_factory=list)
    new_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_id: int | None = None
    slot: int | None = None
    fed: int = 0
    follows: "Sequence | None" = None  # the sample whose prompt read this one waits for

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.reply.text if self.reply is not None else ""


class Engine:
    """Continuous batching over one model (see the module docstring). Not thread-safe: one thread steps it."""

    def __init__(self, model, tokenizer=None, precision: str = "fp32", max_batch: int = 32,
                 prefill_chunk: int = 512):
        if precision not in PRECISIONS:
            raise NanoforgeError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
        if not is_int(max_batch) or max_batch < 1 or not is_int(prefill_chunk) or prefill_chunk < 1:
            raise NanoforgeError(f"max_batch={max_batch!r} and prefill_chunk={prefill_chunk!r} must be integers >= 1")
        self.model, self.tokenizer, self.precision = model, tokenizer, precision
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        weight = model.model.embed_tokens.weight
        self.device, self.context, self.vocab = weight.device, model.context_length, model.cfg.vocab_size
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, weight.dtype)
        cfg = model.cfg
        self.cache = SlotCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_batch, self.context, self.device, dtype)
        self.waiting: deque[list[Sequence]] = deque()
        self.slots: list[Sequence] = []  # slot i holds self.slots[i]
        self.steps = 0

    # ------------------------------------------------------------------------------------------ the public API

    def submit(self, request: Request) -> list[Sequence]:
        """Queue a request; its n sequences, which fill in as `step` runs."""
        self._check(request)
        seeds = request.seeds if request.seeds is not None else \
            [seed_for(request.sampling.seed, i) for i in range(request.n)]
        group = [self._sequence(request, i, seed) for i, seed in enumerate(seeds)]
        for follower in group[1:]:
            follower.follows = group[0]
        self.waiting.append(group)
        return group

    def extend(self, seq: Sequence, tokens: Seq[int], sampling: SamplingConfig | None = None) -> None:
        """Append `tokens` (not sampled: a tool's result, a template's tokens) to an ended sequence and let it
        generate again; its slot and everything already read are kept when it still has them."""
        if not seq.done:
            raise NanoforgeError("extend() takes a sequence that has ended")
        self._check_ids(tokens, "the added tokens")
        seq.tokens += [seq.stop_id] if seq.stop_id is not None else []
        seq.sampled += [True] if seq.stop_id is not None else []
        seq.tokens += list(tokens)
        seq.sampled += [False] * len(tokens)
        if len(seq.tokens) >= self.context:
            raise NanoforgeError(f"the sequence is {len(seq.tokens)} tokens; the model sees at most {self.context}")
        if sampling is not None:
            seq.sampling.cfg = sampling
        if seq.sampling.seen is not None:
            seq.sampling.seen[torch.tensor(seq.tokens, device=self.device)] = True
        seq.new_ids, seq.logprobs, seq.top_logprobs = [], [], []
        seq.finish_reason, seq.stop_id = None, None
        seq.reply = ReplyText(self.tokenizer, seq.sampling.cfg.stop_strings) if self.tokenizer is not None else None
        if seq.slot is None:
            seq.fed = 0
            self.waiting.append([seq])

    def release(self, seq: Sequence) -> None:
        """Free an ended sequence's slot (a sequence keeps it after it ends, for `extend`, until released)."""
        if seq.slot is not None:
            self._free(seq)

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End a sequence now (waiting or running) and free its slot."""
        if not seq.done:
            seq.finish_reason = reason
        followers = [s for s in self.slots if s.follows is seq]
        for follower in followers:  # the first one reads the prompt instead
            follower.follows = followers[0] if follower is not followers[0] else None
        for group in self.waiting:
            if seq in group:
                group.remove(seq)
        self.waiting = deque(g for g in self.waiting if g)
        self.release(seq)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(not s.done for s in self.slots)

    def run(self, requests: Iterable[Request]) -> list[list[Sequence]]:
        """Submit every request and step until all have ended; their sequences, in order, slots released."""
        groups = [self.submit(r) for r in requests]
        while self.busy:
            steps = self.steps
            self.step()
            if self.steps == steps:
                raise NanoforgeError("the engine cannot go on: every slot is held by an ended sequence kept for "
                                     "extend(); release() them")
        for seq in (s for g in groups for s in g):
            self.release(seq)
        return groups

    # ------------------------------------------------------------------------------------------- the steps

    def step(self) -> list[Sequence]:
        """One forward over the running sequences; those that got a token or ended in it."""
        self._admit()
        decode, prefill = self._plan()
        if not decode and not prefill:
            return []
        ids, keep, tags = self._inputs(decode, prefill)
        plan = SlotStep(self.cache, [s.slot for s in decode], [(s.slot, n) for s, n in prefill],
                        owners=decode + [s for s, _ in prefill])
        with torch.inference_mode(), autocast_context(self.device, self.precision):
            tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
            logits = self.model(tokens, cache=plan, keep=torch.tensor(keep, device=self.device)).float()  # (R, V)
        self.steps += 1
        for seq in decode:
            seq.fed += 1
        for seq, n in prefill:
            seq.fed += n
        scored = [i for i, (_, p) in enumerate(tags) if p is not None]
        if scored:
            self._score_prompts(logits[scored], [tags[i] for i in scored])
            logits = logits[[i for i, (_, p) in enumerate(tags) if p is None]]
        rows, row_logits = self._with_followers([seq for seq, p in tags if p is None], logits)
        draw = sample_rows(row_logits, [s.sampling for s in rows])
        for i, seq in enumerate(rows):
            self._take(seq, draw.tokens[i], draw.logprobs[i], draw.top[i])
        for seq in rows:
            if seq.done and not seq.request.keep_slot:
                self._free(seq)
        return rows

    @staticmethod
    def _inputs(decode: list[Sequence], prefill: list[tuple[Sequence, int]]) -> tuple[list, list, list]:
        """The step's token ids (decode tokens, then each prefill chunk), which positions get logits (`keep`), and
        per kept row its tag: (sequence, None) to sample its next token, (sequence, p) to score prompt token p + 1."""
        ids, keep, tags = [], [], []
        for seq in decode:
            ids.append(seq.tokens[seq.fed])
            keep.append(True)
            tags.append((seq, None))
        for seq, n in prefill:
            ids += seq.tokens[seq.fed:seq.fed + n]
            scored_end = len(seq.request.prompt) - 1 if seq.request.prompt_logprobs else 0
            for p in range(seq.fed, seq.fed + n):
                last = p == len(seq.tokens) - 1
                keep.append(last or p < scored_end)
                if last or p < scored_end:
                    tags.append((seq, None if last else p))
        return ids, keep, tags

    @staticmethod
    def _score_prompts(logits: torch.Tensor, tags: list[tuple[Sequence, int]]) -> None:
        """Record, for each scored prompt position p, the log-prob of prompt token p + 1 under the model's own
        distribution (T = 1) and the request's top_logprobs most likely tokens there."""
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor([seq.tokens[p + 1] for seq, p in tags], device=logits.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        most = max(seq.request.top_logprobs for seq, _ in tags)
        top = logprobs.topk(most, dim=-1) if most else None
        for i, (seq, _) in enumerate(tags):
            k = seq.request.top_logprobs
            pairs = list(zip(top.indices[i, :k].tolist(), top.values[i, :k].tolist())) if k else []
            seq.prompt_logprobs.append((chosen[i], pairs))

    def _admit(self) -> None:
        """Give waiting groups slots, first come first served, while they fit."""
        while self.waiting and len(self.slots) + len(self.waiting[0]) <= self.max_batch:
            group = self.waiting.popleft()
            self.cache.reserve(len(self.slots) + len(group), 1)
            for seq in group:
                seq.slot = len(self.slots)
                self.cache.lengths[seq.slot] = 0
                self.slots.append(seq)

    def _plan(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """The decoding sequences (one token each to feed) and the prefill chunks (sequence, tokens) of a step."""
        decode, prefill, budget = [], [], self.prefill_chunk
        for seq in self.slots:
            if seq.done or seq.follows is not None:
                continue
            todo = len(seq.tokens) - seq.fed
            if todo == 1:
                decode.append(seq)
            elif todo > 1 and budget > 0:
                n = min(todo, budget)
                prefill.append((seq, n))
                budget -= n
        return decode, prefill

    def _with_followers(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """The samples waiting on a prompt read this step join it: its cache copied to their slots, its logits
        row repeated for them."""
        followers = {id(s): [f for f in self.slots if f.follows is s] for s in seqs}
        if not any(followers.values()):
            return seqs, logits
        rows, index = [], []
        for i, seq in enumerate(seqs):
            for seq_ in [seq] + followers[id(seq)]:
                if seq_ is not seq:
                    self.cache.copy(seq.slot, seq_.slot)
                    seq_.fed, seq_.follows = seq.fed, None
                    seq_.prompt_logprobs = list(seq.prompt_logprobs)
                rows.append(seq_)
                index.append(i)
        return rows, logits[torch.tensor(index, device=logits.device)]

    def _take(self, seq: Sequence, token: int, logprob: float, top: list) -> None:
        """Record a sampled token and decide whether the sequence ends with it."""
        seq.logprobs.append(logprob)
        if seq.request.top_logprobs:
            seq.top_logprobs.append(top)
        if token in seq.request.stop_ids:
            seq.finish_reason, seq.stop_id = "stop", token
            return
        seq.tokens.append(token)
        seq.sampled.append(True)
        seq.new_ids.append(token)
        if seq.sampling.seen is not None:
            seq.sampling.seen[token] = True
        if seq.reply is not None and seq.reply.add(token):
            seq.finish_reason = "stop"
        elif len(seq.new_ids) >= seq.sampling.cfg.max_new_tokens or len(seq.tokens) >= self.context:
            seq.finish_reason = "length"
        if seq.done and seq.reply is not None:
            seq.reply.finish()

    def _free(self, seq: Sequence) -> None:
        """Give back the sequence's slot, moving the last occupied slot into it (slots stay packed)."""
        slot, last = seq.slot, len(self.slots) - 1
        if slot != last:
            moved = self.slots[last]
            self.cache.copy(last, slot)
            moved.slot, self.slots[slot] = slot, moved
        self.slots.pop()
        self.cache.lengths[last] = 0
        seq.slot = None

    # ------------------------------------------------------------------------------------------- the checks

    def _sequence(self, request: Request, index: int, seed: int | None) -> Sequence:
        sampling = row_sampling(request.sampling, seed, request.prompt, self.vocab, self.device,
                                request.logit_bias, request.top_logprobs)
        reply = ReplyText(self.tokenizer, request.sampling.stop_strings) if self.tokenizer is not None else None
        tokens = list(request.prompt)
        return Sequence(request, index, tokens, sampling, reply, sampled=[False] * len(tokens))

    def _check(self, request: Request) -> None:
        request.sampling.validate()
        if request.sampling.stop_strings and self.tokenizer is None:
            raise NanoforgeError("stop_strings need the tokenizer to read the generated text: pass tokenizer=")
        if not is_int(request.n) or not 1 <= request.n <= self.max_batch:
            raise NanoforgeError(f"n={request.n!r} must be an integer from 1 to the engine's {self.max_batch} slots")
        if request.seeds is not None and len(request.seeds) != request.n:
            raise NanoforgeError(f"{len(request.seeds)} seeds for n={request.n} samples")
        if len(request.prompt) == 0:
            raise NanoforgeError("the prompt is empty; a model needs at least one token to continue from "
                                 "(e.g. the tokenizer's eos_id, or a rendered chat prompt)")
        self._check_ids(request.prompt, "the prompt")
        if request.logit_bias:
            self._check_ids(list(request.logit_bias), "logit_bias")
        if len(request.prompt) >= self.context:
            raise NanoforgeError(f"the prompt is {len(request.prompt)} tokens but the model sees at most "
                                 f"{self.context}, which leaves no room to generate; shorten the prompt to under "
                                 f"{self.context} tokens")

    def _check_ids(self, ids: Seq[int], what: str) -> None:
        bad = [t for t in ids if not is_int(t) or not 0 <= t < self.vocab]
        if bad:
            raise NanoforgeError(f"{what} has token ids outside the model's vocabulary of {self.vocab}: {bad[:5]}; "
                                 f"was it encoded with this model's tokenizer?")
