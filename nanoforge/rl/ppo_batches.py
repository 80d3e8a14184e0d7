"""PPO's two halves for the one loop (train/stage.py's contract): `PPOBatches`, the batch source that samples a
rollout every --ppo-epochs steps and turns it into rl/ppo_update.py's batch (old log-probs and values, shaped rewards,
GAE), and `ppo_objective`, the loss over it; GRPO's sibling (rl/grpo_batches.py), from the same pieces.

The model is a PolicyWithValue (rl/critic.py): replies are sampled with `model.policy`; the old log-probs and
values come from the combined forward (forward_ppo) in the loss's micro-batches, so in fp32 the first ratio is 1.

Early stopping (--target-kl): before each further epoch over a rollout, one no-grad forward measures the
policy's approximate KL to the one that sampled it (rl/losses.py approx_kl over the reply tokens, averaged over
the ranks); above target_kl the remaining epochs are skipped (Spinning Up's and MiniMind's rule: the check comes
before the update it would stop). The decision depends only on the weights and the saved rollout, so a resumed
run takes the same one."""
from typing import Any

import torch
import torch.nn.functional as F

from nanoforge.core.device import autocast_context, eval_mode
from nanoforge.rl.losses import approx_kl
from nanoforge.rl.options import PPOOptions
from nanoforge.rl.ppo_update import forward_ppo, ppo_batch, ppo_loss, should_stop_early, token_logprobs
from nanoforge.rl.prompts import PromptIterator
from nanoforge.train.stage import Batch
from nanoforge.rl.rollout import RewardFn, sample_scored
from nanoforge.rl.grpo_batches import RolloutBatches
from nanoforge.train import distributed


class PPOBatches(RolloutBatches):
    """BatchSource of `nanoforge ppo`: grpo's RolloutBatches (a rollout every ppo_epochs x grad_accum calls,
    micro-batch call % grad_accum of it, resumable mid-rollout) whose rollouts are ppo_rollout's, and whose
    remaining epochs are skipped when --target-kl says the policy has moved too far."""

    def __init__(self, model, tokenizer, prompts: PromptIterator, ppo: PPOOptions, reward_fn: RewardFn, seed: int,
                 ppo_epochs: int = 2, grad_accum: int = 1, reference=None, precision: str = "fp32"):
        super().__init__(model, tokenizer, prompts, ppo, reward_fn, seed, ppo_epochs, grad_accum, reference,
                         ppo_rollout, precision)
        self.ppo = ppo
        self.early_stops = 0  # rollouts whose epochs --target-kl cut short

    def next_batch(self) -> Batch:
        position = self.calls % self.cycle
        if position and position % self.grad_accum == 0 and self._too_far():
            self.calls += self.cycle - position  # the rest of this rollout's epochs are skipped (counted as made)
            self.early_stops += 1
            position = 0
        batch = super().next_batch()
        batch["stat_ppo_epoch"] = torch.tensor(float(position // self.grad_accum))
        batch["stat_early_stops"] = torch.tensor(float(self.early_stops))
        return batch

    def _too_far(self) -> bool:
        """--target-kl: whether the policy has moved further than target_kl from the one that sampled the
        current rollout (approx KL over this rank's reply tokens, averaged over the ranks)."""
        if self.ppo.target_kl is None:
            return False
        batch = self.current
        logp = gpt_logprobs(self.model.policy, batch["input_ids"], self.ppo.temperature, self.precision,
                            self.micro_rows)
        kl = approx_kl(logp, batch["old_logp"], batch["mask"]).reshape(1).float()
        if self.prompts.world_size > 1:
            kl = distributed.all_reduce_sum(kl.to(next(self.model.parameters()).device)).cpu() / self.prompts.world_size
        return should_stop_early(kl.item(), self.ppo.target_kl)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "early_stops": self.early_stops}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.early_stops = int(state.get("early_stops", 0))


@torch.no_grad()
def gpt_logprobs(gpt, input_ids: torch.Tensor, temperature: float, precision: str, chunk: int) -> torch.Tensor:
    """A plain GPT's per-token log-probs (rl/ppo_update.py token_logprobs, the very computation of the old ones) in eval
    mode without grad, `chunk` rows at a time: (B, L) on the CPU. The reference's, and the current policy's
    for --target-kl (equal weights give exactly the old log-probs)."""
    device = next(gpt.parameters()).device
    with eval_mode(gpt), autocast_context(device, precision):
        return torch.cat([token_logprobs(gpt(part.to(device)), part.to(device), temperature).cpu()
                          for part in input_ids.split(chunk)])


@torch.no_grad()
def old_outputs(model, input_ids: torch.Tensor, temperature: float, precision: str,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """forward_ppo in eval mode without grad, `chunk` rows at a time (the loss's micro-batches, so the same
    shapes give the same numbers): (old_logp, old_values), (B, L) each on the CPU."""
    device = next(model.parameters()).device
    logps, values = [], []
    with eval_mode(model), autocast_context(device, precision):
        for part in input_ids.split(chunk):
            logp, value = forward_ppo(model, part.to(device), temperature)
            logps.append(logp.cpu())
            values.append(value.float().cpu())
    return torch.cat(logps), torch.cat(values)


def ppo_rollout(model, tokenizer, records, ppo: PPOOptions, reward_fn: RewardFn, seed: int, reference=None,
                micro_rows: int | None = None, precision: str = "fp32") -> Batch:
    """A rollout as rl/ppo_update.py's batch: P prompts x G replies sampled by model.policy, scored by reward_fn, the
    old log-probs and values of the combined model, the reference's log-probs when beta > 0, then ppo_batch
    (shaped rewards, GAE, whitening); its figures as stat_* scalars for the log."""
    input_ids, loss_mask, scores, reply_stats = sample_scored(model.policy, tokenizer, records, ppo, reward_fn, seed,
                                                              precision)
    mask = F.pad(loss_mask, (1, 0)).bool()  # per token (rl/ppo_update.py's alignment): 1 on the reply's tokens
    chunk = micro_rows or len(input_ids)
    old_logp, old_values = old_outputs(model, input_ids, ppo.temperature, precision, chunk)
    ref_logp = (gpt_logprobs(reference, input_ids, ppo.temperature, precision, chunk)
                if reference is not None and ppo.beta > 0 else None)
    batch, stats = ppo_batch(input_ids, mask, old_logp, old_values, scores, ppo, ref_logp)
    stats.update({"reward_mean": scores.mean().item(),
                  "reward_std": scores.std().item() if len(scores) > 1 else 0.0, **reply_stats})
    batch.update({f"stat_{k}": torch.tensor(v, dtype=torch.float32) for k, v in stats.items()})
    return batch


def ppo_objective(cfg: PPOOptions):
    """Stage.loss_fn: rl/ppo_update.py ppo_loss on a micro-batch; the rollout's stat_* figures ride along as extras."""
    def loss_fn(model, batch: Batch):
        total, count, extras = ppo_loss(model, batch, cfg)
        extras.update({k[5:]: v for k, v in batch.items() if k.startswith("stat_")})
        return total, count, extras
    return loss_fn
