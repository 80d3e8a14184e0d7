"""Choosing the next token of many sequences at once, each with its own settings.

The order is HF transformers' logits processors': logit bias and the repetition penalty on the raw logits, then
temperature, top-k, top-p, and a draw from what is left. Every row draws by inverse transform sampling from one
uniform number of its own, taken from the row's private generator when it has a seed: a seeded sequence gets
the same tokens whatever else is in the batch. The log-prob of a chosen token is log_softmax(logits / T) (T = 1
for greedy rows): the tempered distribution before top-k/top-p, the one RL trains and OpenAI's `logprobs` report."""
from dataclasses import dataclass

import torch

from nanoforge.infer.options import SamplingConfig


@dataclass
class RowSampling:
    """One sequence's sampling state: its settings, its generator (None: the global RNG), the tokens it has seen
    (for the repetition penalty, (V,) bool, None when the penalty is off) and its logit bias {token: value}."""
    cfg: SamplingConfig
    generator: torch.Generator | None = None
    seen: torch.Tensor | None = None
    bias: dict[int, float] | None = None
    top_logprobs: int = 0


@dataclass
class Draw:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per row, its top_logprobs (token, log-prob), most likely first


def sample_rows(logits: torch.Tensor, rows: list[RowSampling]) -> Draw:
    """logits (R, V) float32, one row per entry of `rows` -> the chosen token of each, with log-probs."""
    logits = _adjust(logits, rows)
    temps = torch.tensor([r.cfg.temperature or 1.0 for r in rows], device=logits.device)
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    sampled = [i for i, r in enumerate(rows) if r.cfg.temperature > 0]
    chosen = logits.argmax(dim=-1)
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        chosen[index] = _draw(scaled[index], [rows[i] for i in sampled])
    picked = logprobs.gather(1, chosen[:, None])[:, 0]
    return Draw(chosen.tolist(), picked.tolist(), _top(logprobs, rows))


def _adjust(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Logit bias and the repetition penalty (CTRL's, arXiv 1909.05858, as HF applies it: a positive logit of a
    token seen in prompt or reply divided by the penalty, a negative one multiplied)."""
    if not any(r.bias or r.seen is not None for r in rows):
        return logits
    logits = logits.clone()
    for i, r in enumerate(rows):
        if r.bias:
            ids = torch.tensor(list(r.bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(r.bias.values()), device=logits.device, dtype=logits.dtype)
        if r.seen is not None:
            logits[i] = apply_repetition_penalty(logits[i], r.seen, r.cfg.repetition_penalty)
    return logits


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty on the tokens marked in `seen` (same shape as logits, bool)."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def _draw(scaled: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """One token per row of tempered logits, by inverse transform sampling: over the whole vocabulary in its
    order for rows without top-k/top-p, over the kept tokens most likely first for the others. Which way a row
    goes depends on its own settings only, so its tokens do not depend on the company it is drawn in."""
    uniform = _uniforms(rows, scaled.device)
    filtered = [i for i, r in enumerate(rows) if r.cfg.top_k > 0 or r.cfg.top_p < 1.0]
    plain = [i for i in range(len(rows)) if i not in set(filtered)]
    chosen = torch.empty(len(rows), dtype=torch.long, device=scaled.device)
    if plain:
        index = torch.tensor(plain, device=scaled.device)
        chosen[index] = _inverse_cdf(torch.softmax(scaled[index], dim=-1), uniform[index])
    if filtered:
        index = torch.tensor(filtered, device=scaled.device)
        chosen[index] = _filtered(scaled[index], [rows[i] for i in filtered], uniform[index])
    return chosen


def _filtered(scaled: torch.Tensor, rows: list[RowSampling], uniform: torch.Tensor) -> torch.Tensor:
    """Top-k (exactly k survive, ties or not), then top-p (the most likely tokens until their probability reaches
    p, the top one always), then a draw among the survivors, most likely first."""
    vocab = scaled.shape[-1]
    top_k = [r.cfg.top_k if r.cfg.top_k > 0 else vocab for r in rows]
    values, order = scaled.topk(min(max(top_k), vocab), dim=-1)  # sorted; only the top max(k) can survive
    ranks = torch.arange(values.shape[-1], device=scaled.device)[None, :]
    values = values.masked_fill(ranks >= torch.tensor(top_k, device=scaled.device)[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)
    p = torch.tensor([r.cfg.top_p for r in rows], device=scaled.device, dtype=probs.dtype)
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= p[:, None], 0.0)
    return order.gather(1, _inverse_cdf(probs, uniform)[:, None])[:, 0]


def _uniforms(rows: list[RowSampling], device: torch.device) -> torch.Tensor:
    """A uniform number in [0, 1) per row: a seeded row's from its generator, the others' from the global RNG."""
    free = [i for i, r in enumerate(rows) if r.generator is None]
    u = torch.empty(len(rows), dtype=torch.float64)
    if free:
        u[free] = torch.rand(len(free), dtype=torch.float64)
    for i, r in enumerate(rows):
        if r.generator is not None:
            u[i] = torch.rand(1, generator=r.generator, dtype=torch.float64)[0]
    return u.to(device)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """(R, V) unnormalised probabilities, (R,) uniforms -> (R,) indices: the first whose cumulative mass passes
    u * total. Never a zero-probability index."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniform * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)
    # u * total can equal the total through rounding: step back to the last token with mass
    stuck = probs.gather(1, index[:, None])[:, 0] <= 0
    if bool(stuck.any()):
        last = (probs > 0).long().cumsum(-1).argmax(dim=-1)
        index = torch.where(stuck, last, index)
    return index


def _top(logprobs: torch.Tensor, rows: list[RowSampling]) -> list[list[tuple[int, float]]]:
    most = max((r.top_logprobs for r in rows), default=0)
    if most == 0:
        return [[] for _ in rows]
    values, ids = logprobs.topk(most, dim=-1)
    return [list(zip(i[:r.top_logprobs], v[:r.top_logprobs])) for r, i, v in zip(rows, ids.tolist(), values.tolist())]


def seed_for(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request seeded with `seed`: the seed itself for the first, a mix of both
    for the others (so n samples of one request differ, and each is reproducible on its own)."""
    if seed is None or index == 0:
        return seed
    return (seed * 6364136223846793005 + index * 1442695040888963407) % (2 ** 63)


def row_sampling(cfg: SamplingConfig, seed: int | None, prompt: list[int], vocab: int, device: torch.device,
                 bias: dict[int, float] | None = None, top_logprobs: int = 0) -> RowSampling:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    seen = None
    if cfg.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
    return RowSampling(cfg, generator, seen, bias or None, top_logprobs)
