"""`nanoforge chat RUN`: talk to a model in the terminal, replies streamed as they are generated.

The conversation is a list of messages rendered with the tokenizer's chat template, the same one SFT trained
on, so the model sees exactly the format it learned. Piped input (`echo hi | nanoforge chat RUN`) is one
message and one reply, for scripts.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Callable, TextIO

import torch

from nanoforge.device import resolve_device
from nanoforge.errors import NanoforgeError
from nanoforge.infer.defaults import (DEFAULT_DEVICE, DEFAULT_MAX_NEW_TOKENS, DEFAULT_PRECISION,
                                     DEFAULT_REPETITION_PENALTY, DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P,
                                     PRECISION_CHOICES)
from nanoforge.infer.generate import SamplingConfig, stream
from nanoforge.loader import load_model

HELP = """commands:
  /reset        forget the conversation (the system prompt stays)
  /system TEXT  set the system prompt and start over (/system alone removes it)
  /help         show this
  /exit         leave (so do Ctrl-D and Ctrl-C)"""


def chat_loop(model, tokenizer, cfg: SamplingConfig, system: str | None, input_stream: TextIO,
              output_stream: TextIO, interactive: bool, precision: str = "fp32",
              on_prompt: Callable[[list[int]], None] | None = None) -> list[dict]:
    """Run a conversation on the given streams; return the messages it ended with.

    Interactive: a `you> ` prompt per line, commands (see HELP), each reply streamed after `bot> `.
    Otherwise: all of `input_stream` is one user message; its reply is printed and the loop returns.
    `on_prompt` is called with the token ids of each rendered prompt before its reply is generated (tests
    use it to see what the model was given).
    """
    session = _Session(model, tokenizer, cfg, system, output_stream, interactive, precision, on_prompt)
    if not interactive:
        text = input_stream.read().strip()
        if not text:
            raise NanoforgeError("no message on standard input; pipe one in, e.g. echo hi | nanoforge chat RUN")
        session.reply(text, prefix="")
        return session.messages

    session.write("nanoforge chat: type a message, /help for commands, /exit to leave\n")
    try:
        while True:
            line = _read_line(input_stream, session, "you> ")
            if not line:  # end of input: Ctrl-D
                session.write("\n")
                return session.messages
            line = line.strip()
            if line.startswith("/"):
                if not session.command(line):
                    return session.messages
            elif line:
                session.reply(line, prefix="bot> ")
    except KeyboardInterrupt:  # Ctrl-C anywhere but inside a reply (which it only cuts short) ends the chat
        session.write("\n")
        return session.messages


def _read_line(input_stream: TextIO, session: "_Session", prompt: str) -> str:
    """One line of input, "" at the end. On the real terminal through input(), which with the readline
    module gives line editing and history (arrow keys, and backspace over a wide Chinese character)."""
    if input_stream is sys.stdin and sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (importing it is what turns editing on; absent on Windows)
        except ImportError:
            pass
        try:
            return input(prompt) + "\n"
        except EOFError:
            return ""
    session.write(prompt)
    return input_stream.readline()


class _Session:
    """One conversation: its messages, how to render them within the model's context, and its output."""

    def __init__(self, model, tokenizer, cfg: SamplingConfig, system: str | None, out: TextIO, interactive: bool,
                 precision: str, on_prompt: Callable[[list[int]], None] | None):
        self.model, self.tokenizer, self.cfg, self.out = model, tokenizer, cfg, out
        self.interactive = interactive
        self.precision, self.on_prompt = precision, on_prompt
        self.system = system or None
        self.messages: list[dict] = self._fresh()
        # <|im_start|> too: a model that opens a new turn has finished its own, and the user should not see
        # it write the next user message.
        self.stop_ids = [t for t in (tokenizer.eos_id, tokenizer.im_end_id, tokenizer.im_start_id) if t is not None]
        context = model.model.rotary_emb.n_positions
        # Keep room for a full reply, but never more than half the context: a tiny model with 128 positions
        # and the default 256 new tokens would otherwise have no room for the question.
        self.reply_room = min(cfg.max_new_tokens, context // 2)
        self.prompt_budget = context - self.reply_room
        self.said_dropping = False
        self.turns = 0

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
            self.write("(system prompt set; conversation cleared)\n" if self.system
                       else "(system prompt removed; conversation cleared)\n")
        elif name == "/help":
            self.write(HELP + "\n")
        else:
            self.write(f"unknown command {name}; /help lists the commands\n")
        return True

    def reply(self, text: str, prefix: str) -> None:
        """Add the user's message, generate and print the reply, add it to the history."""
        self.messages.append({"role": "user", "content": text})
        ids = self._prompt_that_fits()
        if ids is None:
            return
        if self.on_prompt is not None:
            self.on_prompt(ids)
        self.write(prefix)
        pieces = []
        self.turns += 1
        cfg = self.cfg
        if cfg.seed is not None:  # the session is reproducible, but each turn draws fresh random numbers
            cfg = dataclasses.replace(cfg, seed=cfg.seed + self.turns - 1)
        try:
            for piece in stream(self.model, self.tokenizer, ids, cfg, self.stop_ids, self.precision):
                pieces.append(piece)
                self.write(piece)
        except KeyboardInterrupt:  # Ctrl-C during a reply stops the reply, not the chat
            self.write(" (interrupted)")
        self.write("\n")
        self.messages.append({"role": "assistant", "content": "".join(pieces)})

    def _prompt_that_fits(self) -> list[int] | None:
        """The rendered prompt, after dropping the oldest user/assistant pairs until it fits the context
        with room for the reply. None (and a note) when the new message is too long even on its own; the
        history is then left as it was."""
        first = 1 if self.system else 0
        alone, _ = self.tokenizer.render_chat(self.messages[:first] + self.messages[-1:], add_generation_prompt=True)
        if len(alone) > self.prompt_budget:
            self.messages.pop()
            self._too_long(len(alone))
            return None
        while True:
            ids, _ = self.tokenizer.render_chat(self.messages, add_generation_prompt=True)
            if len(ids) <= self.prompt_budget:
                return ids
            if not self.said_dropping:
                self.write(f"(the conversation no longer fits the model's context of "
                           f"{self.prompt_budget + self.reply_room} tokens with room for a "
                           f"{self.reply_room}-token reply: dropping the oldest turns from now on)\n")
                self.said_dropping = True
            del self.messages[first:first + 2]

    def _too_long(self, n_tokens: int) -> None:
        message = (f"this message makes a prompt of {n_tokens} tokens, but the model has room for "
                   f"{self.prompt_budget} (its context of {self.prompt_budget + self.reply_room} minus "
                   f"{self.reply_room} for the reply); send a shorter one, or lower --max-new-tokens")
        if not self.interactive:
            raise NanoforgeError(message)
        self.write(f"({message})\n")  # in a session the user can simply try again


def run_chat(run_dir, temperature: float = DEFAULT_TEMPERATURE, top_k: int = DEFAULT_TOP_K,
             top_p: float = DEFAULT_TOP_P, repetition_penalty: float = DEFAULT_REPETITION_PENALTY,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, system: str | None = None, seed: int | None = None,
             device: str = DEFAULT_DEVICE, precision: str = DEFAULT_PRECISION) -> None:
    """`nanoforge chat RUN`: load the run's latest checkpoint (or a checkpoint directory) and chat on the
    terminal; with piped standard input, answer it once and return."""
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                         max_new_tokens=max_new_tokens, seed=seed)
    target = resolve_device(device)
    precision = resolve_precision(precision, target)
    model, tokenizer, checkpoint = load_model(run_dir, device=target)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"loaded {checkpoint} ({model.num_params() / 1e6:.1f}M parameters) on {target}, {precision}",
              file=sys.stderr)
    chat_loop(model, tokenizer, cfg, system, sys.stdin, sys.stdout, interactive, precision=precision)


