"""Multi-turn tool-use rollouts for RL (MiniMind's agentic RL, `grpo --tools calculator --max-turns N`): every
trajectory is one flat list of token ids built by concatenation, with a loss mask and the policy's log-probs.

A trajectory starts as its prompt (`agent_prompt`). Each round generates the next reply of every live trajectory
at once (one left-padded batch through the KV-cache decoder) and appends the sampled tokens as they are, stop
token included. A reply that called tools has them run, then the environment's tokens are appended: what the
chat template writes after such a turn, from just after its <|im_end|> to the next generation prompt,

    \\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response>[...]<|im_end|>\\n<|im_start|>assistant\\n
    <think>\\n\\n</think>\\n\\n        (or the open `<think>\\n` with think=True)

The conversation is never re-rendered and re-tokenised: a reply may re-tokenise differently from what the model
sampled, and the trained log-probs would belong to tokens it never produced. `environment_ids` derives the
environment text from the template itself and tokenises it with `render_chat` (control tokens as such, a tool
result spelling one as plain text); each piece starts right after a control token, so for ordinary text the
concatenation equals the render token for token (tests/rl/test_agent.py checks one).

    mask      1 on the tokens the model sampled (each reply and its stop token); 0 on the prompt and environment
    logprobs  log softmax(logits / T) of each sampled token at rollout time (T = 1 for greedy), 0.0 where the mask
              is 0; the unfiltered tempered distribution the trainer recomputes (top-k/top-p would differ)

How a trajectory ends (`Trajectory.end`; only "answer" is finished, for the agent reward's penalty): "answer" (a
reply without a well-formed tool call), "length" (cut by max_new_tokens; its calls are not run), "max_turns" (the
last allowed reply still called tools: run and counted, nothing appended), "context" (ids + max_new_tokens would
not fit). So no long row shortens another's reply, and a batch gives the trajectories each gives alone (greedy,
up to float rounding). The stop token sampled (infer/toolloop.stop_ids) is kept and trained: the model wrote it.
Each round prefills every live trajectory from its first token: no cache is kept between rounds (simple)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.generate import SamplingConfig, sample_with_logprobs
from nanoforge.infer.toolloop import stop_ids
from nanoforge.chat.replies import Reply, parse_reply
from nanoforge.chat.tools import tool_messages, tool_schemas
from nanoforge.rl.prompts import PromptRecord
from nanoforge.rl.rewards import AgentTurns, agent_reward_parts
from nanoforge.rl.options import RLOptions
from nanoforge.rl.rollout import Batch, check_fits, policy_batch
from nanoforge.chat.calculator import BUILTIN_TOOLS


@dataclass
class Trajectory:
    """One multi-turn rollout. `ids`, `mask` and `logprobs` are aligned, one entry per token; `texts[k]` is
    reply k as decoded (without its stop token), `replies[k]` that text parsed; `tool_results` holds the
    result of every call that was run, in order; `reward` is rl.rewards.agent_reward, `reward_parts` its terms."""
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    prompt_len: int
    texts: list[str] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    tool_results: list[str] = field(default_factory=list)
    end: str = ""
    reward: float = 0.0
    reward_parts: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """Answered without a call, before max_turns, without truncation (and within the context)."""
        return self.end == "answer"

    @property
    def turns(self) -> int:
        return len(self.replies)


def agent_prompt(tokenizer, record: PromptRecord, tools: Sequence[str], think: bool) -> list[int]:
    """The prompt's token ids: the record's messages with the generation prompt; the schemas of `tools` go in
    the system turn unless the record's system message declares its own (as SFT records do)."""
    schemas = None if record.tools is not None else tool_schemas(tools)
    ids, _ = tokenizer.render_chat(record.messages, add_generation_prompt=True, tools=schemas, open_thinking=think)
    return ids


def environment_ids(tokenizer, messages: Sequence[dict], think: bool) -> list[int]:
    """The tokens that follow an assistant turn's <|im_end|> when that turn called tools and got the `tool`
    `messages`: the template's user turn of <tool_response> blocks and the next generation prompt.

    Derived by rendering [a placeholder assistant turn, *messages] with the generation prompt and keeping the
    ids after the assistant turn's <|im_end|> (its last masked token). The assistant's text cannot change
    what follows: the template renders a tool message from its own content and the role before it, and the
    tokenizer starts afresh after a control token."""
    conversation = [{"role": "assistant", "content": "-"}, *messages]
    ids, mask = tokenizer.render_chat(conversation, add_generation_prompt=True, open_thinking=think)
    end = max(i for i, m in enumerate(mask) if m)
    if ids[end] != tokenizer.im_end_id:
        raise NanoforgeError("the chat template does not close an assistant turn with <|im_end|>, so the tokens "
                             "after a tool call cannot be found; agent rollouts need a ChatML tools template")
    return ids[end + 1:]


