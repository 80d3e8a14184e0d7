"""Rollouts: P prompts x G replies sampled at once through the generation engine, scored, and laid out as the
batch the policy loss trains on; every RL stage (and rl/agent.py's layout) shares these pieces.

A rollout batch (CPU tensors, B = P x G rows, groups of G consecutive rows share a prompt; L = longest prompt +
reply, right-padded with the tokenizer's pad id):
    input_ids    (B, L)     prompt + reply (+ its stop token when it stopped, not when max_new_tokens cut it)
    loss_mask    (B, L-1)   1 where the target input_ids[:, t+1] is a reply token (stop token included), else 0
    ref_logp     (B, L-1)   the frozen reference's log_softmax(logits / T) of each target, no grad (absent at beta 0)
    advantages   (B,)       group advantages of the rewards (rl/losses.py group_advantages)
    rewards      (B,)       the combined reward of each reply
    stat_*       ()         the rollout's figures, logged by the stage's loss as extras
The old log-probs are the first update's own (rl/grpo_batches.py). Sampling draws from exactly softmax(logits /
T), whose log-probs are trained: with top-k, top-p or a repetition penalty the ratio would not start at 1."""
import time
from typing import Callable, Sequence

import torch

from nanoforge.core.device import autocast_context, eval_mode
from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.generate import Completion, SamplingConfig, complete
from nanoforge.chat.replies import THINK_OPEN
from nanoforge.rl.losses import group_advantages
from nanoforge.model.prefix import prefix_token_logps
from nanoforge.rl.prompts import PromptRecord
from nanoforge.rl.options import PPOOptions, RLOptions
from nanoforge.train.stage import Batch

# fn(completion text, reward record) -> (total reward, {reward name: value}); rl/rewards.py combine()
RewardFn = Callable[[str, dict], tuple[float, dict[str, float]]]


def render_prompt(tokenizer, record: PromptRecord, think: bool) -> tuple[list[int], bool]:
    """(prompt ids with the generation prompt, whether the prompt opened the think block) of one record, its
    tools (if any) passed to the template."""
    kwargs = {"open_thinking": True} if think else {}
    ids, _, text = tokenizer.render_chat_with_text(record.messages, add_generation_prompt=True,
                                                   tools=record.tools, **kwargs)
    return ids, text.endswith(THINK_OPEN + "\n")


def check_prompts(tokenizer, records: Sequence[PromptRecord], think: bool, context: int) -> None:
    """Render every prompt once before training: a record the template refuses or one too long for the model's
    context stops the run before its first step, naming the record's file:line."""
    for record in records:
        check_fits(render_prompt(tokenizer, record, think)[0], record, context)


def check_fits(prompt: list[int], record: PromptRecord, context: int) -> None:
    """A prompt must leave room for at least one reply token in the model's context."""
    if len(prompt) >= context:
        raise NanoforgeError(f"{record.source or 'a prompt'}: renders to {len(prompt)} tokens, but the model sees "
                             f"at most {context}, which leaves no room for a reply; shorten or drop this prompt")


def sample_replies(model, tokenizer, prompts: Sequence[list[int]], opts: RLOptions | PPOOptions, seed: int,
                   precision: str) -> list[Completion]:
    """One reply per prompt id list, all through the engine at once (a finished reply frees its slot, a group's
    prompt is read once), each stopping where every reply stops (tokenizer.stop_ids); drawn from softmax(logits /
    T), row i with a seed of its own mixed from `seed` and i (so a rollout is reproducible from its seed alone)."""
    if tokenizer.im_end_id is None:
        raise NanoforgeError("RL needs a chat tokenizer with <|im_end|>, the token that ends a reply")
    sampling = SamplingConfig(temperature=opts.temperature, max_new_tokens=opts.max_new_tokens, seed=seed)
    return complete(model, tokenizer, prompts, sampling, stop_ids=tokenizer.stop_ids, precision=precision)


@torch.no_grad()
def frozen_logps(model, input_ids: torch.Tensor, loss_mask: torch.Tensor, temperature: float, precision: str,
                 chunk: int | None = None) -> torch.Tensor:
    """model/prefix.py's log-probs in eval mode, no grad, under the run's autocast: the reference's. Computed `chunk`
    rows at a time, the micro-batches the loss will see: the same shapes give the same numbers (in fp32 the first
    update's KL is exactly 0), and the logits of a whole rollout need not fit at once."""
    device = next(model.parameters()).device
    chunk = chunk or len(input_ids)
    with eval_mode(model), autocast_context(device, precision):
        return torch.cat([prefix_token_logps(model, ids.to(device), mask.to(device), temperature).cpu()
                          for ids, mask in zip(input_ids.split(chunk), loss_mask.split(chunk))])