def run_generate(run_dir, prompt: str | None = None, num_samples: int = 1, temperature: float = DEFAULT_TEMPERATURE,
                 top_k: int = DEFAULT_TOP_K, top_p: float = DEFAULT_TOP_P,
                 repetition_penalty: float = DEFAULT_REPETITION_PENALTY,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, seed: int | None = None,
                 device: str = DEFAULT_DEVICE, precision: str = DEFAULT_PRECISION,
                 input_stream: TextIO | None = None, out: TextIO | None = None) -> None:
    """`nanoforge generate RUN`: continue a plain-text prompt (no chat template), the way a pretrained model
    is meant to be used; the prompt is --prompt, else standard input. An empty prompt samples from the start
    of a document (after <|endoftext|>). Streams each of num_samples continuations to `out`, the prompt first."""
    input_stream, out = input_stream or sys.stdin, out or sys.stdout
    if num_samples < 1 or max_new_tokens < 1:
        raise NanoforgeError(f"--num-samples {num_samples} and --max-new-tokens {max_new_tokens} must be >= 1")
    if prompt is None:
        prompt = input_stream.read()
    target = resolve_device(device)
    precision = resolve_precision(precision, target)
    model, tokenizer, checkpoint = load_model(run_dir, device=target)
    ids = tokenizer.encode(prompt) if prompt else []
    if not ids:
        if tokenizer.eos_id is None:
            raise NanoforgeError("the prompt is empty and the tokenizer has no end-of-text token to start from")
        ids = [tokenizer.eos_id]
    room = model.cfg.max_seq_len - 1
    if len(ids) > room:
        print(f"note: the prompt has {len(ids)} tokens; the model sees at most {model.cfg.max_seq_len}, so it "
              f"continues from the last {room}", file=sys.stderr)
        ids = ids[-room:]
    stop_ids = [t for t in (tokenizer.eos_id, tokenizer.im_start_id) if t is not None]
    for i in range(num_samples):
        if num_samples > 1:
            out.write(f"--- sample {i + 1} of {num_samples}\n")
        cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                             repetition_penalty=repetition_penalty, max_new_tokens=max_new_tokens,
                             seed=None if seed is None else seed + i)
        out.write(prompt)
        for piece in stream(model, tokenizer, ids, cfg, stop_ids, precision):
            out.write(piece)
            out.flush()
        out.write("\n")
        out.flush()


def resolve_precision(precision: str, device) -> str:
    """Turn "auto" into bf16 on a CUDA GPU that supports it, else fp32; check and keep any other choice."""
    if precision not in PRECISION_CHOICES:
        raise NanoforgeError(f"--precision {precision!r} is not one of {', '.join(PRECISION_CHOICES)}")
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:  # native bf16 (not emulated)
        return "bf16"
    return "fp32"