def agent_rollouts(model, tokenizer, prompts: Sequence[Sequence[int]], records: Sequence[PromptRecord],
                   tools: Sequence[str], cfg: SamplingConfig, max_turns: int, think: bool = False,
                   generator: torch.Generator | None = None, precision: str = "fp32") -> list[Trajectory]:
    """Roll out every prompt (token ids, e.g. `agent_prompt`) with the built-in `tools` until it answers, runs
    out of turns or of context; one Trajectory each, in order, rewarded by rl.rewards.agent_reward against
    its record (which needs "gt"). `cfg` gives the temperature and max_new_tokens per reply; `generator`
    (else a fresh one seeded with cfg.seed, else the global RNG) draws every token of every round, so a run
    that saves and restores it resumes exactly. `think` means every prompt ends inside an open think block."""
    _check_arguments(tokenizer, prompts, records, tools, cfg, max_turns)
    if generator is None and cfg.seed is not None:
        generator = torch.Generator(device=next(model.parameters()).device).manual_seed(cfg.seed)
    context = model.model.rotary_emb.n_positions
    stops = set(stop_ids(tokenizer))
    trajectories = [Trajectory(list(p), [0] * len(p), [0.0] * len(p), len(p),
                               end="context" if len(p) + cfg.max_new_tokens > context else "") for p in prompts]
    live = [i for i, trajectory in enumerate(trajectories) if not trajectory.end]
    for turn in range(max_turns):
        if not live:
            break
        rows = sample_with_logprobs(model, [trajectories[i].ids for i in live], cfg, stops, generator, precision)
        live = [i for i, (tokens, logprobs, stopped) in zip(live, rows)
                if _add_reply(trajectories[i], tokenizer, tokens, logprobs, stopped, tools, think,
                              turn + 1 == max_turns, context - cfg.max_new_tokens)]
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


def _add_reply(trajectory: Trajectory, tokenizer, tokens: list[int], logprobs: list[float], stopped: bool,
               tools: Sequence[str], think: bool, last_turn: bool, room: int) -> bool:
    """Append one sampled reply, run its calls and append the environment's tokens; True when the trajectory
    goes on to another round. `room`: the longest ids that still leave max_new_tokens of context."""
    trajectory.ids += tokens
    trajectory.mask += [1] * len(tokens)
    trajectory.logprobs += logprobs
    text = tokenizer.decode(tokens[:-1] if stopped else tokens)
    # call ids unique within the trajectory: call_{turn}_{index}
    reply = parse_reply(text, thinking_open=think, id_prefix=f"call_{trajectory.turns}_")
    trajectory.texts.append(text)
    trajectory.replies.append(reply)
    if not stopped:
        trajectory.end = "length"
        return False
    if not reply.tool_calls:
        trajectory.end = "answer"
        return False
    messages = tool_messages(reply, tools)
    trajectory.tool_results += [m["content"] for m in messages]
    if last_turn:
        trajectory.end = "max_turns"
        return False
    environment = environment_ids(tokenizer, messages, think)
    if len(trajectory.ids) + len(environment) > room:
        trajectory.end = "context"
        return False
    trajectory.ids += environment
    trajectory.mask += [0] * len(environment)
    trajectory.logprobs += [0.0] * len(environment)
    return True


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
    agent_rollouts (every trajectory of the step in one batch per round), rewarded by the agent reward alone
    (`reward_fn` must be None), and laid out as the same batch (the reference's log-probs recomputed over the
    packed ids in the loss's micro-batch chunks; the old ones are the first update's)."""
    if reward_fn is not None:
        raise NanoforgeError("--tools: the agent reward is the reward; --reward and --reward-model do not apply")
    G = opts.num_generations
    prompts = [agent_prompt(tokenizer, r, tools, opts.think) for r in records]
    for ids, record in zip(prompts, records):
        check_fits(ids, record, model.model.rotary_emb.n_positions)
    sampling = SamplingConfig(temperature=opts.temperature, max_new_tokens=opts.max_new_tokens, seed=seed)
    start = time.perf_counter()
    trajectories = agent_rollouts(model, tokenizer, [p for p in prompts for _ in range(G)],
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
