"""LoRA adapters (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685).

A frozen projection W (out, in) learns only a low-rank update: y = W x + (alpha / r) * B A dropout(x), with A (r, in)
and B (out, r). B starts at zero, so the adapted model is exactly the base model until the first step. Only A and B
are trained, so AdamW's state shrinks 22x for rank 16 on every projection of the mini model (8.9 MiB, not 197 MiB).
Names follow PEFT's layout without its adapter-name level, so a checkpoint reads like the model it adapts:

    model.layers.{i}.self_attn.q_proj.weight          the frozen base weight, under its usual name
    model.layers.{i}.self_attn.q_proj.lora_A.weight   (r, in)
    model.layers.{i}.self_attn.q_proj.lora_B.weight   (out, r)

`LoraLinear` reuses the wrapped Linear's weight Parameter (no nested `.base`), so base keys stay unchanged and
`merge_lora` can hand back a plain GPT. `LoraModel` wraps a GPT so that the one loop saves and restores only the
adapters, plus the base's path, sha256 and `sampled_weights_fingerprint` (weights/load.py records and checks them)."""
import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoforge.core.config import TARGETS, LoraConfig  # noqa: F401 (LoraConfig: its users import it from here)
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.gpt import check_same_tensors

ADAPTER_KEYS = (".lora_A.", ".lora_B.")

# ----------------------------------------------------------------------------------- The adapted projection

class LoraLinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update: x -> W x + b + scaling * B(A(dropout(x))). The wrapped
    Linear's `weight` (and `bias`) are registered under the same names, so the base weight's key does not change."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter object: (out, in)
        self.register_parameter("bias", base.bias)
        base.requires_grad_(False)  # its weight and bias, now this module's too
        self.rank, self.scaling = rank, alpha / rank
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)  # weight (r, in)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)  # weight (out, r)
        self.lora_dropout = nn.Dropout(dropout)
        # A: nn.Linear's default (Kaiming-uniform with a=sqrt(5)), as loralib and PEFT do; the paper only asks
        # for a random A. B = 0 makes B A = 0, so training starts from the base model exactly (paper, sec. 4.1).
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.train(base.training)  # attached to a model in eval mode, the adapter's dropout must be off too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    @torch.no_grad()
    def merged_linear(self) -> nn.Linear:
        """A plain nn.Linear whose weight is W + scaling * B A, computed in fp32 and stored in W's dtype.
        It reuses this module's weight Parameter (updated in place), so ties and optimizers see one tensor."""
        delta = (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling  # (out, in)
        self.weight.copy_((self.weight.float() + delta).to(self.weight.dtype))
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, " \
               f"scaling={self.scaling:g}"


# ----------------------------------------------------------------------------- Attaching, merging, counting

def _unwrap(model: nn.Module) -> nn.Module:
    return model.gpt if isinstance(model, LoraModel) else model


def attach_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Wrap the targeted projections of every block in LoraLinear and freeze everything else (the tied
    embedding included). Returns the wrapped modules' names, e.g. "model.layers.0.self_attn.q_proj"."""
    model = _unwrap(model)
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise NanoforgeError("this model already has LoRA adapters; merge_lora() it before attaching new ones")
    for p in model.parameters():
        p.requires_grad_(False)
    replaced = []
    for i, block in enumerate(model.model.layers):
        for target in cfg.targets:
            parent_name, child_name = TARGETS[target]
            parent = getattr(block, parent_name)
            base = getattr(parent, child_name)
            if not isinstance(base, nn.Linear):
                raise NanoforgeError(f"model.layers.{i}.{parent_name}.{child_name} is a {type(base).__name__}, "
                                     f"not an nn.Linear; LoRA cannot wrap it")
            setattr(parent, child_name, LoraLinear(base, cfg.rank, cfg.alpha, cfg.dropout))
            replaced.append(f"model.layers.{i}.{parent_name}.{child_name}")
    return replaced


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put plain nn.Linear back, in place. The result is an
    ordinary GPT (HF-loadable `state_dict_for_save()`), with every parameter trainable again."""
    gpt = _unwrap(model)
    for module in list(gpt.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoraLinear):
                setattr(module, child_name, child.merged_linear())
    for p in gpt.parameters():
        p.requires_grad_(True)
    return gpt


def num_trainable(model: nn.Module) -> int:
    """Parameters that receive gradients (a shared tensor counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------ Adapter weights

def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only, under PEFT-like names (`...q_proj.lora_A.weight`)."""
    return {k: v for k, v in _unwrap(model).state_dict().items() if any(s in k for s in ADAPTER_KEYS)}


def load_lora_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load adapter tensors strictly: exactly the model's adapter keys with their shapes, or a NanoforgeError
    naming the missing, unexpected and mis-shaped keys. Base weights are never touched."""
    gpt = _unwrap(model)
    params = {k: p for k, p in gpt.named_parameters() if any(s in k for s in ADAPTER_KEYS)}
    if not params:
        raise NanoforgeError("the model has no LoRA adapters to load into; attach_lora() it first")
    check_same_tensors(params, state_dict, "adapter weights", "LoRA adapter weights do not match the model")
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(state_dict[key])


# -------------------------------------------------------------------------------------- Telling bases apart

@torch.no_grad()
def sampled_weights_fingerprint(weights: dict[str, torch.Tensor] | nn.Module, samples: int = 16) -> str:
    """sha256 over the base tensors' names, shapes and `samples` evenly spaced values of each (as fp32): cheap (no
    full pass over the weights), yet any other base (another run, step or shape) differs in some sampled value.
    Adapters and a tied lm_head copy are left out, so a base gives the same fingerprint from a file, a GPT or a GPT
    with adapters attached."""
    if isinstance(weights, nn.Module):
        gpt = _unwrap(weights)
        weights = gpt.state_dict_for_save() if hasattr(gpt, "state_dict_for_save") else gpt.state_dict()
    h = hashlib.sha256()
    tied = "lm_head.weight" in weights and "model.embed_tokens.weight" in weights and \
        weights["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    for name in sorted(weights):
        if any(s in name for s in ADAPTER_KEYS) or (tied and name == "lm_head.weight"):
            continue
        t = weights[name].detach().reshape(-1)
        idx = torch.linspace(0, max(t.numel() - 1, 0), min(samples, t.numel())).round().long().to(t.device)
        h.update(f"{name}:{tuple(weights[name].shape)}:".encode())
        h.update(t[idx].to("cpu", torch.float32).numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------- The model the training loop sees

class LoraModel(nn.Module):
    """A GPT with adapters attached, shaped for the one training loop: it forwards like the GPT, and its
    `state_dict_for_save()` / `load_weights()` hold the adapters only, so checkpoints of a LoRA run are a few
    MB and resume restores adapters onto the (separately loaded, frozen) base."""

    def __init__(self, gpt: nn.Module, cfg: LoraConfig):
        super().__init__()
        self.gpt = gpt
        self.targets = attach_lora(gpt, cfg)

    @property
    def cfg(self):
        return self.gpt.cfg

    @property
    def activation_checkpointing(self) -> bool:  # the GPT's own switch: its blocks are what is recomputed
        return self.gpt.activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        self.gpt.activation_checkpointing = on

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.gpt(*args, **kwargs)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        return self.gpt.num_params(exclude_embeddings)

    def flops_per_token(self, seq_len: int) -> float:
        """The GPT's 6N less the frozen weights' weight-gradient matmul: frozen matrices still cost 2N forward and
        2N for the input gradient; adapters the full 6 per param. (The attention term has no weights.)"""
        n_frozen = self.gpt.num_params(exclude_embeddings=True)
        if self.gpt.cfg.tie_embeddings:
            n_frozen += self.gpt.cfg.vocab_size * self.gpt.cfg.d_model
        n_frozen -= num_trainable(self)
        return self.gpt.flops_per_token(seq_len) - 2.0 * n_frozen

    def state_dict_for_save(self) -> dict[str, torch.Tensor]:
        return lora_state_dict(self.gpt)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        load_lora_state_dict(self.gpt, state_dict)

    def merged(self) -> nn.Module:
        """Fold the adapters in and return the plain GPT (this wrapper is spent afterwards)."""
        return merge_lora(self.gpt)

