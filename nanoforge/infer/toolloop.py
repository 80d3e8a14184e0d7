"""The batched multi-turn tool loop: many conversations at once, each going on for as long as its model calls
tools. `eval --gsm8k` and `eval --toolcall` run on it (RL's rollouts have their own token-level loop, rl/agent.py).

One round: the live conversations are rendered with the generation prompt, generated together (`complete`,
left-padded) and parsed. A reply with tool calls gets its assistant message and one tool message per call (an
unknown tool or bad arguments give an "Error: ..." result the model can read) and goes to the next round.

How a conversation ends (`Rollout.end`):
    "answer"     a reply without tool calls (the normal end)
    "length"     a reply without tool calls cut by max_new_tokens (an unclosed tool-call block is such a reply)
    "max_turns"  it was still calling tools after max_turns replies (the last tool results have no reply)
    "context"    its next prompt plus max_new_tokens does not fit the model's context; nothing was generated
A row only runs when prompt + max_new_tokens fits, so no long prompt shortens another row's reply: a
conversation gives the same replies in a batch as on its own (greedy; up to float rounding)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.generate import Completion, SamplingConfig, complete
from nanoforge.chat.replies import Reply, parse_reply
from nanoforge.chat.tools import assistant_message, tool_messages, tool_schemas


@dataclass
class Rollout:
    """One conversation after the loop: its messages (the prompt's, then every assistant and tool message
    added), each reply parsed and as generated (text, token ids, finish reason), and how it ended."""
    messages: list[dict]
    replies: list[Reply] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    end: str = ""

    @property
    def turns(self) -> int:
        return len(self.replies)

    @property
    def ended_normally(self) -> bool:
        return self.end == "answer"

    @property
    def final_content(self) -> str:
        """The last reply's content ("" when there was none)."""
        return self.replies[-1].content if self.replies else ""

    @property
    def new_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


def stop_ids(tokenizer) -> list[int]:
    """End of text, <|im_end|>, and <|im_start|> (a model opening the next turn has finished its own)."""
    return [t for t in (tokenizer.eos_id, tokenizer.im_end_id, tokenizer.im_start_id) if t is not None]


def run_tool_loop(model, tokenizer, conversations: Sequence[Sequence[dict]], cfg: SamplingConfig,
                  tools: Sequence[str] = (), think: bool = False, max_turns: int = 4,
                  precision: str = "fp32") -> list[Rollout]:
    """Run every conversation (a list of messages ending where the assistant is to speak) to its end; one
    Rollout each, in order. `tools` are the built-in tools the model may call: their schemas go in the prompt
    (unless a conversation's opening system message declares its own, as SFT records do) and their calls are
    run. `think` opens the think block in every generation prompt. The input lists are not modified."""
    if max_turns < 1:
        raise NanoforgeError(f"max_turns={max_turns} must be >= 1")
    if tools and not tokenizer.supports_tools:
        raise NanoforgeError("this tokenizer's chat template cannot render tool calls; tools need a tokenizer "
                             "trained by `nanoforge tokenizer train` (or MiniMind-3's)")
    schemas, stops = tool_schemas(tools), stop_ids(tokenizer)
    context = model.model.rotary_emb.n_positions
    rollouts = [Rollout(messages=list(c)) for c in conversations]
    live = list(range(len(rollouts)))
    for _ in range(max_turns):
        rows, prompts = [], []
        for i in live:
            ids = _prompt_ids(tokenizer, rollouts[i].messages, context - cfg.max_new_tokens, schemas, think)
            if ids is None:
                rollouts[i].end = "context"
            else:
                rows.append(i)
                prompts.append(ids)
        live = []
        for i, completion in zip(rows, complete(model, tokenizer, prompts, cfg, stops, precision)):
            if _add_reply(rollouts[i], completion, tools, think):
                live.append(i)
        if not live:
            break
    for i in live:
        rollouts[i].end = "max_turns"
    return rollouts


def _prompt_ids(tokenizer, messages: list[dict], room: int, schemas, think: bool) -> list[int] | None:
    """The prompt's token ids, None when more than `room`; a text too long to be fewer is not even tokenized."""
    declared = messages and messages[0].get("role") == "system" and messages[0].get("tools") is not None
    render = dict(add_generation_prompt=True, tools=None if declared else schemas, open_thinking=think)
    if len(tokenizer.render_text(messages, **render)) > room * tokenizer.max_token_chars:
        return None
    ids, _ = tokenizer.render_chat(messages, **render)
    return ids if len(ids) <= room else None


def _add_reply(rollout: Rollout, completion: Completion, tools: Sequence[str], think: bool) -> bool:
    """Append one generated reply (and its tool results) to the rollout; True when it called tools."""
    # call ids unique within the conversation: call_{turn}_{index}
    reply = parse_reply(completion.text, thinking_open=think, id_prefix=f"call_{rollout.turns}_")
    rollout.replies.append(reply)
    rollout.completions.append(completion)
    rollout.messages.append(assistant_message(reply))
    if reply.tool_calls:
        rollout.messages.extend(tool_messages(reply, tools))
        return True
    rollout.end = "length" if completion.finish_reason == "length" else "answer"
    return False


def run_in_batches(model, tokenizer, conversations: Sequence[Sequence[dict]], cfg: SamplingConfig,
                   batch_size: int, on_batch: Callable[[int], None] | None = None,
                   **loop_args) -> tuple[list[Rollout], float]:
    """`run_tool_loop` over consecutive groups of `batch_size` conversations; the rollouts and the seconds spent.
    `on_batch(done)` is called after each group with the number of conversations finished so far."""
    rollouts: list[Rollout] = []
    started = time.perf_counter()
    for start in range(0, len(conversations), batch_size):
        rollouts += run_tool_loop(model, tokenizer, conversations[start:start + batch_size], cfg, **loop_args)
        if on_batch is not None:
            on_batch(len(rollouts))
    return rollouts, time.perf_counter() - started
