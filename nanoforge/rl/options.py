"""The options of `nanoforge grpo` and `nanoforge ppo`, one dataclass each, from the flag (cli.add_option_flags) to
the code that reads them; saved under [run] in config.toml. No torch here: `--help` shows them without loading it."""
from __future__ import annotations

from dataclasses import dataclass

from nanoforge.core.config import option
from nanoforge.core.errors import NanoforgeError


# The reward and template options grpo and ppo share: one definition each.
RL_SHARED = {
    "reward": dict(metavar="NAME[,NAME]", help="math, format, length, repetition, module:function or "
                   "path/file.py:function, summed (default: math)"),
    "reward_weights": dict(metavar="W[,W]", help="one weight per reward (and the reward model last)"),
    "reward_model": dict(metavar="LOCAL_DIR", help="a local HF sequence-classification model whose score is added as "
                         "a reward (never downloaded)"),
    "trust_remote_code": dict(default=False, help="let --reward-model run its own Python code"),
    "think": dict(default=False, help="open the think block of every reply (a template in MiniMind-3's format)"),
}


def rl_option(name: str):
    """The field `name` of RL_SHARED, for RLOptions and PPOOptions alike."""
    return option(**RL_SHARED[name])


@dataclass
class RLOptions:
    """`nanoforge grpo`, with MiniMind's GRPO: 2 prompts x 6 replies, temperature 0.8, beta 0.1, clip 0.2."""
    loss: str = option("grpo", choices=["grpo", "cispo", "reinforce"], help="policy loss: clipped ratio (grpo), "
                       "clipped importance weight (cispo), plain policy gradient")
    num_generations: int = option(6, "[1, inf)", metavar="G", help="replies sampled per prompt")
    prompts_per_step: int = option(2, "[1, inf)", metavar="P", help="prompts per rollout, per process")
    beta: float = option(0.1, "[0, inf)", help="weight of the k3 KL to the --init model; 0 skips the reference")
    epsilon: float = option(0.2, "(0, inf)", help="ratio clip: [1 - epsilon, 1 + epsilon]")
    epsilon_high: float | None = option(None, "(0, inf)", help="upper clip 1 + epsilon_high (DAPO's clip-higher; "
                                        "default: --epsilon)")
    advantage: str = option("zscore", choices=["zscore", "mean"], help="group advantage: (r - mean) / std, or r - mean")
    loss_norm: str = option("sequence", choices=["sequence", "token"], help="average over each reply's tokens then "
                            "replies, or over all tokens")
    temperature: float = option(0.8, "(0, inf)", help="sampling temperature; log-probs are trained at it too")
    max_new_tokens: int = option(256, "[1, inf)", help="reply length cap; a reply cut there has no stop token")
    ppo_epochs: int = option(1, "[1, inf)", metavar="K",
                             help="optimizer steps on each rollout, so the ratio and clipping act")
    reward: str | None = rl_option("reward")
    reward_weights: str | None = rl_option("reward_weights")
    reward_model: str | None = rl_option("reward_model")
    trust_remote_code: bool = rl_option("trust_remote_code")
    think: bool = rl_option("think")
    tools: str | None = option(None, metavar="NAME[,NAME]", help="multi-turn tool use: run the replies' tool calls "
                               "(built-in: calculator) and train on whole trajectories with the agent reward (records "
                               "need \"gt\"; no --reward)")
    max_turns: int = option(3, "[1, inf)", metavar="N", help="with --tools: replies per trajectory")

    def validate(self) -> None:
        if self.num_generations < 2:
            raise NanoforgeError(f"--num-generations {self.num_generations}: a group needs at least 2 replies "
                                 "(its advantages are relative to the group's mean)")


@dataclass
class PPOOptions:
    """`nanoforge ppo`, with MiniMind's PPO: 2 epochs per batch, clip 0.2, GAE gamma 1 lambda 0.95, KL penalty."""
    num_generations: int = option(1, "[1, inf)", metavar="G", help="replies sampled per prompt")
    prompts_per_step: int = option(8, "[1, inf)", metavar="P", help="prompts per rollout, per process")
    temperature: float = option(1.0, "(0, inf)", help="sampling temperature; log-probs are taken at it too")
    max_new_tokens: int = option(256, "[1, inf)", help="reply length cap")
    ppo_epochs: int = option(2, "[1, inf)", metavar="K", help="optimizer steps on each rollout")
    epsilon: float = option(0.2, "(0, inf)", help="ratio clip: [1 - epsilon, 1 + epsilon]")
    beta: float = option(0.05, "[0, inf)", help="per-token KL penalty to the --init model in the rewards; 0 skips the "
                         "reference")
    vf_coef: float = option(0.5, "[0, inf)", help="weight of the value loss")
    value_clip: float = option(0.2, "(0, inf)", help="how far a value may move from its rollout value before its loss "
                               "is clipped")
    gamma: float = option(1.0, "[0, 1]", help="GAE discount")
    lam: float = option(0.95, "[0, 1]", help="GAE lambda")
    target_kl: float | None = option(None, "(0, inf)", help="skip a rollout's remaining epochs once the approximate "
                                     "KL to the sampling policy exceeds this (default: never)")
    reward: str | None = rl_option("reward")
    reward_weights: str | None = rl_option("reward_weights")
    reward_model: str | None = rl_option("reward_model")
    trust_remote_code: bool = rl_option("trust_remote_code")
    think: bool = rl_option("think")

    def validate(self) -> None:
        """The checks a flag's interval makes (cli.number), for options that come from elsewhere (a config's [run],
        code); PPO's own loss reads them as they are."""
        for name in ("epsilon", "value_clip", "temperature"):
            if not getattr(self, name) > 0:
                raise NanoforgeError(f"ppo {name}={getattr(self, name)!r} must be > 0")
        if not (self.vf_coef >= 0 and self.beta >= 0 and 0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise NanoforgeError(f"ppo needs vf_coef >= 0, beta >= 0, gamma and lam in [0, 1]; got vf_coef="
                                 f"{self.vf_coef}, beta={self.beta}, gamma={self.gamma}, lam={self.lam}")
        if self.target_kl is not None and not self.target_kl > 0:
            raise NanoforgeError(f"ppo target_kl={self.target_kl!r} must be > 0 (or None: never stop early)")
