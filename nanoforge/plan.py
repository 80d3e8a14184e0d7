"""`nanoforge plan`: what a run will need before it runs. Parameters, memory per micro-batch, the largest
micro-batch that fits a device, gradient accumulation for a target global batch, and projected wall time.
At the end, `--micro-batch auto` for training: the same question answered by running real steps (fit_micro_batch).

Every number is an estimate with its assumptions printed beside it:
- weights, gradients and AdamW state are exact byte counts (fp32 master weights, two fp32 moments);
- activations follow Korthikanti et al. (arXiv 2205.05198, section 4.1): about s*b*h*34 bytes per layer in
  16-bit precision when attention runs through a fused kernel that stores no s x s score matrix (SDPA's flash
  path), twice that in fp32; our SwiGLU MLP keeps 3 intermediate tensors of 8/3 h instead of GPT's 2 of 4h,
  which the formula's constant absorbs within a few percent. Add the logits: b*s*V in 16-bit, their fp32
  upcast for the loss, and its gradient;
- time uses the model's FLOPs per token (6N + 12 L h s) divided by the device's dense bf16 peak times an
  assumed model-FLOPs utilisation (--mfu, 0.40 by default for GPUs, a level small dense models reach with
  bf16 and fused attention) or by a measured tokens/s (--tokens-per-s, e.g. from `nanoforge bench`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from nanoforge.config import ModelConfig, TrainConfig
from nanoforge.errors import NanoforgeError

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


def count_params(mcfg: ModelConfig) -> tuple[int, float]:
    """Parameters and FLOPs per token of the model, built on the meta device (no memory is allocated)."""
    from nanoforge.model.gpt import GPT
    with torch.device("meta"):
        model = GPT(mcfg)
    return model.num_params(), model.flops_per_token


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
    import math
    for name, value, ok in (("--tokens", tokens, tokens is None or (math.isfinite(tokens) and tokens > 0)),
                            ("--mfu", mfu, math.isfinite(mfu) and 0 < mfu <= 1),
                            ("--tokens-per-s", tokens_per_s,
                             tokens_per_s is None or (math.isfinite(tokens_per_s) and tokens_per_s > 0))):
        if not ok:
            raise NanoforgeError(f"{name} {value} must be a positive number" + (" at most 1" if name == "--mfu" else ""))
    n, flops_fn = count_params(mcfg)
    flops = flops_fn(tcfg.seq_len)
    weights, grads, optimizer = 4 * n, 4 * n, 8 * n
    per_sample = activation_bytes(mcfg, tcfg.seq_len, tcfg.precision)
    memory, peak = device_memory(device)
    room = memory * (1 - RESERVED_FRACTION) - weights - grads - optimizer
    max_mb = max(0, int(room // per_sample))
    if max_mb == 0:
        raise NanoforgeError(f"the model's weights, gradients and optimizer state ({(weights + grads + optimizer) / GiB:.1f} "
                             f"GiB) leave no room for activations on {device} ({memory / GiB:.0f} GiB): use a smaller "
                             f"preset, FSDP across more devices, or LoRA")
    target = global_batch if global_batch is not None else tcfg.batch_size * tcfg.grad_accum
    if target <= 0:
        raise NanoforgeError(f"--global-batch {target} must be > 0")
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
        f"model        {p.params / 1e6:.1f}M parameters ({mcfg.n_layers} layers, d_model {mcfg.d_model}, "
        f"{mcfg.n_heads} heads / {mcfg.n_kv_heads} KV, vocab {mcfg.vocab_size}"
        + (f", {mcfg.n_experts} experts top-{mcfg.experts_per_token}" if mcfg.n_experts else "") + ")",
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


# --micro-batch auto: the largest micro-batch that fits, found by running the model, then grad_accum set so the
# global batch (batch_size x grad_accum) is unchanged. The loop normalises the loss by the whole step's tokens,
# so the update is the same however the global batch is split (tests/test_plan.py checks the weights).


def fit_micro_batch(mcfg: ModelConfig, tcfg: TrainConfig, log=print, rows_per_item: int = 1,
                    loss_fn=None) -> str:
    """Settle tcfg.micro_batch ("auto" or N) into tcfg.batch_size and tcfg.grad_accum, keeping their product;
    returns (and logs) what was chosen and why. Nothing changes when micro_batch is empty. rows_per_item: the
    sequences one batch item is (DPO: a pair is 2). loss_fn: the stage's objective when it needs more memory
    per sequence than next-token loss (distillation runs a teacher and keeps its logits), so the probe steps
    measure that too; default causal_lm_loss."""
    if not tcfg.micro_batch:
        return ""
    global_batch = tcfg.batch_size * tcfg.grad_accum
    if tcfg.micro_batch != "auto":
        micro = int(tcfg.micro_batch)
        if global_batch % micro:
            raise NanoforgeError(f"--micro-batch {micro} does not divide the global batch batch_size x grad_accum = "
                                 f"{tcfg.batch_size} x {tcfg.grad_accum} = {global_batch}")
        why = "as given by --micro-batch"
    else:
        from nanoforge.train import distributed
        from nanoforge.device import resolve_device
        device = distributed.setup(resolve_device(tcfg.device))  # under torchrun: this rank's GPU
        if device.type == "cuda":
            micro, why = probe_cuda(mcfg, tcfg, device, global_batch, rows_per_item, loss_fn)
        else:
            micro, why = probe_cpu(mcfg, tcfg, device, global_batch, rows_per_item, loss_fn)
        micro = _agree_on_min(micro, device)
    tcfg.batch_size, tcfg.grad_accum = micro, global_batch // micro
    text = (f"micro-batch {micro} x grad-accum {tcfg.grad_accum} = global batch {global_batch} sequences of "
            f"{tcfg.seq_len}: {why}")
    log(text)
    return text


def divisors_doubling(n: int) -> list[int]:
    """1, then roughly doubling sizes up to n, each dividing n (so the global batch splits evenly)."""
    out, b = [], 1
    while b <= n:
        out.append(b)
        b = next((d for d in range(2 * b, n + 1) if n % d == 0), n + 1)
    return out


def largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(limit, 1))


def _probe_step(model, optimizer, tcfg: TrainConfig, device: torch.device, batch: int, loss_fn=None) -> None:
    """One real training step at `batch`: forward under the run's precision, backward, optimizer step."""
    from nanoforge.device import autocast_context
    from nanoforge.train.objectives import causal_lm_loss
    ids = torch.randint(0, model.cfg.vocab_size, (batch, tcfg.seq_len + 1), device=device)  # (B, T+1)
    with autocast_context(device, tcfg.precision):
        loss_sum, n, _ = (loss_fn or causal_lm_loss)(model, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    (loss_sum.float() / n).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _probe_model(mcfg: ModelConfig, tcfg: TrainConfig, device: torch.device):
    from nanoforge.model.gpt import GPT
    from nanoforge.train.optim import build_optimizer
    model = GPT(mcfg).to(device).train()
    if hasattr(model, "activation_checkpointing"):  # as the loop sets it
        model.activation_checkpointing = tcfg.activation_checkpointing
    return model, build_optimizer(model, tcfg, device)


def probe_cuda(mcfg: ModelConfig, tcfg: TrainConfig, device: torch.device, global_batch: int,
               rows_per_item: int = 1, loss_fn=None) -> tuple[int, str]:
    """Real steps at doubling micro-batches (each dividing the global batch) until one runs out of memory, goes
    over the budget, or the global batch itself fits. Eager mode: a compiled model needs no more memory."""
    total = torch.cuda.get_device_properties(device).total_memory
    budget = tcfg.memory_budget_gb * GiB if tcfg.memory_budget_gb else total * (1 - RESERVED_FRACTION)
    model, optimizer = _probe_model(mcfg, tcfg, device)
    best, best_peak, stopped = 0, 0, "the whole global batch fits"
    for b in divisors_doubling(global_batch):
        torch.cuda.reset_peak_memory_stats(device)
        try:
            _probe_step(model, optimizer, tcfg, device, b * rows_per_item, loss_fn)
            peak = torch.cuda.max_memory_allocated(device)
        except torch.cuda.OutOfMemoryError:
            stopped = f"micro-batch {b} ran out of memory"
            break
        finally:
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        if peak > budget:
            stopped = f"micro-batch {b} peaked at {peak / GiB:.1f} GiB, over the {budget / GiB:.1f} GiB budget"
            break
        best, best_peak = b, peak
    del model, optimizer
    torch.cuda.empty_cache()
    if best == 0:
        raise NanoforgeError(f"--micro-batch auto: not even one sequence of {tcfg.seq_len} fits on "
                             f"{torch.cuda.get_device_name(device)} ({stopped}); lower --seq-len, use "
                             f"--activation-checkpointing, a smaller preset or FSDP")
    return best, (f"probed real steps on {torch.cuda.get_device_name(device)}: micro-batch {best} peaked at "
                  f"{best_peak / GiB:.1f} GiB; {stopped}")


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Make VmHWM (peak resident memory) start again from the current RSS (Linux >= 4.0), after handing freed
    heap memory back to the system (glibc), so that the probe's allocations show up as growth."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_memory_budget(tcfg: TrainConfig) -> tuple[int, str]:
    if tcfg.memory_budget_gb:
        return int(tcfg.memory_budget_gb * GiB), f"--memory-budget-gb {tcfg.memory_budget_gb:g}"
    available = None
    try:
        with open("/proc/meminfo") as f:
            available = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    share = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun processes on this machine share it
    return (int(available * 0.8 / share),
            f"80% of MemAvailable {available / GiB:.1f} GiB" + (f" / {share} processes" if share > 1 else ""))


def probe_cpu(mcfg: ModelConfig, tcfg: TrainConfig, device: torch.device, global_batch: int,
              rows_per_item: int = 1, loss_fn=None) -> tuple[int, str]:
    """Real steps at a small micro-batch and a linear fit to the memory budget. A first step at 1 allocates the
    AdamW state and the libraries' one-time buffers; then the growth of peak resident memory over one step at 2
    is the gradients (4 bytes per parameter) plus 2 sequences' activations. Needed for b sequences: weights,
    gradients and AdamW state (16 bytes per parameter, exact) + b x activations."""
    budget, budget_why = cpu_memory_budget(tcfg)
    b0 = 2
    model, optimizer = _probe_model(mcfg, tcfg, device)
    n = model.num_params()
    _probe_step(model, optimizer, tcfg, device, 1, loss_fn)
    measured = None
    if _reset_peak_rss() and (rss0 := _proc_status_kib("VmRSS")) is not None:
        _probe_step(model, optimizer, tcfg, device, b0, loss_fn)
        measured = ((_proc_status_kib("VmHWM") - rss0) * 1024 - 4 * n) / b0
    del model, optimizer
    estimate = activation_bytes(mcfg, tcfg.seq_len, tcfg.precision)
    # Freed memory the allocator kept from earlier work can be reused by the probe and hide part of its growth;
    # a measurement under a quarter of the Korthikanti estimate is taken to be that, and the estimate used.
    if measured is not None and measured >= estimate / 4:
        per_sample, how = measured, f"measured {measured / 2**20:.0f} MiB per sequence (a real step at {b0})"
    else:
        per_sample, how = estimate, (f"estimated {estimate / 2**20:.0f} MiB per sequence"
                                     + (" (the probe's growth was hidden by reused memory)" if measured is not None
                                        else " (no peak-memory reset on this system)"))
    fits = int((budget - 16 * n) // (per_sample * rows_per_item))
    micro = largest_divisor_at_most(global_batch, fits)
    why = (f"{how} + {16 * n / 2**20:,.0f} MiB weights, gradients and AdamW state, against a budget of "
           f"{budget / GiB:.2f} GiB ({budget_why}) -> up to {max(fits, 0)} "
           + ("sequences" if rows_per_item == 1 else f"items of {rows_per_item} sequences"))
    if fits < 1:
        why += "; even 1 is over the budget, so 1 (expect swapping, or lower --seq-len)"
    return micro, why


def _agree_on_min(micro: int, device: torch.device) -> int:
    """Under torchrun every rank must use the same micro-batch (the same number of accumulation steps)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return micro
    t = torch.tensor([micro], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
