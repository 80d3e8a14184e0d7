"""Options of `nanoforge chat`, shared with `generate` and `serve` (cli.add_option_flags), without torch: `--help`
shows them without loading it; SamplingConfig is how infer/generate.py picks each next token."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from nanoforge.core.config import PRECISIONS, option
from nanoforge.core.errors import NanoforgeError


@dataclass
class SamplingConfig:
    """How to pick each next token. The defaults are plain sampling from the model's distribution.

    temperature         0 picks the most likely token (greedy); otherwise logits are divided by it
    top_k, top_p        keep the k most likely tokens (0: off); the smallest set whose probability adds up to
                        top_p (1.0: off; nucleus sampling, Holtzman et al. 2019, arXiv 1904.09751)
    repetition_penalty  > 1 makes every token seen in prompt or reply less likely (1.0: off): CTRL's penalty
                        (arXiv 1909.05858) as HF applies it, a positive logit divided by it, a negative multiplied
    max_new_tokens      the most tokens per prompt (fewer if the context runs out); stop_strings end the reply,
                        cut before them; seed: a private torch.Generator (None: the global RNG)"""
    temperature: float = option(1.0, "[0, inf)", help="0 is greedy")
    top_k: int = option(0, "[0, inf)", help="0 disables")
    top_p: float = option(1.0, "(0, 1]", help="1.0 disables")
    repetition_penalty: float = option(1.0, "(0, inf)", help="1.0 disables")
    max_new_tokens: int = option(256, "[1, inf)", help="reply length cap")
    stop_strings: list[str] = field(default_factory=list, metadata={"help": "serve's stop", "flag": False})
    seed: int | None = option(None, help="makes sampling reproducible")

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty"):  # NaN would pass the range checks below
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise NanoforgeError(f"{name}={value!r} must be a finite number")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise NanoforgeError(f"temperature={self.temperature!r} must be a number >= 0 (0 means greedy)")
        if not is_int(self.top_k) or self.top_k < 0:
            raise NanoforgeError(f"top_k={self.top_k!r} must be an integer >= 0 (0 turns it off)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise NanoforgeError(f"top_p={self.top_p!r} must be in (0, 1] (1 turns it off)")
        if not isinstance(self.repetition_penalty, (int, float)) or self.repetition_penalty <= 0:
            raise NanoforgeError(f"repetition_penalty={self.repetition_penalty!r} must be > 0 "
                                 f"(1 turns it off; values above 1 discourage repeats)")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise NanoforgeError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if isinstance(self.stop_strings, str):
            raise NanoforgeError(f"stop_strings must be a list of strings, got the string {self.stop_strings!r}; "
                                 f"write [{self.stop_strings!r}]")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise NanoforgeError(f"stop_strings={self.stop_strings!r} must be non-empty strings")
        if self.seed is not None and not is_int(self.seed):
            raise NanoforgeError(f"seed={self.seed!r} must be an integer or None")


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # numpy ints too


# chat's, generate's and serve's defaults (the flags'): a little randomness and a mild repetition penalty keep a
# small model from looping; top-k and top-p cut off its long tail of unlikely tokens.
CHAT_SAMPLING = SamplingConfig(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1)


@dataclass
class DeviceOptions:
    device: str = option("auto", help="auto, cpu, cuda, cuda:N, mps")
    # auto: bf16 where the device computes it natively, else fp32 (core/device.py, as training picks)
    precision: str = option("auto", choices=PRECISIONS, help="inference precision")


@dataclass
class ChatOptions:
    system: str | None = option(None, help="system prompt")
    think: bool = option(False, help="open the think block: the model reasons first, shown apart from its answer (a "
                         "template in MiniMind-3's format)")
    tools: str | None = option(None, metavar="NAME[,NAME]", help="built-in tools to offer and run when the model "
                               "calls them: calculator")
    max_tool_turns: int = option(5, "[1, inf)", help="tool rounds per message before giving up")
