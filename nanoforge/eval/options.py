"""`nanoforge eval`'s options: each field makes its flag (cli.add_option_flags: type, default, the comment as
help) and run_eval reads them from here. No torch here, so that `--help` shows them without loading it."""
from __future__ import annotations

from dataclasses import dataclass

from nanoforge.core.config import PRECISIONS, option


@dataclass
class EvalOptions:
    data: list[str] | None = option(None, nargs="+", metavar="PATH", help="pretraining or SFT JSONL files, or a "
                                    "prepared directory (default, when no --bench or --samples: the whole validation "
                                    "split of the data the run trained on)")
    split: str | None = option(None, choices=["all", "train", "val"], help="split of a prepared directory to score "
                               "(default: all; val for the run's own data)")
    bench: str | None = option(None, metavar="PATH", help="multiple-choice benchmark: a C-Eval/CMMLU folder or CSV, "
                               "or JSONL")
    format: str = option("auto", choices=["auto", "jsonl", "ceval", "cmmlu", "csv"], help="benchmark format")
    shots: int = option(0, "[0, inf)", help="solved examples before each question (from the dev split)")
    dev: str | None = option(None, metavar="FILE", help="dev examples for --shots with a JSONL benchmark")
    gsm8k: str | None = option(None, metavar="FILE", help="GSM8K JSONL ({\"question\", \"answer\" ending \"#### "
                               "N\"}): accuracy of greedy generated answers")
    toolcall: str | None = option(None, metavar="FILE", help="SFT JSONL with tool calls: parse, valid-call and "
                                  "call-match rates of the first reply, and answer accuracy with the built-in tools "
                                  "run")
    tools: str | None = option(None, metavar="NAMES", help="built-in tools --gsm8k may call (calculator)")
    think: bool = option(False, help="open the think block in --gsm8k/--toolcall prompts")
    max_new_tokens: int = option(256, "[1, inf)", metavar="N", help="tokens per reply for --gsm8k/--toolcall")
    max_turns: int = option(4, "[1, inf)", metavar="N", help="replies per problem for --gsm8k/--toolcall (each reply "
                            "that calls tools costs one)")
    limit: int | None = option(None, "[1, inf)", help="score at most this many questions")
    samples: bool = option(False, help="generate replies to a fixed prompt set")
    prompts: str | None = option(None, metavar="FILE", help="prompts for --samples, one per line")
    chat: bool = option(False, help="render sample prompts with the chat template")
    batch_size: int = option(8, "[1, inf)", help="sequences per forward")
    seq_len: int | None = option(None, "[1, inf)", help="window length (default: the model's max_seq_len, at most "
                                   "2048)")
    max_tokens: int | None = option(None, "[1, inf)", help="stop after scoring this many tokens")
    precision: str = option("auto", choices=PRECISIONS, help="inference precision")
    device: str = option("auto", help="auto, cpu, cuda, cuda:N, mps")
    no_write: bool = option(False, help="do not write RUN/samples.jsonl")
    json: str | None = option(None, metavar="FILE", help="also write the results as JSON")
    quiet: bool = option(False, help="no progress")
