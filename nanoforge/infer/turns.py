"""Conversations with tools, at the token level: the one multi-turn loop of `eval --gsm8k/--toolcall`, `grpo
--tools` (rl/agent.py) and everything else that lets a model call tools.

A conversation is one flat list of token ids built by concatenation. It starts as its prompt (`tool_prompt`); the
engine samples a reply (stop token kept: the model wrote it); a reply that called tools has them run, and the
environment's tokens are appended: what the chat template writes after such a turn, from just after its
<|im_end|> to the next generation prompt,

    \\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response>[...]<|im_end|>\\n<|im_start|>assistant\\n
    <think>\\n\\n</think>\\n\\n        (or the open `<think>\\n` with think=True)

and the same sequence goes on in the engine, its slot and cache kept: only the new tokens are read. The
conversation is never re-rendered and re-tokenised: a reply may re-tokenise differently from what the model
sampled, and RL would train log-probs of tokens the model never produced. `environment_ids` derives the
environment text from the template itself; each piece starts right after a control token, so for ordinary text
the concatenation equals the render token for token.

    mask      1 on the tokens the model sampled (each reply and its stop token); 0 on the prompt and environment
    logprobs  log softmax(logits / T) of each sampled token (T = 1 for greedy), 0.0 where the mask is 0

How a conversation ends (`Conversation.end`): "answer" (a reply without a well-formed tool call), "length" (cut by
max_new_tokens; its calls are not run), "max_turns" (the last allowed reply still called tools: run and counted,
nothing appended), "context" (ids + max_new_tokens would not fit; nothing more is generated). So no long
conversation shortens another's reply, and each gives in a batch what it gives alone."""
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from nanoforge.core.device import eval_mode
from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.options import SamplingConfig
from nanoforge.infer.engine import Engine, Request
from nanoforge.infer.engine.sampler import seed_for
from nanoforge.chat.replies import Reply, parse_reply
from nanoforge.chat.tools import assistant_message, tool_messages, tool_schemas

MAX_BATCH = 64


@dataclass
class Conversation:
    """One conversation after the loop. `ids`, `mask` and `logprobs` are aligned, one entry per token; `texts[k]`
    is reply k as decoded (without its stop token), `replies[k]` that text parsed; `tool_results` holds the result
    of every call that was run; `messages` the prompt's messages (when given) with every assistant and tool
    message added."""
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    prompt_len: int
    messages: list[dict] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    tool_results: list[str] = field(default_factory=list)
    end: str = ""

    @property
    def finished(self) -> bool:
        """Answered without a call, before max_turns, without truncation (and within the context)."""
        return self.end == "answer"

    @property
    def turns(self) -> int:
        return len(self.replies)

    @property
    def final_content(self) -> str:
        """The last reply's content ("" when there was none)."""
        return self.replies[-1].content if self.replies else ""

    @property
    def new_tokens(self) -> int:
        return sum(self.mask)


def tool_prompt(tokenizer, messages: Sequence[dict], tools: Sequence[str], think: bool,
                declared: list | None = None) -> list[int]:
    """The prompt's token ids: `messages` with the generation prompt; the schemas of `tools` go in the system turn
    unless the conversation declares its own (`declared`, or a system message with "tools", as SFT records have)."""
    own = declared is not None or (messages and messages[0].get("role") == "system"
                                   and messages[0].get("tools") is not None)
    schemas = None if own else tool_schemas(tools)
    ids, _ = tokenizer.render_chat(list(messages), add_generation_prompt=True, tools=schemas, open_thinking=think)
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
                             "after a tool call cannot be found; tool use needs a ChatML tools template")
    return ids[end + 1:]


def run_conversations(model, tokenizer, prompts: Sequence[Sequence[int]], cfg: SamplingConfig,
                      tools: Sequence[str] = (), max_turns: int = 4, think: bool = False,
                      messages: Sequence[Sequence[dict]] | None = None, seeds: Sequence[int | None] | None = None,
                      precision: str = "fp32", max_batch: int = MAX_BATCH,
                      on_done: Callable[[int], None] | None = None) -> list[Conversation]:
    """Run every prompt (token ids, e.g. `tool_prompt`) to its end (see the module docstring); one Conversation
    each, in order. `tools`: the built-in tools whose calls are run; `think`: every generation prompt opens the
    think block; `messages`: each prompt's messages, for `Conversation.messages`. `seeds`: one per prompt (default:
    cfg.seed mixed with the prompt's index); identical prompts (a GRPO group) share their prefill.
    `on_done(n)` is called each time a conversation ends, with how many have."""
    _check(tokenizer, prompts, messages, tools, max_turns)
    context = model.context_length
    conversations = [Conversation(list(p), [0] * len(p), [0.0] * len(p), len(p),
                                  list(messages[i]) if messages is not None else []) for i, p in enumerate(prompts)]
    for c in conversations:
        if len(c.ids) + cfg.max_new_tokens > context:
            c.end = "context"
    live = [i for i, c in enumerate(conversations) if not c.end]
    if not live:
        return conversations
    engine = Engine(model, tokenizer, precision, max_batch=min(max_batch, len(live)))
    owner = _submit(engine, tokenizer, prompts, live, cfg, seeds)
    ended = len(conversations) - len(live)
    with eval_mode(model):
        while engine.busy:
            for seq in engine.step():
                if not seq.done:
                    continue
                conversation = conversations[owner[seq]]
                more = _turn(conversation, seq, tokenizer, tools, think, max_turns, context - cfg.max_new_tokens)
                if more:
                    engine.extend(seq, more)
                    continue
                engine.release(seq)
                ended += 1
                if on_done is not None:
                    on_done(ended)
    return conversations


