"""AdamW with honest parameter groups, an optional Muon for the weight matrices, and the learning-rate
schedules.

Schedules are pure functions of the step (and, with a time budget, of the training seconds spent, which the
run state keeps), so resuming at step s gives exactly the lr an uninterrupted run would have used (with a time
budget: the same schedule, not the same steps). A group may carry an "lr_scale": set_lr gives
it the schedule's lr times that (Muon's matrices run at muon_lr while the rest run at lr)."""
import math

import torch
from torch.optim.adamw import adamw as adamw_update
from torch import nn

from nanoforge.core.config import TrainConfig


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


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    # The fused kernel updates every parameter in one pass. Measured here on the 26M model's shapes (2-core
    # CPU): fused 10.6 ms per step, the default per-tensor loop 73 ms, foreach 93 ms. On CUDA it is one launch.
    fused = device.type in ("cuda", "cpu")
    if cfg.optimizer == "muon":
        return MuonAdamW(model, cfg, fused=fused)
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=1e-8, fused=fused or None)


def lr_at(step: int, cfg: TrainConfig, seconds: float = 0.0) -> float:
    """Learning rate for optimizer step `step` (0-based), `seconds` into training.

    cosine:   linear warmup, then cosine from lr to lr*min_lr_ratio at max_steps.
    wsd:      warmup, stable at lr, then linear decay to the minimum over the last `decay_fraction` of the
              steps (warmup-stable-decay, arXiv 2404.06395; lets a run be extended from the stable phase).
    onecycle: linear warmup, then linear decay to the minimum.
    constant: warmup, then lr.
    With a time_budget, progress is max(seconds / time_budget, step / max_steps): it ends with the budget."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    if cfg.time_budget:
        progress = min(1.0, max(seconds / cfg.time_budget, step / cfg.max_steps))
        decayed = (progress - 1.0 + cfg.decay_fraction) / max(cfg.decay_fraction, 1e-9)  # wsd: share of its decay
    else:
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        decay_steps = max(1, round(cfg.decay_fraction * cfg.max_steps))
        decayed = (step - cfg.max_steps + decay_steps + 1) / decay_steps
    if cfg.schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "onecycle":
        return peak + (floor - peak) * progress
    return peak + (floor - peak) * min(1.0, max(0.0, decayed))  # wsd


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


# ---------------------------------------------------------------------------------------------- Muon

# Coefficients (a, b, c) of the quintic Newton-Schulz step X <- aX + b(XX^T)X + c(XX^T)^2 X from Keller
# Jordan's Muon write-up (2024): chosen to push every singular value in (0, 1] quickly towards ~1 (into about
# [0.7, 1.2] after 5 steps) rather than to converge exactly, which the update does not need.
_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximately U V^T for g = U S V^T (every singular value mapped to ~1), by Newton-Schulz iteration; g is
    one matrix (r, c) or a stack of them (n, r, c), each orthogonalised on its own.

    Only matrix products, so it is fast on any device. Computed in float32 (the reference runs it in bf16 on
    GPU; on CPU float32 is as fast for these sizes and keeps resumes bit-exact on any backend)."""
    a, b, c = _NS_COEFFS
    x = g.float()
    wide = x.size(-2) > x.size(-1)
    if wide:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1: inside the basin
    for _ in range(steps):
        gram = x @ x.mT  # (..., r, r), r = min(rows, cols)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if wide else x


def muon_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(hidden weight matrices, everything else). Muon is for the 2-D weights inside the network; the
    embedding and the output head are not hidden matrices (one row per token, updated sparsely / scored
    against all tokens) and stay with AdamW, as do norm gains and biases (Jordan 2024; Liu et al., arXiv 2502.16982)."""
    head = getattr(model, "lm_head", None)
    outside = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    if isinstance(head, nn.Linear):
        outside.add(id(head.weight))
    matrices, rest, seen = [], [], set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            is_matrix = isinstance(module, nn.Linear) and p is module.weight and id(p) not in outside
            (matrices if is_matrix else rest).append(p)
    return matrices, rest


class MuonAdamW(torch.optim.Optimizer):
    """Muon (MomentUm Orthogonalized by Newton-Schulz) for the hidden weight matrices, AdamW for the rest,
    as one optimizer: one state_dict, one param_groups list for set_lr, one step.

    Muon, per matrix W with gradient G (Jordan 2024; Liu et al., arXiv 2502.16982):
        M <- mu M + G;  U = orthogonalize(G + mu M)  (Nesterov);  W <- W (1 - lr wd) - lr sqrt(max(1, rows/cols)) U
    The orthogonalised update has every singular value ~1, so all directions of the matrix move at the same
    rate instead of the few that dominate the raw gradient. sqrt(max(1, rows/cols)) keeps the update's RMS
    comparable for tall matrices. Groups carry "kind" ("muon" or "adamw") and "lr_scale" (muon_lr / lr for
    the matrices), so the schedule scales both."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, fused: bool = True):
        matrices, rest = muon_params(model)
        rest_ids = {id(p) for p in rest}
        adam_groups = [{**g, "params": [p for p in g["params"] if id(p) in rest_ids]}
                       for g in param_groups(model, cfg.weight_decay)]
        groups = [{"params": matrices, "kind": "muon", "lr_scale": cfg.muon_lr / cfg.lr,
                   "weight_decay": cfg.weight_decay}]
        groups += [{**g, "kind": "adamw", "lr_scale": 1.0} for g in adam_groups]
        defaults = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, weight_decay=0.0,
                        momentum=cfg.muon_momentum, ns_steps=5, fused=fused)
        super().__init__([g for g in groups if g["params"]], defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        """Matrices of one shape go through Newton-Schulz as one stack: 15 batched products per shape instead of 15
        small ones per matrix (the speedrun's 28 matrices are 4 shapes: its optimizer step 25 -> 21 ms on 2 cores)."""
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        by_shape: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            by_shape.setdefault(tuple(p.shape), []).append(p)
        for (rows, cols), params in by_shape.items():
            grads, bufs = [p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params]
            torch._foreach_mul_(bufs, mu)
            torch._foreach_add_(bufs, grads)
            updates = orthogonalize(torch.stack(torch._foreach_add(grads, bufs, alpha=mu)), group["ns_steps"])
            if wd:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            torch._foreach_add_(params, list(updates.to(params[0].dtype).unbind(0)),
                                alpha=-lr * max(1.0, rows / cols) ** 0.5)

    def _adamw_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:  # the same state layout as torch.optim.AdamW
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        adamw_update(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                     [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], fused=group["fused"] or None,
                     amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                     eps=group["eps"], maximize=False)