def pack(prompts: Sequence[list[int]], replies: Sequence[Completion], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (B, L), loss_mask (B, L-1)): each row prompt + reply (+ its stop token), right-padded; the
    mask is 1 on the reply's tokens as targets, the stop token included."""
    rows = [list(p) + list(r.token_ids) + ([r.stop_id] if r.stop_id is not None else [])
            for p, r in zip(prompts, replies)]
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length - 1), dtype=torch.float32)
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, len(prompt) - 1:len(row) - 1] = 1.0  # target t+1 is a reply token
    return ids, mask


def score(replies: Sequence[Completion], records: Sequence[dict], reward_fn: RewardFn,
          max_new_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
    """(rewards (B,), mean of each reward's part) of the replies; records[i] is reply i's reward record."""
    totals, parts_sum = [], {}
    for reply, record in zip(replies, records):
        record = {**record, "reply_tokens": len(reply.token_ids), "max_new_tokens": max_new_tokens,
                  "truncated": reply.finish_reason == "length"}
        total, parts = reward_fn(reply.text, record)
        totals.append(total)
        for name, value in parts.items():
            parts_sum[name] = parts_sum.get(name, 0.0) + value
    return torch.tensor(totals, dtype=torch.float32), {k: v / len(replies) for k, v in parts_sum.items()}


def rollout(model, tokenizer, records: Sequence[PromptRecord], opts: RLOptions, reward_fn: RewardFn, seed: int,
            reference=None, micro_rows: int | None = None, precision: str = "fp32") -> Batch:
    """A step's rollout batch (see the module docstring) for `records`, each sampled num_generations times;
    micro_rows: the rows of the micro-batches the loss will take (all by default)."""
    input_ids, loss_mask, rewards, stats = sample_scored(model, tokenizer, records, opts, reward_fn, seed, precision)
    return policy_batch(reference, input_ids, loss_mask, rewards, opts, micro_rows, stats, precision)


def sample_scored(policy, tokenizer, records: Sequence[PromptRecord], opts: RLOptions | PPOOptions,
                  reward_fn: RewardFn, seed: int,
                  precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """What every single-turn rollout (grpo's, ppo's) starts with: each record rendered, checked against the
    context and sampled num_generations times by `policy`, the replies scored and packed. Returns (input_ids,
    loss_mask, rewards (B,), the replies' figures and the mean of each reward's part, for the log)."""
    G = opts.num_generations
    rendered = [render_prompt(tokenizer, r, opts.think) for r in records]
    for (ids, _), record in zip(rendered, records):
        check_fits(ids, record, policy.context_length)
    prompts = [ids for ids, _ in rendered for _ in range(G)]
    start = time.perf_counter()
    replies = sample_replies(policy, tokenizer, prompts, opts, seed, precision)
    seconds = time.perf_counter() - start
    reward_records = [{**r.reward_record(), "thinking_open": open_} for r, (_, open_) in zip(records, rendered)
                      for _ in range(G)]
    rewards, parts = score(replies, reward_records, reward_fn, opts.max_new_tokens)
    input_ids, loss_mask = pack(prompts, replies, tokenizer.pad_id if tokenizer.pad_id is not None else 0)
    new_tokens = sum(len(r.token_ids) + (r.stop_id is not None) for r in replies)
    return input_ids, loss_mask, rewards, {
        "reply_len": new_tokens / len(replies),
        "truncated": sum(r.finish_reason == "length" for r in replies) / len(replies),
        "rollout_tokens_per_s": new_tokens / max(seconds, 1e-9), **{f"reward_{k}": v for k, v in parts.items()}}


def policy_batch(reference, input_ids: torch.Tensor, loss_mask: torch.Tensor, rewards: torch.Tensor,
                 opts: RLOptions, micro_rows: int | None, stats: dict[str, float], precision: str) -> Batch:
    """The rollout batch of packed rows (rollout's, rl/agent.py's): the reference's log-probs (beta > 0) in the
    loss's micro-batch chunks, group advantages of the rewards, and the reward figures and `stats` as stat_* scalars."""
    grouped = rewards.view(-1, opts.num_generations)  # (P, G)
    batch = {"input_ids": input_ids, "loss_mask": loss_mask,
             "advantages": group_advantages(grouped, opts.advantage).view(-1), "rewards": rewards}  # (B,)
    if reference is not None:
        batch["ref_logp"] = frozen_logps(reference, input_ids, loss_mask, opts.temperature, precision, micro_rows)
    stats = {"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
             "zero_var_groups": (grouped.amax(1) == grouped.amin(1)).float().mean().item(), **stats}
    batch.update({f"stat_{k}": torch.tensor(v, dtype=torch.float32) for k, v in stats.items()})
    return batch


def rows(batch: Batch, start: int, stop: int) -> Batch:
    """Rows [start, stop) of a rollout batch (a micro-batch); the stat_* scalars are kept. The columns stay as
    they are: the loss's forward then has the shape of the one that computed ref_logp (frozen_logps's chunks)."""
    return {k: (v[start:stop] if v.dim() else v) for k, v in batch.items()}
