"""Mixture-of-experts feed-forward: a router sends each token to its top-k SwiGLU experts.

Names follow HF Qwen3-MoE (`mlp.gate.weight` for the router, `mlp.experts.{e}.{gate,up,down}_proj.weight`),
so the layout maps onto an existing architecture. Top-k probabilities are renormalised to sum to 1 (Qwen3's
norm_topk_prob), and a load-balancing loss keeps the router from collapsing onto a few experts."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoforge.core.config import ModelConfig
from nanoforge.model.linear import Linear


class MLP(nn.Module):
    """SwiGLU feed-forward (arXiv 2002.05202): down(silu(gate(x)) * up(x)). The dense model's MLP and each
    expert of the MoE are this module."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, C)


def load_balancing_loss(probs: torch.Tensor, topk_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al., arXiv 2101.03961, eq. 4), for top-k routing:
    n_experts * sum_e f_e * P_e, with f_e the share of routing slots that went to expert e and P_e the mean
    router probability of e. It is 1 when routing is uniform and grows as tokens crowd onto few experts.
    probs (N, E) float32, topk_idx (N, k)."""
    counts = torch.zeros(n_experts, device=probs.device, dtype=probs.dtype)
    counts.scatter_add_(0, topk_idx.flatten(), torch.ones(topk_idx.numel(), device=probs.device, dtype=probs.dtype))
    f = counts / topk_idx.numel()  # (E,) share of slots; no gradient, as in the paper
    p = probs.mean(dim=0)  # (E,) differentiable
    return n_experts * (f * p).sum()


class MoE(nn.Module):
    """Top-k routed experts. After each forward, `aux_loss` holds this layer's load-balancing loss."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.k = cfg.n_experts, cfg.experts_per_token
        self.gate = Linear(cfg.d_model, cfg.n_experts, bias=False)  # the router
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))
        self.aux_loss = torch.zeros(())

    @property
    def down_proj(self) -> nn.ModuleList:  # for init: every expert's output projection is scaled
        return nn.ModuleList(e.down_proj for e in self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        probs = F.softmax(self.gate(flat).float(), dim=-1)  # (N, E) routing in float32
        weights, idx = probs.topk(self.k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        self.aux_loss = load_balancing_loss(probs, idx, self.n_experts)
        out = torch.zeros_like(flat)
        # Loop over experts, not tokens: each expert runs one matmul over the tokens routed to it. The
        # (token, slot) pairs are grouped by expert with one stable sort (token order kept within an expert), so
        # the host learns every expert's share with one read per layer instead of one per expert.
        routed = idx.reshape(-1)  # (N*k,) expert of each (token, slot)
        order = torch.argsort(routed, stable=True)  # (N*k,)
        counts = torch.bincount(routed, minlength=self.n_experts).tolist()  # the layer's one host sync
        tokens, slots = order // self.k, order % self.k
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                token, slot = tokens[start:start + n], slots[start:start + n]  # (n_e,), (n_e,)
                y = expert(flat[token]) * weights[token, slot, None].to(flat.dtype)  # (n_e, C)
                out.index_add_(0, token, y.to(out.dtype))
            start += n
        return out.view(B, T, C)  # (N, C) -> (B, T, C)
