"""THE training loop. Every stage (pretrain, SFT, LoRA, DPO, distillation, GRPO, PPO) runs through `train()`;
a stage only supplies a batch source and an objective (see `Stage`).

One optimizer step:
    fetch grad_accum micro-batches -> count supervised tokens in all of them -> for each micro-batch:
    forward under autocast, loss = (sum of token losses) / (supervised tokens in the WHOLE step), backward
    -> unscale (fp16) -> clip -> guard against non-finite values -> lr from the schedule -> step.
Normalising by the whole step's tokens (on all ranks) makes the update that of one big batch, even when
micro-batches hold different numbers of supervised tokens (SFT) or run on N processes (train/distributed.py)."""
from __future__ import annotations

import math
import signal
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from nanoforge.core.config import ModelConfig, TrainConfig, config_dicts
from nanoforge.core.device import (autocast_context, eval_mode, keep_freed_memory, precision_note, resolve_device,
                              resolve_precision)
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.interface import TRAINABLE_INTERFACE, TrainableModel
from nanoforge.weights import checkpoint as ckpt
from nanoforge.train import distributed
from nanoforge.train.faults import injections_from_env, kill_if_asked, poison_grads, poison_loss
from nanoforge.train.guard import NonFiniteGuard
from nanoforge.train.meter import PhaseClock, Throughput
from nanoforge.train.metrics import MetricsLog, peak_flops, peak_memory_bytes, progress_line
from nanoforge.train.optim import build_optimizer, lr_at
from nanoforge.train.rundir import write_run_config
from nanoforge.train.stage import Batch, LossFn, Stage
from nanoforge.train.state import Run, RunState, resume as resume_run, rollback, save

__all__ = ["Stage", "TrainingInterrupted", "evaluate", "train"]


class TrainingInterrupted(NanoforgeError):
    """SIGINT/SIGTERM arrived; a checkpoint was written and the run can be resumed."""

    def __init__(self, signum: int, checkpoint: Path | None):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} received: checkpoint written to {checkpoint}; "
                         f"continue with --resume")


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Batch], loss_fn: LossFn, device: torch.device,
             precision: str) -> tuple[float, int, dict[str, float]]:
    """Mean loss per counted unit (token, or pair for DPO) over all batches, the count, and the objective's
    extra scalars averaged with the same weights."""
    total, count = torch.zeros((), device=device, dtype=torch.float64), 0
    extras: dict[str, torch.Tensor] = {}
    with eval_mode(model):
        for batch in batches:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with autocast_context(device, precision):
                loss_sum, n, extra = loss_fn(model, batch)
            total += loss_sum.double()
            count += int(n)
            for k, v in extra.items():
                extras[k] = extras.get(k, 0) + v.detach().double() * int(n)
    return total.item() / max(count, 1), count, {k: v.item() / max(count, 1) for k, v in extras.items()}


class _NoLog:
    """What ranks other than 0 log: nothing (rank 0 writes metrics.jsonl, TensorBoard and the console)."""

    def _nothing(self, *args) -> None:
        pass

    log = print = close = _nothing


