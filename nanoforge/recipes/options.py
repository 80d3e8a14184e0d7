"""The training stages' own options (LoRA's: config.LoraConfig), saved under [run] in config.toml; each field makes
a flag (cli.add_option_flags). No torch here: `--help` shows them without loading it."""
from __future__ import annotations

from dataclasses import dataclass

from nanoforge.core.config import option

@dataclass
class RLOptions:
    """`nanoforge grpo`, with MiniMind's GRPO: 2 prompts x 6 replies, temperature 0.8, beta 0.1, clip 0.2."""
    # policy loss: clipped ratio (grpo), clipped importance weight (cispo), plain policy gradient
    loss: str = option("grpo", choices=["grpo", "cispo", "reinforce"])
    num_generations: int = option(6, "[1, inf)", metavar="G")  # replies sampled per prompt
    prompts_per_step: int = option(2, "[1, inf)", metavar="P")  # prompts per rollout, per process
    beta: float = option(0.1, "[0, inf)")  # weight of the k3 KL to the --init model; 0 skips the reference
    epsilon: float = option(0.2, "(0, inf)")  # ratio clip: [1 - epsilon, 1 + epsilon]
    # upper clip 1 + epsilon_high (DAPO's clip-higher; default: --epsilon)
    epsilon_high: float | None = option(None, "(0, inf)")
    # group advantage: (r - mean) / std, or r - mean
    advantage: str = option("zscore", choices=["zscore", "mean"])
    # average over each reply's tokens then replies, or over all tokens
    loss_norm: str = option("sequence", choices=["sequence", "token"])
    temperature: float = option(0.8, "(0, inf)")  # sampling temperature; log-probs are trained at it too
    # reply length cap; a reply cut there has no stop token
    max_new_tokens: int = option(256, "[1, inf)")
    # optimizer steps on each rollout, so the ratio and clipping act
    ppo_epochs: int = option(1, "[1, inf)", metavar="K")
    # math, format, length, repetition, module:function or path/file.py:function, summed (default: math)
    reward: str | None = option(None, metavar="NAME[,NAME]")
    reward_weights: str | None = option(None, metavar="W[,W]")  # one weight per reward (and the reward model last)
    # a local HF sequence-classification model whose score is added as a reward (never downloaded)
    reward_model: str | None = option(None, metavar="LOCAL_DIR")
    trust_remote_code: bool = option(False)  # let --reward-model run its own Python code
    think: bool = option(False)  # open the think block of every reply (a template in MiniMind-3's format)
    # multi-turn tool use: run the replies' tool calls (built-in: calculator) and train on whole trajectories with
    # the agent reward (records need "gt"; no --reward)
    tools: str | None = option(None, metavar="NAME[,NAME]")
    max_turns: int = option(3, "[1, inf)", metavar="N")  # with --tools: replies per trajectory


@dataclass
class PPOOptions:
    """`nanoforge ppo`, with MiniMind's PPO: 2 epochs per batch, clip 0.2, GAE gamma 1 lambda 0.95, KL penalty."""
    num_generations: int = option(1, "[1, inf)", metavar="G")  # replies sampled per prompt
    prompts_per_step: int = option(8, "[1, inf)", metavar="P")  # prompts per rollout, per process
    temperature: float = option(1.0, "(0, inf)")  # sampling temperature; log-probs are taken at it too
    max_new_tokens: int = option(256, "[1, inf)")  # reply length cap
    ppo_epochs: int = option(2, "[1, inf)", metavar="K")  # optimizer steps on each rollout
    epsilon: float = option(0.2, "(0, inf)")  # ratio clip: [1 - epsilon, 1 + epsilon]
    # per-token KL penalty to the --init model in the rewards; 0 skips the reference
    beta: float = option(0.05, "[0, inf)")
    vf_coef: float = option(0.5, "[0, inf)")  # weight of the value loss
    # how far a value may move from its rollout value before its loss is clipped
    value_clip: float = option(0.2, "(0, inf)")
    gamma: float = option(1.0, "[0, 1]")  # GAE discount
    lam: float = option(0.95, "[0, 1]")  # GAE lambda
    # skip a rollout's remaining epochs once the approximate KL to the sampling policy exceeds this (default: never)
    target_kl: float | None = option(None, "(0, inf)")
    # math, format, length, repetition, module:function or path/file.py:function, summed (default: math)
    reward: str | None = option(None, metavar="NAME[,NAME]")
    reward_weights: str | None = option(None, metavar="W[,W]")  # one weight per reward (and the reward model last)
    # a local HF sequence-classification model whose score is added as a reward (never downloaded)
    reward_model: str | None = option(None, metavar="LOCAL_DIR")
    trust_remote_code: bool = option(False)  # let --reward-model run its own Python code
    think: bool = option(False)  # open the think block of every reply (a template in MiniMind-3's format)


@dataclass
class DPOOptions:
    """`nanoforge dpo`; beta as in the DPO paper (and MiniMind)."""
    beta: float = option(0.1, "(0, inf)")  # strength of the pull towards the reference


@dataclass
class DistillOptions:
    """`nanoforge distill`."""
    temperature: float = option(1.5, "(0, inf)")  # softening of both distributions
    # weight of the data's cross-entropy; 1 - alpha weighs the KL to the teacher
    alpha: float = option(0.5, "[0, 1]")
