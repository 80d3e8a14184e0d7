"""Where and in what precision a process computes: the device a --device name means, autocast for a
precision, and the precision to fall back to when fp16 keeps overflowing."""
from __future__ import annotations

import contextlib

import torch

from nanoforge.errors import NanoforgeError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise NanoforgeError(f"--device {name!r} is not a device (auto, cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NanoforgeError("--device cuda was asked for but CUDA is not available on this machine")
    return device


def autocast_context(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def eval_mode(model):
    """model.eval() for the duration, then back to whatever mode it was in (a caller's training model)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def fallback_precision(device: torch.device) -> str:
    """Where fp16 keeps overflowing: bf16 has fp32's range; fall back to fp32 where bf16 is not supported."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return "fp32"
    return "bf16"