class _SignalFlag:
    """Turns SIGINT/SIGTERM into a flag checked between steps, so a checkpoint is never torn by the signal.
    A second SIGINT falls through to Python's default and interrupts at once."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            with suppress(ValueError):  # not the main thread (e.g. a test runner thread): leave signals alone
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class _Step:
    """What one optimizer step leaves for the progress line and the stop decision."""
    lr: float
    grad_norm: torch.Tensor
    extras: dict[str, torch.Tensor]
    signum: int | None


def train(stage: Stage, model: TrainableModel, mcfg: ModelConfig, tcfg: TrainConfig, run_dir: str | Path,
          resume: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Run (or resume) a stage to tcfg.max_steps or the end of tcfg.time_budget. Returns a summary of the run."""
    run = _start(stage, model, mcfg, tcfg, Path(run_dir), resume, quiet)
    flops_per_token = model.flops_per_token(tcfg.seq_len)
    meter = Throughput(run.device, flops_per_token,
                        peak_flops(run.device, run.state.precision) if flops_per_token else 0.0)
    _print_header(run)
    summary: dict[str, Any] = {}
    last_saved, stop_reason = None, "max_steps"
    start = time.perf_counter() - run.state.train_seconds  # a resumed run continues its time budget
    try:
        with _SignalFlag() as flag:
            while run.state.step < tcfg.max_steps:
                if _out_of_time(run, start):
                    stop_reason = "time_budget"
                    break
                result = _train_step(run, flag, meter)  # accumulate, clip, step (or skip), count
                step = run.state.step
                if _due(step, tcfg.log_every, tcfg):
                    _log_progress(run, result, meter)
                evaluated = bool(stage.val_batches) and _due(step, tcfg.eval_every, tcfg)
                if evaluated:
                    summary.update(_validate(run))
                if stage.sampler and run.world.is_main and not run.fsdp and _due(step, tcfg.sample_every, tcfg):
                    with eval_mode(run.raw):  # the stage's text samples, from the plain model in eval mode
                        stage.sampler(run.raw, step, run.log)
                if tcfg.save_every and step % tcfg.save_every == 0:
                    last_saved = save(run)
                kill_if_asked(run.world.rank, step)  # NANOFORGE_INJECT_KILL, a test hook (train/faults.py)
                signum = result.signum if run.world.distributed else (result.signum or flag.signum)
                if signum is not None:
                    raise TrainingInterrupted(signum, save(run))
                if evaluated and _early_stop(run):
                    stop_reason = "early_stop"
                    break
            run.guard.flush()
            if last_saved is None or last_saved.name != ckpt.step_dir_name(run.state.step):
                last_saved = save(run)
    finally:
        run.log.close()
    summary.update(step=run.state.step, checkpoint=str(last_saved), stop_reason=stop_reason,
                   skipped_steps=run.state.skipped_steps, rollbacks=run.state.rollbacks)
    return summary


def _out_of_time(run: Run, start: float) -> bool:
    """Records the training seconds (rank 0's, so all ranks agree); whether tcfg.time_budget is spent."""
    seconds, budget = time.perf_counter() - start, run.tcfg.time_budget
    if budget and run.world.distributed:  # every rank but 0 adds 0
        seconds = distributed.all_reduce_sum(torch.tensor(seconds * run.world.is_main, device=run.device)).item()
    run.state.train_seconds = seconds
    return bool(budget) and seconds >= budget


def _due(step: int, every: int, tcfg: TrainConfig) -> bool:
    """Every `every` steps (0: never), and at the last step."""
    return bool(every) and (step % every == 0 or step == tcfg.max_steps)


def _train_step(run: Run, flag: _SignalFlag, meter: Throughput) -> _Step:
    """One optimizer step: grad_accum micro-batches, clip, the guarded update, the bookkeeping."""
    tcfg, state, device = run.tcfg, run.state, run.device
    clock = PhaseClock(tcfg.sync_timing and device.type == "cuda", device)
    micro = [_to_device(run.stage.train_batches.next_batch(), device) for _ in range(tcfg.grad_accum)]
    clock.lap("data")
    loss, extras, n_supervised = _accumulate(run, micro)
    clock.lap("fwd_bwd")
    grad_norm = _clip(run)
    lr = lr_at(state.step, tcfg, state.train_seconds) * state.lr_scale
    kept_loss, kept_steps, signum = run.guard.step(loss, grad_norm, lr, flag.signum)
    run.optimizer.zero_grad(set_to_none=True)
    clock.lap("optim")
    n_tokens = sum(b["input_ids"].numel() for b in micro) * run.world.world_size  # ranks' batches: same shape
    state.step += 1
    state.tokens_seen += n_tokens
    if run.guard.settle(_sync_due(state.step, tcfg, run.stage, signum)):
        rollback(run, "non-finite loss or gradients")
    meter.add(kept_loss, kept_steps, n_tokens, n_supervised, clock)
    return _Step(lr, grad_norm, extras, signum)


