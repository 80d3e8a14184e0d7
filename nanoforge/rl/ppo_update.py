"""PPO on rollouts (Schulman et al. 2017, arXiv 1707.06347), as RLHF runs it (Ziegler et al. 2019,
arXiv 1909.08593; Ouyang et al. 2022; MiniMind's train_ppo.py): a value head, the KL to the reference folded
into per-token rewards, GAE, the clipped surrogate, a clipped value loss, early stopping on approximate KL.

Alignment: every (B, T) tensor here has one entry per token of `input_ids`. Entry t of a log-prob is
log p(ids[t] | ids[:t]) at the sampling temperature, and entry t of a value is the critic's V(ids[:t]), the
value of the state in which token t was chosen (read from position t - 1's hidden state); both are 0 at t = 0,
which is always prompt. `mask` is 1 on the tokens the policy wrote (rl/agent.py's mask: each reply and its
stop token; 0 on the prompt, tool results and padding), and only those are PPO's steps.

One batch of rollouts is trained in two parts:
  1. once, when it is sampled: `forward_ppo` (no grad) gives old_logp and old_values, the reference gives
     ref_logp, and `ppo_batch` turns the sequence scores into per-token rewards, GAE advantages (whitened) and
     returns: constants of the batch for every epoch and micro-batch (the whitening sees the whole batch).
  2. each update (`--ppo-epochs` of them): `ppo_loss`, the loss the one loop calls, returning (sum, count,
     extras). Before each further epoch rl/ppo_batches.py asks `should_stop_early(approx_kl, target_kl)`."""
import torch
import torch.nn.functional as F
from torch import nn

from nanoforge.rl.losses import approx_kl, gae, loss_count, masked_mean, policy_loss, value_loss
from nanoforge.rl.options import PPOOptions
from nanoforge.train.objectives import with_aux_loss
from nanoforge.train.stage import Batch


# PPO's loss normalisation (rl/losses.normalise): over all masked tokens of the step
PPO_NORM = "token"


# ------------------------------------------------------------------------------------- model outputs per token

def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (B, T, V), input_ids (B, T) -> (B, T) float32, entry t = log softmax(logits[:, t-1] / temp)[ids[t]],
    entry 0 = 0. float32 for the softmax: a ratio exp(logp - old_logp) near 1 is what PPO measures."""
    logp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # (B, T-1, V)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return F.pad(picked, (1, 0))  # (B, T)


def forward_ppo(model: nn.Module, input_ids: torch.Tensor, temperature: float = 1.0,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A PolicyWithValue's (logp, values), each (B, T) per token (see the module docstring). Used both at
    rollout time (under no_grad: old_logp, old_values) and in the loss, so the two are computed alike."""
    logits, values = model(input_ids, attention_mask=attention_mask)  # (B, T, V), (B, T) per position
    # values per token: entry t = V(ids[:t]) = values[:, t-1], entry 0 = 0
    return token_logprobs(logits, input_ids, temperature), F.pad(values[:, :-1].float(), (1, 0))


# --------------------------------------------------------------------------------- rewards, advantages, returns

