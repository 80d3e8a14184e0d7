"""The training stages' own options (LoRA's: config.LoraConfig; RL's: rl/options.py), saved under [run] in
config.toml; each field makes a flag (cli.add_option_flags). No torch here: `--help` shows them without loading it."""
from __future__ import annotations

from dataclasses import dataclass

from nanoforge.core.config import option


@dataclass
class DPOOptions:
    """`nanoforge dpo`; beta as in the DPO paper (and MiniMind)."""
    beta: float = option(0.1, "(0, inf)", help="strength of the pull towards the reference")


@dataclass
class DistillOptions:
    """`nanoforge distill`."""
    temperature: float = option(1.5, "(0, inf)", help="softening of both distributions")
    alpha: float = option(0.5, "[0, 1]", help="weight of the data's cross-entropy; 1 - alpha weighs the KL to the "
                          "teacher")