def _accumulate(run: Run, micro: list[Batch]) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Forward and backward over the step's micro-batches; returns the step's loss, extras and global count.

    The whole step's supervised tokens on ALL ranks: DDP/FSDP average gradients over ranks, so each rank's loss
    is its token-loss sum / global count x world size, and the mean of the ranks' gradients is then exactly the
    gradient of one process's loss on the global batch."""
    stage, world, step = run.stage, run.world, run.state.step
    local_count = torch.as_tensor(sum(stage.count_fn(b) for b in micro), device=run.device)
    n_supervised = distributed.all_reduce_sum(local_count).clamp(min=1)
    step_loss = torch.zeros((), device=run.device)
    extras: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(micro):
        with distributed.gradient_sync(run.model, i == len(micro) - 1):  # all-reduce on the last one only
            with autocast_context(run.device, run.state.precision):
                loss_sum, _, extra = stage.loss_fn(run.forward_model, batch)
            loss = loss_sum.float() / n_supervised * world.world_size
            loss = poison_loss(loss, step, run.injections)  # NANOFORGE_INJECT_NONFINITE (train/faults.py)
            run.guard.scaler.scale(loss).backward()
        step_loss += loss.detach() / world.world_size
        for k, v in extra.items():
            extras[k] = extras.get(k, 0) + v.detach() / run.tcfg.grad_accum
    if world.distributed:  # the logged loss (and extras) are global means
        keys = sorted(extras)
        reduced = distributed.all_reduce_sum(torch.stack([step_loss, *(extras[k].float() for k in keys)]))
        step_loss = reduced[0]
        extras = {k: reduced[j + 1] / world.world_size for j, k in enumerate(keys)}
    poison_grads(run.raw, step, run.injections)
    return step_loss, extras, n_supervised


def _clip(run: Run) -> torch.Tensor:
    """Unscale (fp16) and clip the global gradient norm; returns the norm before clipping."""
    run.guard.scaler.unscale_(run.optimizer)
    params = [p for p in run.raw.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, run.tcfg.grad_clip if run.tcfg.grad_clip > 0 else math.inf)
    return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a DTensor


def _log_progress(run: Run, result: _Step, meter: Throughput) -> None:
    """The progress record (metrics.jsonl, TensorBoard, the console) over the steps since the last one."""
    step, tcfg = run.state.step, run.tcfg
    values: dict[str, Any] = {**meter.take(run), "lr": result.lr, "grad_norm": result.grad_norm.item(),
                              "peak_mem_gb": peak_memory_bytes(run.device) / 1e9,
                              "skipped_steps": run.state.skipped_steps}
    values.update({k: float(v) for k, v in result.extras.items()})
    if run.guard.scaler.is_enabled():
        values["loss_scale"] = run.guard.scaler.get_scale()
    run.log.log(step, values)
    eta = min(meter.seconds_left(tcfg.max_steps - step), (tcfg.time_budget or math.inf) - run.state.train_seconds)
    run.log.print(progress_line(step, tcfg.max_steps, values, eta))


def _validate(run: Run) -> dict[str, Any]:
    """Validation loss (and ppl, bpb, the objective's extras); updates the best loss for early stopping.

    Every rank evaluates the same batches, so all agree on early stopping; under DDP on the model itself, since
    a forward through the wrapper alone on one rank would wait for the others."""
    stage, state = run.stage, run.state
    val_loss, val_count, val_extras = evaluate(run.model if run.fsdp else run.raw, stage.val_batches(),
                                               stage.loss_fn, run.device, state.precision)
    if run.world.distributed:  # GPU kernels need not agree to the last bit across ranks: average, so every rank
        # takes the same early-stopping decision (one that differed would hang the rest)
        val_loss = distributed.all_reduce_sum(
            torch.tensor(val_loss, dtype=torch.float64, device=run.device)).item() / run.world.world_size
    # val_count: what the mean is over (supervised tokens; pairs for DPO), so runs whose validation covered
    # different amounts (eval_batches x batch_size windows) can be told apart
    values = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)), "val_count": val_count,
              **{f"val_{k}": v for k, v in val_extras.items()}}
    if stage.val_bytes_per_token:
        values["val_bpb"] = val_loss / math.log(2) / stage.val_bytes_per_token
    run.log.log(state.step, values)
    run.log.print(f"step {state.step}: val loss {val_loss:.4f} | ppl {values['val_ppl']:.2f}"
                  + (f" | bpb {values['val_bpb']:.4f}" if "val_bpb" in values else ""))
    if state.best_val_loss is None or val_loss < state.best_val_loss:
        state.best_val_loss, state.evals_since_best = val_loss, 0
    else:
        state.evals_since_best += 1
    return values


def _early_stop(run: Run) -> bool:
    patience, state = run.tcfg.early_stop_patience, run.state
    if not patience or state.evals_since_best < patience:
        return False
    run.log.print(f"step {state.step}: validation loss has not improved for {patience} evaluations "
                  f"(best {state.best_val_loss:.4f}); stopping early")
    return True


