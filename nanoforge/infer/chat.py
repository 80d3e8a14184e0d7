"""`nanoforge chat RUN`: talk to a model in the terminal, replies streamed as they are generated.

The conversation is a list of messages rendered with the tokenizer's chat template, the same one SFT trained on,
so the model sees exactly the format it learned. Piped input (`echo hi | nanoforge chat RUN`) is one message and
one reply, for scripts.

With a template in MiniMind-3's format (tokenizers from `nanoforge tokenizer train`, MiniMind-3's own) each reply
is parsed as it streams (chat/replies.py, the parser the server uses): reasoning is printed apart from the answer
(`--think` opens it), and tool calls are shown as calls. With `--tools calculator` the tools are declared in the
system turn, each call is run and its result fed back, until the model answers without a call (at most
--max-tool-turns rounds per message)."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
from typing import Callable, Sequence, TextIO

from nanoforge.core.device import eval_mode
from nanoforge.core.errors import NanoforgeError
from nanoforge.data.jsonl import LONE_SURROGATE
from nanoforge.infer.options import CHAT_SAMPLING, ChatOptions, DeviceOptions as _D
from nanoforge.infer.engine import Engine, Request
from nanoforge.infer.generate import SamplingConfig, stream
from nanoforge.infer.load import load_for_inference
from nanoforge.infer.turns import environment_ids
from nanoforge.chat.replies import THINK_OPEN, Reply, StreamParser, reply_from_events
from nanoforge.chat.tools import assistant_message, parse_tool_names, tool_messages, tool_schemas

HELP = """commands:
  /reset        forget the conversation (the system prompt stays)
  /system TEXT  set the system prompt and start over (/system alone removes it)
  /help         show this
  /exit         leave (so do Ctrl-D and Ctrl-C)"""


def chat_loop(model, tokenizer, cfg: SamplingConfig, system: str | None, input_stream: TextIO,
              output_stream: TextIO, interactive: bool, precision: str = "fp32",
              on_prompt: Callable[[list[int]], None] | None = None, tools: Sequence[str] = (),
              think: bool = False, max_tool_turns: int = ChatOptions.max_tool_turns) -> list[dict]:
    """Run a conversation on the given streams; return the messages it ended with.

    Interactive: a `you> ` prompt per line, commands (see HELP), each reply streamed after `bot> `. Otherwise all
    of `input_stream` is one user message; its reply is printed and the loop returns. `on_prompt` gets the token
    ids of each rendered prompt before its reply is generated (tests use it to see what the model was given).
    `tools`: names of built-in tools to offer and run; `think`: open the think block of every reply."""
    session = _Session(model, tokenizer, cfg, system, output_stream, interactive, precision, on_prompt, list(tools),
                       think, max_tool_turns)
    if not interactive:
        text = input_stream.read().strip()
        if not text:
            raise NanoforgeError("no message on standard input; pipe one in, e.g. echo hi | nanoforge chat RUN")
        session.reply(text, prefix="")
        return session.messages

    session.write("nanoforge chat: type a message, /help for commands, /exit to leave\n")
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C outside a reply (which it only cuts short) ends the chat
        while True:
            line = _read_line(input_stream, session, "you> ")
            if not line:  # end of input: Ctrl-D
                break
            line = line.strip()
            if line.startswith("/"):
                if not session.command(line):
                    return session.messages
            elif line:
                session.reply(line, prefix="bot> ")
    session.write("\n")
    return session.messages


def _read_line(input_stream: TextIO, session: "_Session", prompt: str) -> str:
    """One line of input, "" at the end. On the real terminal through input(), which with the readline
    module gives line editing and history (arrow keys, and backspace over a wide Chinese character)."""
    if input_stream is sys.stdin and sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (importing it is what turns editing on; absent on Windows)
        try:
            return input(prompt) + "\n"
        except EOFError:
            return ""
    session.write(prompt)
    return input_stream.readline()


class _Session:
    """One conversation: its messages, how to render them within the model's context, and its output."""

    def __init__(self, model, tokenizer, cfg: SamplingConfig, system: str | None, out: TextIO, interactive: bool,
                 precision: str, on_prompt: Callable[[list[int]], None] | None, tools: list[str], think: bool,
                 max_tool_turns: int):
        self.model, self.tokenizer, self.cfg, self.out, self.interactive = model, tokenizer, cfg, out, interactive
        self.precision, self.on_prompt, self.system = precision, on_prompt, system or None
        self.messages: list[dict] = self._fresh()
        # <|im_start|> too: the user should not see the model write the next user message
        self.stop_ids = tokenizer.stop_ids
        context = model.context_length
        # Keep room for a full reply, but never more than half the context: a tiny model with 128 positions
        # and the default 256 new tokens would otherwise have no room for the question.
        self.reply_room = min(cfg.max_new_tokens, context // 2)
        self.prompt_budget = context - self.reply_room
        self.said_dropping, self.turns = False, 0
        if (tools or think) and not tokenizer.supports_tools:
            raise NanoforgeError(f"{'--tools' if tools else '--think'} needs a chat template with thinking and tool "
                                 "calls (MiniMind-3's format, written by `nanoforge tokenizer train`); this "
                                 "model's tokenizer has plain ChatML")
        self.tools, self.think, self.max_tool_turns = tools, think, max_tool_turns
        self.engine = Engine(model, tokenizer, precision, max_batch=1)

    def _fresh(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def command(self, line: str) -> bool:
        """Carry out a /command; False when the chat should end."""
        name, _, arg = line.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.messages = self._fresh()
            self.write("(conversation cleared)\n")
        elif name == "/system":
            self.system = arg.strip() or None
            self.messages = self._fresh()
            self.write(f"(system prompt {'set' if self.system else 'removed'}; conversation cleared)\n")
        elif name == "/help":
            self.write(HELP + "\n")
        else:
            self.write(f"unknown command {name}; /help lists the commands\n")
        return True

    def reply(self, text: str, prefix: str) -> None:
        """Add the user's message; generate, print and keep the reply, and while it calls tools (enabled with
        --tools), run them, print and keep their results and let the model go on: the same sequence in the engine,
        the results' tokens appended to it (infer/turns.py's environment_ids), as eval and RL do."""
        self.messages.append({"role": "user", "content": text})
        prompt = self._prompt_that_fits()
        if prompt is None:
            return
        ids, thinking_open = prompt
        self.turns += 1
        cfg = self.cfg
        if cfg.seed is not None:  # the session is reproducible, but each message draws fresh random numbers
            cfg = dataclasses.replace(cfg, seed=cfg.seed + self.turns - 1)
        (seq,) = self.engine.submit(Request(ids, cfg, self.stop_ids, keep_slot=True))
        try:
            for round_ in range(self.max_tool_turns + 1):
                reply, interrupted = self._generate(seq, thinking_open, prefix if round_ == 0 else "", round_)
                self.messages.append(assistant_message(reply))
                if interrupted or not (reply.tool_calls and self.tools) or seq.stop_id is None:
                    return
                if round_ == self.max_tool_turns:
                    self.write(f"(stopped: the model still calls tools after {self.max_tool_turns} rounds)\n")
                    return
                results = tool_messages(reply, self.tools)
                for message in results:
                    self.write(f"[{message['name']} -> {message['content']}]\n")
                self.messages += results
                more = environment_ids(self.tokenizer, results, self.think)
                if len(seq.tokens) + 1 + len(more) > self.prompt_budget:  # + 1: the reply's stop token
                    self.write("(the tool results leave no room for a reply in the model's context)\n")
                    return
                self.engine.extend(seq, more)
                thinking_open = self.think
        finally:
            self.engine.cancel(seq)

    def _generate(self, seq, thinking_open: bool, prefix: str, round_: int) -> tuple[Reply, bool]:
        """Stream one reply of `seq` to the output: (the parsed reply (with a plain-ChatML template, all of it is
        content), whether Ctrl-C cut it short). Call ids are call_{round}_{index}, as in infer/turns.py."""
        if self.on_prompt is not None:
            self.on_prompt(list(seq.tokens))
        self.write(prefix)
        parser = StreamParser(thinking_open, f"call_{round_}_") if self.tokenizer.supports_tools else None
        shown, pieces, interrupted = _ReplyPrinter(self.write), [], False
        try:
            while not seq.done:
                with eval_mode(self.model):
                    self.engine.step()
                piece = seq.reply.take(final=seq.done)
                if piece:
                    pieces.append(piece)
                    shown.show(parser.feed(piece) if parser else [("content", piece)])
            if parser:  # what the parser held back (a tag's first characters, newlines) is shown now
                shown.show(parser.close())
        except KeyboardInterrupt:  # Ctrl-C during a reply stops the reply, not the chat
            interrupted = True
            self.write(" (interrupted)")
        self.write("\n")
        if parser is None:
            return Reply(reasoning=None, content="".join(pieces)), interrupted
        return reply_from_events(shown.events, parser.saw_think), interrupted

    def _render(self, messages: list[dict]) -> tuple[list[int], bool]:
        """(prompt ids, whether the prompt opened the think block) of `messages` with the generation prompt."""
        kwargs = {"open_thinking": True} if self.think else {}
        ids, _, text = self.tokenizer.render_chat_with_text(messages, add_generation_prompt=True,
                                                            tools=tool_schemas(self.tools), **kwargs)
        return ids, text.endswith(THINK_OPEN + "\n")

    def _prompt_that_fits(self) -> tuple[list[int], bool] | None:
        """The rendered prompt (as _render), after dropping the oldest exchanges (a user message and all that
        answered it) until it fits the context with room for the reply. None (and a note) when the newest
        exchange is too long even on its own; the history is then left as it was."""
        first = 1 if self.system else 0
        newest = max(i for i, m in enumerate(self.messages) if m["role"] == "user")
        alone = self._render(self.messages[:first] + self.messages[newest:])
        if len(alone[0]) > self.prompt_budget:
            if newest == len(self.messages) - 1:
                self.messages.pop()
            self._too_long(len(alone[0]))
            return None
        while True:
            prompt = self._render(self.messages)
            if len(prompt[0]) <= self.prompt_budget:
                return prompt
            if not self.said_dropping:
                self.write(f"(the conversation no longer fits the model's context of "
                           f"{self.prompt_budget + self.reply_room} tokens with room for a "
                           f"{self.reply_room}-token reply: dropping the oldest turns from now on)\n")
                self.said_dropping = True
            next_user = next(i for i, m in enumerate(self.messages) if i > first and m["role"] == "user")
            del self.messages[first:next_user]

    def _too_long(self, n_tokens: int) -> None:
        message = (f"this message makes a prompt of {n_tokens} tokens, but the model has room for "
                   f"{self.prompt_budget} (its context of {self.prompt_budget + self.reply_room} minus "
                   f"{self.reply_room} for the reply); send a shorter one, or lower --max-new-tokens")
        if not self.interactive:
            raise NanoforgeError(message)
        self.write(f"({message})\n")  # in a session the user can simply try again


class _ReplyPrinter:
    """Writes a reply's parsed events as they come: reasoning inside `(thinking) ... (end of thinking)`, content as
    it is, each tool call on a line of its own as `[call NAME ARGUMENTS]`, a malformed one as a note; keeps `events`."""

    def __init__(self, write: Callable[[str], None]):
        self.write, self.events, self.section = write, [], None

    def show(self, events: list) -> None:
        for kind, value in events:
            self.events.append((kind, value))
            if kind != self.section and self.section == "reasoning":
                self.write(" (end of thinking)\n")
            if kind == "reasoning":
                self.write(("(thinking) " if self.section != "reasoning" else "") + value)
            elif kind == "content":
                self.write(value)
            else:  # a call, or a malformed one: each on a line of its own
                self.write("\n" if self.section in ("content", "tool_call", "error") else "")
                self.write(f"[call {value['name']} {value['arguments']}]" if kind == "tool_call"
                           else f"(malformed tool call: {value})")
            self.section = kind


def run_chat(run_dir, system: str | None = None, device: str = _D.device, precision: str = _D.precision,
             tools: str | None = None, think: bool = False, max_tool_turns: int = ChatOptions.max_tool_turns,
             **sampling) -> None:
    """`nanoforge chat RUN`: load the run's latest checkpoint (or a checkpoint directory) and chat on the
    terminal; with piped standard input, answer it once and return. `tools`: "calculator" (comma-separated
    built-in tool names) to offer and run; `think`: open the think block of each reply; `sampling`: fields of
    SamplingConfig that differ from chat's defaults (CHAT_SAMPLING)."""
    cfg = dataclasses.replace(CHAT_SAMPLING, **sampling)
    tool_names = parse_tool_names(tools)
    system = None if system is None else terminal_text(system)
    _replace_undecodable_stdin()
    interactive = sys.stdin.isatty()
    model, tokenizer, _, precision = load_for_inference(run_dir, device, precision, announce=interactive)
    chat_loop(model, tokenizer, cfg, system, sys.stdin, sys.stdout, interactive, precision=precision,
              tools=tool_names, think=think, max_tool_turns=max_tool_turns)


def run_generate(run_dir, prompt: str | None = None, num_samples: int = 1, device: str = _D.device,
                 precision: str = _D.precision, input_stream: TextIO | None = None, out: TextIO | None = None,
                 **sampling) -> None:
    """`nanoforge generate RUN`: continue a plain-text prompt (no chat template), the way a pretrained model
    is meant to be used; the prompt is --prompt, else standard input. An empty prompt samples from the start
    of a document (after <|endoftext|>). Streams each of num_samples continuations to `out`, the prompt first;
    `sampling` as run_chat's, sample i seeded with seed + i."""
    base = dataclasses.replace(CHAT_SAMPLING, **sampling)
    input_stream, out = input_stream or sys.stdin, out or sys.stdout
    if prompt is None:
        if input_stream is sys.stdin:
            _replace_undecodable_stdin()
        prompt = input_stream.read()
    prompt = terminal_text(prompt)
    model, tokenizer, _, precision = load_for_inference(run_dir, device, precision, announce=True)
    ids = tokenizer.encode(prompt) if prompt else []
    if not ids:
        if tokenizer.eos_id is None:
            raise NanoforgeError("the prompt is empty and the tokenizer has no end-of-text token to start from")
        ids = [tokenizer.eos_id]
    room = model.context_length - 1
    if len(ids) > room:
        print(f"note: the prompt has {len(ids)} tokens; the model sees at most {model.context_length}, so it "
              f"continues from the last {room}", file=sys.stderr)
        ids = ids[-room:]
    stops = [t for t in (tokenizer.eos_id, tokenizer.im_start_id) if t is not None]
    for i in range(num_samples):
        if num_samples > 1:
            out.write(f"--- sample {i + 1} of {num_samples}\n")
        cfg = dataclasses.replace(base, seed=None if base.seed is None else base.seed + i)
        out.write(prompt)
        for piece in stream(model, tokenizer, ids, cfg, stops, precision):
            out.write(piece)
            out.flush()
        out.write("\n")
        out.flush()


def terminal_text(text: str) -> str:
    """Text from the command line or standard input with each byte that was not UTF-8 as U+FFFD: Python keeps
    such bytes as lone surrogates (in sys.argv, or on a C locale's stdin), which are not text a tokenizer takes."""
    return LONE_SURROGATE.sub("\ufffd", text)


def _replace_undecodable_stdin() -> None:
    """Read standard input's bytes that are not UTF-8 as U+FFFD, as a terminal shows them, instead of failing
    with a UnicodeDecodeError (or, on a C locale, keeping them as lone surrogates)."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="replace")

