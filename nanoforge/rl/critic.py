"""PPO's critic and the one module the loop trains for PPO: the policy and its value model side by side.

`ValueModel` is a GPT trunk (its `lm_head` the identity, so GPT.forward's masks and packing apply and there is
no vocabulary-sized matrix) with Linear(d_model, 1) on the final hidden states, starting as its own copy of the
policy's weights (as MiniMind's PPO does): it reads prompts as the policy does and never moves the policy.
`PolicyWithValue` holds both, so one optimizer, gradient clip, checkpoint and DDP forward cover both; its forward
returns (logits, values). Its checkpoint (`state_dict_for_save`) is the policy's own keys, exactly a GPT's, plus
the critic's under `critic.`:

    model.embed_tokens.weight, model.layers.{i}...., lm_head.weight (untied only)   the policy
    critic.trunk.model.embed_tokens.weight, critic.trunk.model.layers.{i}....       the critic's trunk
    critic.head.weight (1, d_model), critic.head.bias (1,)                          the value head

so `policy_weights` (dropping the `critic.` keys) turns a PPO checkpoint into a GPT's; generation uses `.policy`."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from nanoforge.core.config import ModelConfig
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.gpt import GPT, check_same_tensors

CRITIC_PREFIX = "critic."


class ValueModel(nn.Module):
    """A critic: input_ids (B, T) -> values (B, T) float32, V at position t being the value of the state that
    ends with token t (the prefix ids[:, :t+1]).

    The head's weight starts at N(0, (init_std / sqrt(d_model))^2) and its bias at 0: the final norm's output
    has an RMS of about 1 per channel, so the first values are about init_std (0.02) whatever the width, and the
    trunk gets a gradient from the first step (a zero head would block it until the head had moved)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.trunk = GPT(cfg)
        self.trunk.lm_head = nn.Identity()  # GPT.forward ends in lm_head(norm(x)): here the hidden state itself
        self.head = nn.Linear(cfg.d_model, 1)
        nn.init.normal_(self.head.weight, mean=0.0, std=cfg.init_std / math.sqrt(cfg.d_model))
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: GPT) -> ValueModel:
        """A critic whose trunk is a copy of the policy's weights (its output head left out), on the
        policy's device and in its dtype."""
        if not isinstance(policy, GPT):
            raise NanoforgeError(f"a critic is built from a GPT, got a {type(policy).__name__} "
                                 "(merge LoRA adapters first)")
        weight = policy.model.embed_tokens.weight
        critic = cls(policy.cfg).to(device=weight.device, dtype=weight.dtype)
        trunk = {k: v for k, v in policy.state_dict().items() if not k.startswith("lm_head.")}
        critic.trunk.load_state_dict(trunk, strict=True)  # copies: the two never share a tensor
        return critic

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.trunk(input_ids, attention_mask=attention_mask, segment_ids=segment_ids)  # (B, T, C)
        return self.head(hidden).squeeze(-1).float()  # (B, T)

    def flops_per_token(self, seq_len: int) -> float:
        """GPT's convention (6 N + 12 L d T) with N = the trunk's non-embedding parameters plus the head."""
        cfg = self.trunk.cfg
        n = sum(p.numel() for p in self.parameters()) - self.trunk.model.embed_tokens.weight.numel()
        if cfg.n_experts:  # only experts_per_token of the n_experts run for each token
            n -= cfg.n_layers * (cfg.n_experts - cfg.experts_per_token) * 3 * cfg.d_model * cfg.ffn_dim
        return 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * seq_len

    def aux_loss(self) -> torch.Tensor | None:
        return self.trunk.aux_loss()

    def state_dict_for_save(self) -> dict[str, torch.Tensor]:
        return self.state_dict()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Strict: exactly this critic's keys and shapes, or a NanoforgeError naming the offending keys."""
        check_same_tensors(self.state_dict(), state_dict, "checkpoint", "critic weights do not match the model")
        self.load_state_dict(state_dict, strict=True)


class PolicyWithValue(nn.Module):
    """The policy (a GPT) and its critic (a ValueModel) as one trainable model (model/interface.py's
    TrainableModel): forward(input_ids) -> (logits (B, T, V), values (B, T) float32)."""

    def __init__(self, policy: GPT, critic: ValueModel):
        super().__init__()
        self.policy, self.critic = policy, critic

    @classmethod
    def from_policy(cls, policy: GPT) -> PolicyWithValue:
        """A PPO run's start: the policy as given and a critic copied from its weights."""
        return cls(policy, ValueModel.from_policy(policy))

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> PolicyWithValue:
        """Fresh modules of the right shapes, to `load_weights` a PPO checkpoint into (resume, reload)."""
        return cls(GPT(cfg), ValueModel(cfg))

    @property
    def cfg(self) -> ModelConfig:
        return self.policy.cfg

    @property
    def activation_checkpointing(self) -> bool:
        return self.policy.activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        self.policy.activation_checkpointing = self.critic.trunk.activation_checkpointing = on

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.policy(input_ids, attention_mask=attention_mask, segment_ids=segment_ids),  # (B, T, V)
                self.critic(input_ids, attention_mask=attention_mask, segment_ids=segment_ids))  # (B, T)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.policy.model.embed_tokens.weight.numel() + self.critic.trunk.model.embed_tokens.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        return self.policy.flops_per_token(seq_len) + self.critic.flops_per_token(seq_len)

    def aux_loss(self) -> torch.Tensor | None:
        """MoE load-balancing loss: the mean of the policy's and the critic's (None for dense models)."""
        policy_aux, critic_aux = self.policy.aux_loss(), self.critic.aux_loss()
        return None if policy_aux is None else (policy_aux + critic_aux) / 2

    def state_dict_for_save(self) -> dict[str, torch.Tensor]:
        critic = {CRITIC_PREFIX + k: v for k, v in self.critic.state_dict_for_save().items()}
        return {**self.policy.state_dict_for_save(), **critic}

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Both halves strictly. A checkpoint without the critic (a plain GPT's) is refused: start a PPO run
        from one with `from_policy`, which builds the critic from it."""
        critic = {k[len(CRITIC_PREFIX):]: v for k, v in state_dict.items() if k.startswith(CRITIC_PREFIX)}
        if not critic:
            raise NanoforgeError("checkpoint does not match the model: it has no critic (no 'critic.' keys); "
                                 "a PPO model loads a PPO checkpoint, or starts from a policy's weights")
        self.policy.load_weights(policy_weights(state_dict))
        self.critic.load_weights(critic)


def policy_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PPO checkpoint's weights -> the policy's alone, a plain GPT checkpoint's (chat, eval, export)."""
    return {k: v for k, v in state_dict.items() if not k.startswith(CRITIC_PREFIX)}
