"""Multi-turn tool-use rollouts for RL (MiniMind's agentic RL, `grpo --tools calculator --max-turns N`): each
trajectory is a conversation of infer/turns.py (one flat list of token ids built by concatenation, with a loss
mask and the policy's log-probs, run by the one engine with every other trajectory of the step), rewarded by the
agent reward (rl/rewards.py). The stop token sampled (tokenizer.stop_ids) is kept and trained: the model wrote it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.generate import SamplingConfig
from nanoforge.infer.turns import Conversation, environment_ids, run_conversations, tool_prompt
from nanoforge.rl.prompts import PromptRecord
from nanoforge.rl.rewards import AgentTurns, agent_reward_parts
from nanoforge.rl.options import RLOptions
from nanoforge.train.stage import Batch
from nanoforge.rl.rollout import check_fits, policy_batch
from nanoforge.chat.calculator import BUILTIN_TOOLS

__all__ = ["Trajectory", "agent_prompt", "sample_trajectories", "environment_ids", "agent_rollout"]


@dataclass
class Trajectory(Conversation):
    """A conversation (infer/turns.py) with its agent reward (`reward`, rl.rewards.agent_reward) and its terms."""
    reward: float = 0.0
    reward_parts: dict = field(default_factory=dict)


def agent_prompt(tokenizer, record: PromptRecord, tools: Sequence[str], think: bool) -> list[int]:
    """The prompt's token ids: the record's messages with the generation prompt; the schemas of `tools` go in
    the system turn unless the record's system message declares its own (as SFT records do)."""
    return tool_prompt(tokenizer, record.messages, tools, think, declared=record.tools)


def sample_trajectories(model, tokenizer, prompts: Sequence[Sequence[int]], records: Sequence[PromptRecord],
                   tools: Sequence[str], cfg: SamplingConfig, max_turns: int, think: bool = False,
                   generator: torch.Generator | None = None, precision: str = "fp32") -> list[Trajectory]:
    """Roll out every prompt (token ids, e.g. `agent_prompt`) with the built-in `tools` until it answers, runs
    out of turns or of context; one Trajectory each, in order, rewarded by rl.rewards.agent_reward against
    its record (which needs "gt"). `cfg` gives the temperature and max_new_tokens per reply; each trajectory's
    seed is drawn from `generator` (else from cfg.seed and its index), so a run that saves and restores either
    resumes exactly. `think` means every prompt ends inside an open think block."""
    _check_arguments(tokenizer, prompts, records, tools, cfg, max_turns)
    seeds = None if generator is None else torch.randint(2 ** 62, (len(prompts),), generator=generator).tolist()
    conversations = run_conversations(model, tokenizer, prompts, cfg, tools, max_turns, think, seeds=seeds,
                                      precision=precision)
    trajectories = [Trajectory(**vars(c)) for c in conversations]
    for trajectory, record in zip(trajectories, records):
        turns = AgentTurns(trajectory.texts, trajectory.tool_results, trajectory.finished)
        trajectory.reward_parts = agent_reward_parts(turns, {**record.reward_record(), "thinking_open": think})
        trajectory.reward = trajectory.reward_parts["total"]
    return trajectories


def _check_arguments(tokenizer, prompts, records, tools, cfg: SamplingConfig, max_turns: int) -> None:
    cfg.validate()
    if not isinstance(max_turns, int) or max_turns < 1:
        raise NanoforgeError(f"--max-turns {max_turns!r} must be an integer >= 1")
    if len(prompts) != len(records):
        raise NanoforgeError(f"{len(prompts)} prompts for {len(records)} records; give one record per prompt")
    unknown = [t for t in tools if t not in BUILTIN_TOOLS]
    if unknown:
        raise NanoforgeError(f"--tools: unknown tool {unknown[0]!r}; the built-in tools are "
                             f"{', '.join(sorted(BUILTIN_TOOLS))}")
    if not tokenizer.supports_tools:
        raise NanoforgeError("this tokenizer's chat template cannot render tool calls; agent rollouts need a "
                             "tokenizer trained by `nanoforge tokenizer train` (or MiniMind-3's)")
    if cfg.repetition_penalty != 1.0 or cfg.stop_strings:
        raise NanoforgeError("RL rollouts sample from the policy's own distribution and stop on its stop token: "
                             "repetition_penalty must be 1 and stop_strings empty")