def place_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scores (B,) -> (B, T): each row's score on its last masked token, 0 elsewhere (and all 0 for a row with
    no masked token)."""
    m = mask.bool()
    T = m.shape[1]
    last = T - 1 - m.flip(1).int().argmax(dim=1)  # (B,) index of the last masked token
    onehot = F.one_hot(last, T).bool() & m.any(dim=1, keepdim=True)  # (B, T)
    return torch.where(onehot, scores.float()[:, None], torch.zeros(m.shape, device=scores.device))


def shaped_rewards(scores: torch.Tensor, mask: torch.Tensor, old_logp: torch.Tensor,
                   ref_logp: torch.Tensor | None, beta: float) -> torch.Tensor:
    """Per-token rewards (B, T), the classic RLHF shape (Ziegler et al. 2019; TRL's PPO; MiniMind):

        r_t = -beta (old_logp_t - ref_logp_t)   on every masked token t     (k1, the sampled log-ratio)
            + score                             on the row's last masked token

    so the penalty's sum over a reply is beta times the sampled estimate of KL(policy || reference) of the
    whole reply, paid token by token where it was incurred. ref_logp None or beta 0: the score alone."""
    rewards = place_scores(scores, mask)
    if ref_logp is not None and beta > 0:
        m = mask.bool()
        log_ratio = torch.where(m, old_logp.float() - ref_logp.float(), torch.zeros_like(rewards))
        rewards = rewards - beta * log_ratio
    return rewards


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries, std the population one (divides by their number);
    0 where mask is 0. Whitened per batch, advantages keep one scale whatever the rewards' size."""
    m = mask.bool()
    mean = masked_mean(x, m)
    std = masked_mean((x - mean) ** 2, m).sqrt()
    return torch.where(m, (x - mean) / (std + eps), torch.zeros_like(x))


@torch.no_grad()
def ppo_batch(input_ids: torch.Tensor, mask: torch.Tensor, old_logp: torch.Tensor, old_values: torch.Tensor,
              scores: torch.Tensor, cfg: PPOOptions, ref_logp: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None, whitened: bool = True) -> tuple[Batch, dict[str, float]]:
    """A batch of rollouts -> what `ppo_loss` trains on, and the batch's statistics to log.

    rewards (shaped_rewards) -> GAE(gamma, lam) with the OLD values (rl.losses.gae): advantages and
    returns R_t = A_t + V_old_t. The advantages are whitened over the batch's masked tokens (unless
    `whitened` is False);
    the returns (the critic's targets) are not. All (B, T) tensors are per token (module docstring)."""
    m = mask.bool()
    rewards = shaped_rewards(scores, m, old_logp, ref_logp, cfg.beta)
    advantages, returns = gae(rewards, old_values, m, cfg.gamma, cfg.lam)
    if whitened:
        advantages = whiten(advantages, m)
    batch = {"input_ids": input_ids, "mask": m, "old_logp": old_logp.float(), "old_values": old_values.float(),
             "advantages": advantages, "returns": returns}
    if attention_mask is not None:
        batch["attention_mask"] = attention_mask
    stats = {"score_mean": scores.float().mean().item(), "return_mean": masked_mean(returns, m).item(),
             "value_mean": masked_mean(old_values.float(), m).item()}
    if ref_logp is not None:
        stats["kl_ref"] = masked_mean(old_logp.float() - ref_logp.float(), m).item()  # per token, k1
    return batch, stats


# ------------------------------------------------------------------------------------------------------ the loss

def ppo_loss(model: nn.Module, batch: Batch, cfg: PPOOptions):
    """The loss of one PPO update on a `ppo_batch` batch, for the one loop: (sum, count, extras).

        loss = policy_loss(clipped surrogate, per-token advantages, epsilon) + vf_coef value_loss(clip)

    both normalised by PPO_NORM over the same masked tokens, so their sums add under one count. No KL term:
    the KL to the reference is already in the rewards. extras: approx_kl (old || current), clip_fraction,
    value_clip_fraction, explained_variance, policy_loss and value_loss (each per its count), ratio."""
    m = batch["mask"].bool()
    logp, values = forward_ppo(model, batch["input_ids"], cfg.temperature, batch.get("attention_mask"))
    p_sum, count, p_extras = policy_loss(logp, batch["old_logp"], batch["advantages"], m, loss="grpo",
                                         epsilon=cfg.epsilon, norm=PPO_NORM)
    v_sum, _, v_extras = value_loss(values, batch["old_values"], batch["returns"], m, clip=cfg.value_clip,
                                    norm=PPO_NORM)
    loss_sum, count, aux = with_aux_loss(model, p_sum + cfg.vf_coef * v_sum, count)
    n = count.clamp(min=1)
    return loss_sum, count, {**p_extras, **v_extras, **aux, "approx_kl": approx_kl(logp.detach(), batch["old_logp"], m),
                             "explained_variance": explained_variance(values.detach(), batch["returns"], m),
                             "policy_loss": p_sum.detach() / n, "value_loss": v_sum.detach() / n}


def ppo_count(batch: Batch, norm: str = PPO_NORM) -> torch.Tensor:
    """The stage's count_fn: what a step's loss is divided by (rl.losses.loss_count over the batch's mask)."""
    return loss_count(batch["mask"], norm)


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 for a critic that predicts every return, 0 for one
    no better than the mean, negative for worse. 0 when the returns do not vary (nothing to explain)."""
    m = mask.bool()
    v, r = values.float(), returns.float()
    var_r = masked_mean((r - masked_mean(r, m)) ** 2, m)
    err = r - v
    var_err = masked_mean((err - masked_mean(err, m)) ** 2, m)
    return torch.where(var_r > 0, 1 - var_err / var_r.clamp(min=1e-12), torch.zeros_like(var_r))


def should_stop_early(approx_kl_value: float | torch.Tensor, target_kl: float | None) -> bool:
    """Stop the remaining PPO epochs over this batch once approx_kl > target_kl: the policy has moved so far from
    the one that sampled the batch that its advantages no longer describe it (MiniMind, OpenAI Spinning Up;
    the latter compares with 1.5 target_kl, which a caller gets by passing that). None: never stop."""
    return target_kl is not None and float(approx_kl_value) > target_kl
