"""AdamW with honest parameter groups, and the learning-rate schedules.

Schedules are pure functions of the step, so they need no state in the checkpoint: resuming at step s
gives exactly the lr an uninterrupted run would have used.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from nanoforge.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay only on matrices of Linear layers. Norm gains, biases and embeddings are left alone:
    decaying a gain towards 0 fights the normalisation, and decaying rare tokens' embeddings erases them
    (the usual GPT-2 / nanoGPT split). Tied weights appear once, as the embedding."""
    decay, no_decay, seen = [], [], set()
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # The fused kernel updates every parameter in one pass. Measured here on the 26M model's shapes (2-core
    # CPU): fused 10.6 ms per step, the default per-tensor loop 73 ms, foreach 93 ms. On CUDA it is one launch.
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=1e-8, fused=fused or None)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based).

    cosine:   linear warmup, then cosine from lr to lr*min_lr_ratio at max_steps.
    wsd:      warmup, stable at lr, then linear decay to the minimum over the last `decay_fraction` of the
              steps (warmup-stable-decay, arXiv 2404.06395; lets a run be extended from the stable phase).
    onecycle: linear warmup, then linear decay to the minimum.
    constant: warmup, then lr.
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "onecycle":
        return peak + (floor - peak) * progress
    # wsd
    decay_steps = max(1, round(cfg.decay_fraction * cfg.max_steps))
    decay_start = cfg.max_steps - decay_steps
    if step < decay_start:
        return peak
    return peak + (floor - peak) * min(1.0, (step - decay_start + 1) / decay_steps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