# ---------------------------------------------------------------------------------------------- the RL batch

def pack_trajectories(trajectories: Sequence[Trajectory], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (B, L), loss_mask (B, L-1)) of a rollout batch (rl/rollout.py's layout): each trajectory's ids
    right-padded; loss_mask[t] is the trajectory's mask of target t+1 (its own sampled tokens), 0 on padding."""
    length = max(len(t.ids) for t in trajectories)
    ids = torch.full((len(trajectories), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(trajectories), length - 1), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        ids[i, :len(t.ids)] = torch.tensor(t.ids)
        mask[i, :len(t.ids) - 1] = torch.tensor(t.mask[1:], dtype=torch.float32)
    return ids, mask


def agent_rollout(model, tokenizer, records: Sequence[PromptRecord], opts: RLOptions, reward_fn, seed: int,
                  reference=None, micro_rows: int | None = None, precision: str = "fp32", *, tools: Sequence[str],
                  max_turns: int) -> Batch:
    """rl/rollout.py `rollout` for `grpo --tools`: each record rolled out num_generations times by
    sample_trajectories (every trajectory of the step in one batch per round), rewarded by the agent reward alone
    (`reward_fn` must be None), and laid out as the same batch (the reference's log-probs recomputed over the
    packed ids in the loss's micro-batch chunks; the old ones are the first update's)."""
    if reward_fn is not None:
        raise NanoforgeError("--tools: the agent reward is the reward; --reward and --reward-model do not apply")
    G = opts.num_generations
    prompts = [agent_prompt(tokenizer, r, tools, opts.think) for r in records]
    for ids, record in zip(prompts, records):
        check_fits(ids, record, model.context_length)
    sampling = SamplingConfig(temperature=opts.temperature, max_new_tokens=opts.max_new_tokens, seed=seed)
    start = time.perf_counter()
    trajectories = sample_trajectories(model, tokenizer, [p for p in prompts for _ in range(G)],
                                  [r for r in records for _ in range(G)], tools, sampling, max_turns, opts.think,
                                  precision=precision)
    seconds = time.perf_counter() - start
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)  # (B,)
    input_ids, loss_mask = pack_trajectories(trajectories, tokenizer.pad_id if tokenizer.pad_id is not None else 0)
    return policy_batch(reference, input_ids, loss_mask, rewards, opts, micro_rows,
                        agent_stats(trajectories, seconds), precision)


def agent_stats(trajectories: Sequence[Trajectory], seconds: float) -> dict[str, float]:
    """A step's figures beside rl/rollout.py policy_batch's reward ones: reply_len (sampled tokens per
    trajectory), truncated, rollout tokens/s, and the agent's (turns, tool calls per trajectory, unfinished
    share, the agent reward's parts)."""
    n = len(trajectories)
    new_tokens = sum(sum(t.mask) for t in trajectories)  # the sampled ones
    stats = {"reply_len": new_tokens / n, "truncated": sum(t.end == "length" for t in trajectories) / n,
             "rollout_tokens_per_s": new_tokens / max(seconds, 1e-9),
             "turns": sum(t.turns for t in trajectories) / n,
             "tool_calls": sum(len(t.tool_results) for t in trajectories) / n,
             "unfinished": sum(not t.finished for t in trajectories) / n}
    for name in ("calls", "bad", "answer", "unfinished"):
        stats[f"reward_{name}"] = sum(t.reward_parts[name] for t in trajectories) / n
    return stats


def check_agent_prompts(tokenizer, records: Sequence[PromptRecord], tools: Sequence[str], think: bool,
                        context: int) -> None:
    """Before the first step of `grpo --tools`: the template renders tool calls, every record has "gt" (the
    agent reward's expected answers) and its prompt, tool schemas included, fits the model's context; a bad
    record is named by its file:line."""
    if not tokenizer.supports_tools:
        raise NanoforgeError("--tools: this tokenizer's chat template cannot render tool calls; agent rollouts "
                             "need a tokenizer trained by `nanoforge tokenizer train` (or MiniMind-3's)")
    for record in records:
        if not record.gt:
            raise NanoforgeError(f'{record.source or "a prompt"}: "gt": missing; with --tools every record needs '
                                 'the expected answers ("gt": a string or a list of strings) for the agent reward')
        check_fits(agent_prompt(tokenizer, record, tools, think), record, context)
