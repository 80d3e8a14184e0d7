"""Options of `nanoforge chat`, shared with `generate` and `serve` (cli.add_option_flags), without torch: `--help`
shows them without loading it. A little randomness and a mild repetition penalty keep a small model from looping;
top-k and top-p cut off its long tail of unlikely tokens."""
from __future__ import annotations

from dataclasses import dataclass

from nanoforge.core.config import PRECISIONS, option


@dataclass
class SamplingOptions:
    temperature: float = option(0.7, "[0, inf)", help="0 is greedy")
    top_k: int = option(50, "[0, inf)", help="0 disables")
    top_p: float = option(0.9, "(0, 1]", help="1.0 disables")
    repetition_penalty: float = option(1.1, "(0, inf)", help="1.0 disables")
    max_new_tokens: int = option(256, "[1, inf)", help="reply length cap")
    seed: int | None = option(None, help="makes sampling reproducible")


@dataclass
class DeviceOptions:
    device: str = option("auto", help="auto, cpu, cuda, cuda:N, mps")
    # auto: bf16 where the device computes it natively, else fp32 (nanoforge/device.py, as training picks)
    precision: str = option("auto", choices=PRECISIONS, help="inference precision")



@dataclass
class ChatOptions:
    system: str | None = option(None, help="system prompt")
    think: bool = option(False, help="open the think block: the model reasons first, shown apart from its answer (a "
                         "template in MiniMind-3's format)")
    tools: str | None = option(None, metavar="NAME[,NAME]", help="built-in tools to offer and run when the model "
                               "calls them: calculator")
    max_tool_turns: int = option(5, "[1, inf)", help="tool rounds per message before giving up")
