"""`nanoforge plan`: what a run will need before it runs. Parameters, memory per micro-batch, the largest
micro-batch that fits a device, gradient accumulation for a target global batch, and projected wall time.
(`--micro-batch auto` for training answers the same question by running real steps: train/microbatch.py.)

Every number is an estimate with its assumptions printed beside it:
- weights, gradients and AdamW state are exact byte counts (fp32 master weights, two fp32 moments);
- activations follow Korthikanti et al. (arXiv 2205.05198, section 4.1): about s*b*h*34 bytes per layer in
  16-bit precision when attention runs through a fused kernel that stores no s x s score matrix (SDPA's flash
  path), twice that in fp32 (SwiGLU's 3 tensors of 8/3 h change it by a few percent); plus the logits b*s*V
  in 16-bit, their fp32 upcast for the loss, and its gradient;
- time uses the model's FLOPs per token (6N + 12 L h s) divided by the device's dense bf16 peak times an
  assumed model-FLOPs utilisation (--mfu, 0.40 by default for GPUs, a level small dense models reach with
  bf16 and fused attention) or by a measured tokens/s (--tokens-per-s, e.g. from `nanoforge bench`)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from nanoforge.core.config import ModelConfig, TrainConfig
from nanoforge.core.device import resolve_precision
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.gpt import GPT

GiB = 1024**3

# name -> (memory in GiB, dense bf16 peak FLOP/s from the vendor datasheet)
DEVICES = {
    "rtx3090": (24, 71e12), "rtx4090": (24, 165e12), "a100-40g": (40, 312e12), "a100-80g": (80, 312e12),
    "h100": (80, 989e12), "h200": (141, 989e12), "l4": (24, 121e12), "t4": (16, 65e12),
}
RESERVED_FRACTION = 0.10  # CUDA context, allocator fragmentation and workspace: keep a tenth free


@dataclass
class Plan:
    params: int
    flops_per_token: float
    weights: int
    grads: int
    optimizer: int
    activations_per_sample: int  # one sequence of seq_len in the micro-batch
    device: str
    device_memory: int
    max_micro_batch: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    tokens_per_s: float
    throughput_source: str
    seconds: float | None


def device_memory(device: str) -> tuple[int, float]:
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 0.0
    if device not in DEVICES:
        raise NanoforgeError(f"--device {device!r}: known devices are cpu, {', '.join(DEVICES)}")
    mem, peak = DEVICES[device]
    return int(mem * GiB), peak


def activation_bytes(mcfg: ModelConfig, seq_len: int, precision: str) -> int:
    """Activations kept for the backward pass by one sequence (Korthikanti et al. with fused attention)."""
    scale = 2 if precision == "fp32" else 1
    per_layer = seq_len * mcfg.d_model * 34 * scale
    if mcfg.n_experts:  # each token's activations pass through experts_per_token MLPs instead of one
        per_layer += seq_len * mcfg.d_model * 18 * scale * (mcfg.experts_per_token - 1)
    logits = seq_len * mcfg.vocab_size * (2 * scale + 4 + 4)  # logits, fp32 copy for the loss, its gradient
    return mcfg.n_layers * per_layer + logits


def make_plan(mcfg: ModelConfig, tcfg: TrainConfig, device: str = "rtx3090", global_batch: int | None = None,
              tokens: float | None = None, mfu: float = 0.40, tokens_per_s: float | None = None) -> Plan:
    if tcfg.precision == "auto":  # what it means on the planned device: bf16 on every GPU of the table
        tcfg.precision = resolve_precision("auto", "cpu") if device == "cpu" else "bf16"
    with torch.device("meta"):  # no memory is allocated
        model = GPT(mcfg)
    n, flops = model.num_params(), model.flops_per_token(tcfg.seq_len)
    weights, grads, optimizer = 4 * n, 4 * n, 8 * n
    per_sample = activation_bytes(mcfg, tcfg.seq_len, tcfg.precision)
    memory, peak = device_memory(device)
    room = memory * (1 - RESERVED_FRACTION) - weights - grads - optimizer
    max_mb = max(0, int(room // per_sample))
    if max_mb == 0:
        raise NanoforgeError(f"the weights, gradients and optimizer state ({(weights + grads + optimizer) / GiB:.1f} "
                             f"GiB) leave no room for activations on {device} ({memory / GiB:.0f} GiB): use a smaller "
                             f"preset, FSDP across more devices, or LoRA")
    target = global_batch if global_batch is not None else tcfg.batch_size * tcfg.grad_accum
    accum = -(-target // max_mb)  # fewest accumulation steps whose micro-batch fits
    micro = -(-target // accum)
    if tokens_per_s:
        speed, source = tokens_per_s, "measured (--tokens-per-s)"
    elif peak:
        speed, source = peak * mfu / flops, f"{device} bf16 peak {peak / 1e12:.0f} TFLOP/s x MFU {mfu:.2f}"
    else:
        speed, source = 0.0, "unknown on cpu: pass --tokens-per-s from `nanoforge bench`"
    seconds = tokens / speed if tokens and speed else None
    return Plan(n, flops, weights, grads, optimizer, per_sample, device, memory, max_mb, micro, accum,
                micro * accum, speed, source, seconds)


def format_plan(p: Plan, mcfg: ModelConfig, tcfg: TrainConfig, tokens: float | None) -> str:
    gb = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    fixed = p.weights + p.grads + p.optimizer
    lines = [
        f"model        {p.params / 1e6:.1f}M parameters ({mcfg.describe()})",
        f"compute      {p.flops_per_token / 1e6:.0f} MFLOP per trained token at seq_len {tcfg.seq_len} (6N + 12 L h s)",
        f"memory       weights {gb(p.weights)} + gradients {gb(p.grads)} + AdamW state {gb(p.optimizer)} = {gb(fixed)}",
        f"             activations {gb(p.activations_per_sample)} per sequence of {tcfg.seq_len} ({tcfg.precision})",
        f"device       {p.device}: {gb(p.device_memory)}, {RESERVED_FRACTION:.0%} kept free -> largest micro-batch "
        f"{p.max_micro_batch}",
        f"batch        micro-batch {p.micro_batch} x grad-accum {p.grad_accum} = {p.global_batch} sequences "
        f"({p.global_batch * tcfg.seq_len:,} tokens) per step; peak about "
        f"{gb(fixed + p.micro_batch * p.activations_per_sample)}",
        f"throughput   {p.tokens_per_s:,.0f} tokens/s ({p.throughput_source})" if p.tokens_per_s else
        f"throughput   {p.throughput_source}",
    ]
    if tokens:
        steps = tokens / (p.global_batch * tcfg.seq_len)
        when = f"{p.seconds / 3600:.2f} h" if p.seconds else "unknown"
        lines.append(f"run          {tokens:,.0f} tokens = {steps:,.0f} steps; projected wall time {when}")
    return "\n".join(lines)
