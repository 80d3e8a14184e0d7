"""Losses as small functions the loop calls: (model, batch) -> (sum of token losses, supervised tokens, extras).

Returning the SUM lets the loop normalise by the supervised tokens of the whole accumulated batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100  # label value of tokens that carry no loss (prompt, padding)


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]):
    """Next-token cross-entropy over the positions whose label is not IGNORE (pretraining and SFT)."""
    logits = model(batch["input_ids"], segment_ids=batch.get("segment_ids"))  # (B, T, V)
    labels = batch["labels"]  # (B, T)
    # float32 for the softmax: bf16 logits lose the small differences the loss is made of
    loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    n = (labels != IGNORE).sum()
    return (*with_aux_loss(model, loss_sum, n),)


def with_aux_loss(model: nn.Module, loss_sum: torch.Tensor, n: torch.Tensor):
    """Add an MoE model's load-balancing loss, weighted per supervised token so that the loop's normalisation
    turns it into moe_aux_weight * aux; it is also returned on its own for the logs."""
    aux = model.aux_loss() if hasattr(model, "aux_loss") and model.training else None
    if aux is None:  # dense model, or evaluation: validation loss stays the pure language-model loss
        return loss_sum, n, {}
    return loss_sum + model.cfg.moe_aux_weight * aux * n, n, {"moe_aux": aux.detach()}
