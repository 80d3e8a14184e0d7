"""`--micro-batch auto`: the largest micro-batch that fits, found by running the model, then grad_accum set so the
global batch (batch_size x grad_accum) is unchanged. The loop normalises the loss by the whole step's tokens,
so the update is the same however the global batch is split (tests/train/test_micro_batch.py checks the weights)."""
import ctypes
import os
from contextlib import suppress

import torch
import torch.distributed as dist

from nanoforge.core.config import ModelConfig, TrainConfig
from nanoforge.core.device import autocast_context, resolve_device
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.gpt import GPT
from nanoforge.train.plan import GiB, RESERVED_FRACTION, activation_bytes
from nanoforge.train import distributed
from nanoforge.train.objectives import causal_lm_loss
from nanoforge.train.optim import build_optimizer


def fit_micro_batch(mcfg: ModelConfig, tcfg: TrainConfig, log=print, rows_per_item: int = 1, loss_fn=None) -> str:
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
        device = distributed.setup(resolve_device(tcfg.device))  # under torchrun: this rank's GPU
        probe = probe_cuda if device.type == "cuda" else probe_cpu
        micro, why = probe(mcfg, tcfg, device, global_batch, rows_per_item, loss_fn)
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


def _probe_step(model, optimizer, tcfg: TrainConfig, device: torch.device, batch: int, loss_fn=None) -> None:
    """One real training step at `batch`: forward under the run's precision, backward, optimizer step."""
    ids = torch.randint(0, model.cfg.vocab_size, (batch, tcfg.seq_len + 1), device=device)  # (B, T+1)
    with autocast_context(device, tcfg.precision):
        loss_sum, n, _ = (loss_fn or causal_lm_loss)(model, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    (loss_sum.float() / n).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _probe_model(mcfg: ModelConfig, tcfg: TrainConfig, device: torch.device):
    model = GPT(mcfg).to(device).train()
    model.activation_checkpointing = tcfg.activation_checkpointing  # as the loop sets it
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
            return next((int(line.split()[1]) for line in f if line.startswith(field + ":")), None)
    except OSError:
        return None


def _reset_peak_rss() -> bool:
    """Make VmHWM (peak resident memory) start again from the current RSS (Linux >= 4.0), after handing freed
    heap memory back to the system (glibc), so that the probe's allocations show up as growth."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_memory_budget(tcfg: TrainConfig) -> tuple[int, str]:
    if tcfg.memory_budget_gb:
        return int(tcfg.memory_budget_gb * GiB), f"--memory-budget-gb {tcfg.memory_budget_gb:g}"
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
    micro = max(d for d in range(1, global_batch + 1) if global_batch % d == 0 and d <= max(fits, 1))
    why = (f"{how} + {16 * n / 2**20:,.0f} MiB weights, gradients and AdamW state, against a budget of "
           f"{budget / GiB:.2f} GiB ({budget_why}) -> up to {max(fits, 0)} "
           + ("sequences" if rows_per_item == 1 else f"items of {rows_per_item} sequences"))
    if fits < 1:
        why += "; even 1 is over the budget, so 1 (expect swapping, or lower --seq-len)"
    return micro, why


def _agree_on_min(micro: int, device: torch.device) -> int:
    """Under torchrun every rank must use the same micro-batch (the same number of accumulation steps)."""
    if not (dist.is_available() and dist.is_initialized()):
        return micro
    t = torch.tensor([micro], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