def _check(tokenizer, prompts, messages, tools: Sequence[str], max_turns: int) -> None:
    if not isinstance(max_turns, int) or max_turns < 1:
        raise NanoforgeError(f"max_turns={max_turns!r} must be an integer >= 1")
    if messages is not None and len(messages) != len(prompts):
        raise NanoforgeError(f"{len(messages)} message lists for {len(prompts)} prompts")
    if tools and not tokenizer.supports_tools:
        raise NanoforgeError("this tokenizer's chat template cannot render tool calls; tools need a tokenizer "
                             "trained by `nanoforge tokenizer train` (or MiniMind-3's)")


def _submit(engine: Engine, tokenizer, prompts, live: list[int], cfg: SamplingConfig, seeds) -> dict:
    """One request per distinct prompt (its repeats are its n samples, sharing the prefill); {sequence: row}."""
    groups: dict[tuple, list[int]] = {}
    for i in live:
        groups.setdefault(tuple(prompts[i]), []).append(i)
    owner = {}
    for key, rows in groups.items():
        for at in range(0, len(rows), engine.max_batch):
            part = rows[at:at + engine.max_batch]
            row_seeds = [seeds[i] if seeds is not None else seed_for(cfg.seed, i) for i in part]
            request = Request(list(key), cfg, tokenizer.stop_ids, n=len(part), seeds=row_seeds, keep_slot=True)
            owner.update(zip(engine.submit(request), part))
    return owner


def _turn(conversation: Conversation, seq, tokenizer, tools: Sequence[str], think: bool, max_turns: int,
          room: int) -> list[int] | None:
    """Append one reply (and its tool results); the environment's tokens when the conversation goes on, else None
    (its `end` set). `room`: the longest ids that still leave max_new_tokens of context."""
    stopped = seq.stop_id is not None
    sampled = seq.new_ids + ([seq.stop_id] if stopped else [])
    conversation.ids += sampled
    conversation.mask += [1] * len(sampled)
    conversation.logprobs += seq.logprobs
    # call ids unique within the conversation: call_{turn}_{index}
    reply = parse_reply(seq.text, thinking_open=think, id_prefix=f"call_{conversation.turns}_")
    conversation.texts.append(seq.text)
    conversation.replies.append(reply)
    conversation.messages.append(assistant_message(reply))
    if seq.finish_reason == "length":
        conversation.end = "length"
        return None
    if not reply.tool_calls:
        conversation.end = "answer"
        return None
    results = tool_messages(reply, tools)
    conversation.messages += results
    conversation.tool_results += [m["content"] for m in results]
    if conversation.turns == max_turns:
        conversation.end = "max_turns"
        return None
    environment = environment_ids(tokenizer, results, think)
    if len(conversation.ids) + len(environment) > room:
        conversation.end = "context"
        return None
    conversation.ids += environment
    conversation.mask += [0] * len(environment)
    conversation.logprobs += [0.0] * len(environment)
    return environment


def converse(model, tokenizer, conversations: Sequence[Sequence[dict]], cfg: SamplingConfig, batch_size: int,
             on_done: Callable[[int], None] | None = None, tools: Sequence[str] = (), think: bool = False,
             max_turns: int = 4, precision: str = "fp32") -> tuple[list[Conversation], float]:
    """`run_conversations` from messages (each a list ending where the assistant is to speak), `batch_size` of
    them generated at once; the conversations, in order, and the seconds spent."""
    started = time.perf_counter()
    prompts = [tool_prompt(tokenizer, messages, tools, think) for messages in conversations]
    done = run_conversations(model, tokenizer, prompts, cfg, tools, max_turns, think, messages=conversations,
                             precision=precision, max_batch=batch_size, on_done=on_done)
    return done, time.perf_counter() - started