def _start(stage: Stage, model: TrainableModel, mcfg: ModelConfig, tcfg: TrainConfig, run_dir: Path,
           resume: bool, quiet: bool) -> Run:
    """The device, the (wrapped, compiled) model, the optimizer, the resumed state and the log of a run."""
    if not isinstance(model, TrainableModel):
        raise NanoforgeError(f"{type(model).__name__} cannot be trained by this loop: a model must offer "
                             f"{', '.join(TRAINABLE_INTERFACE)} (nanoforge/model/interface.py)")
    run_dir.mkdir(parents=True, exist_ok=True)
    world = distributed.world()
    device = distributed.setup(resolve_device(tcfg.device))  # under torchrun: join the group, this rank's device
    tcfg.precision = resolve_precision(tcfg.precision, device)  # for callers with their own TrainConfig
    torch.manual_seed(tcfg.seed)
    model.to(device)
    model.train()
    if device.type == "cpu":
        keep_freed_memory()
    elif device.type == "cuda":
        # fp32 matmuls (the fp32 parts of autocast too) on tensor cores, or not: set both ways, since an earlier
        # run in this process may have turned them on
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tcfg.tf32
        # peak_mem_gb is this run's: not --micro-batch auto's probe (which ran up to out-of-memory) or DPO's
        # reference pass, earlier in this process
        torch.cuda.reset_peak_memory_stats(device)
    model.activation_checkpointing = tcfg.activation_checkpointing
    wrapped = distributed.wrap(model, device, fsdp=tcfg.fsdp)
    # Compiled when asked; evaluation and sampling use the plain model, which shares the parameters, so they
    # never trigger a recompile for their shapes.
    forward_model = torch.compile(wrapped) if tcfg.compile else wrapped
    optimizer = build_optimizer(model, tcfg, device)  # after wrapping: FSDP2 shards the parameters
    state, log = RunState(precision=tcfg.precision), _NoLog()
    guard = NonFiniteGuard(optimizer, device, tcfg.precision, tcfg.nonfinite_patience, state, log)
    run = Run(stage, tcfg, run_dir, world, device, model, wrapped, forward_model, optimizer, state, log, guard,
              config=config_dicts(mcfg, tcfg), injections=injections_from_env())
    if resume:  # config.toml only once every check of the checkpoint passed: a refused resume leaves it as it was
        resume_run(run, quiet or not world.is_main)
        write_run_config(run_dir, mcfg, tcfg, stage.run_info)
    if world.is_main:
        run.log = guard.log = MetricsLog(run_dir, tensorboard=tcfg.tensorboard, wandb_project=tcfg.wandb_project,
                                         resume_step=state.step, config=run.config, quiet=quiet)
    return run


def _print_header(run: Run) -> None:
    tcfg, world = run.tcfg, run.world
    n_params = sum(p.numel() for p in run.raw.parameters())
    run.log.print(f"{run.stage.name}: {n_params / 1e6:.2f}M parameters on {run.device}, {run.state.precision}, "
                  f"{tcfg.batch_size}x{tcfg.seq_len} x {tcfg.grad_accum} accum"
                  + (f" x {world.world_size} processes ({'FSDP2' if run.fsdp else 'DDP'})" if world.distributed
                     else "") + f", {tcfg.max_steps} steps"
                  + (f" or {tcfg.time_budget:g} s" if tcfg.time_budget else "") + f" -> {run.run_dir}")
    run.log.print(precision_note(run.state.precision, run.device))
    if tcfg.warmup_steps >= tcfg.max_steps and run.state.step == 0:
        run.log.print(f"note: warmup_steps={tcfg.warmup_steps} covers the whole run of {tcfg.max_steps} steps: "
                      f"the learning rate never gets past its warmup to the peak {tcfg.lr:g} (lower --warmup-steps)")


def _sync_due(step: int, tcfg: TrainConfig, stage: Stage, signum: int | None) -> bool:
    """Steps at which the host looks at the device's counters: before anything is logged, evaluated, sampled
    or saved, so that a checkpoint never holds a run of bad steps that should have been rolled back."""
    due = lambda every: bool(every) and step % every == 0  # noqa: E731
    return (step == tcfg.max_steps or signum is not None or due(tcfg.log_every) or due(tcfg.save_every)
            or (stage.val_batches is not None and due(tcfg.eval_every))
            or (stage.sampler is not None and due(tcfg.sample_every)))


def _to_device(batch: Batch, device: torch.device) -> Batch:
    """Host batch -> device. On CUDA through pinned memory, so the copy is asynchronous and overlaps the
    work already queued."""
    if device.type == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


