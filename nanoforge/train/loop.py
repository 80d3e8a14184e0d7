"""THE training loop. Every stage (pretrain, SFT, LoRA, DPO, distillation) runs through `train()`; a stage
only supplies a batch source and an objective (see `Stage`).

One optimizer step:
    fetch grad_accum micro-batches -> count supervised tokens in all of them -> for each micro-batch:
    forward under autocast, loss = (sum of token losses) / (supervised tokens in the WHOLE step), backward
    -> unscale (fp16) -> clip -> guard against non-finite values -> lr from the schedule -> step.

Normalising by the tokens of the whole accumulated batch (not per micro-batch) makes the update identical
to one big batch even when micro-batches hold different numbers of supervised tokens, as SFT batches do.

Under torchrun the same holds across processes: the count is the whole step's on all ranks, so N processes with
batch B train exactly like one with batch N*B (train/distributed.py has the wrapping and collectives).
"""
from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import nn

from nanoforge import __version__
from nanoforge.config import ModelConfig, TrainConfig, config_dicts
from nanoforge.errors import NanoforgeError
from nanoforge.train import checkpoint as ckpt
from nanoforge.train import distributed
from nanoforge.train.metrics import MetricsLog, observed_peak, peak_flops, peak_memory_bytes, progress_line
from nanoforge.train.optim import build_optimizer, lr_at, set_lr

Batch = dict[str, torch.Tensor]
# (sum of per-token losses, number of supervised tokens, extra scalars to log)
LossFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


class BatchSource(Protocol):
    def next_batch(self) -> Batch: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Stage:
    """What makes a stage a stage: where batches come from and what loss they are trained on."""
    name: str
    train_batches: BatchSource
    loss_fn: LossFn
    # returns a fresh iterable of validation batches each time it is called; None disables validation
    val_batches: Callable[[], Iterable[Batch]] | None = None
    # UTF-8 bytes per token of the validation text, for bits per byte; None leaves val_bpb out
    val_bytes_per_token: float | None = None
    # extra sections saved in config.toml and state.json (data paths, tokenizer, stage options)
    run_info: dict[str, Any] = field(default_factory=dict)
    # what the step's loss is normalised by: supervised tokens for LM losses, pairs for DPO
    count_fn: Callable[[Batch], torch.Tensor] = None  # type: ignore[assignment]
    # called as sampler(model, step, log) every tcfg.sample_every steps on rank 0 with the plain (unwrapped,
    # uncompiled) model in eval mode: generates and logs text samples
    sampler: Callable[[nn.Module, int, Any], None] | None = None

    def __post_init__(self):
        if self.count_fn is None:
            self.count_fn = count_supervised


class TrainingInterrupted(NanoforgeError):
    """SIGINT/SIGTERM arrived; a checkpoint was written and the run can be resumed."""

    def __init__(self, signum: int, checkpoint: Path | None):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} received: checkpoint written to {checkpoint}; "
                         f"continue with --resume")


def count_supervised(batch: Batch) -> torch.Tensor:
    return (batch["labels"] != -100).sum()


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


def fallback_precision(device: torch.device) -> str:
    """Where fp16 keeps overflowing: bf16 has fp32's range; fall back to fp32 where bf16 is not supported."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return "fp32"
    return "bf16"


def parse_injections(spec: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {"loss": set(), "grad": set()}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, step = item.partition("@")
        if kind not in out or not step.isdigit():
            raise NanoforgeError(f"inject_nonfinite: {item!r} should look like loss@5 or grad@7")
        out[kind].add(int(step))
    return out


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Batch], loss_fn: LossFn, device: torch.device,
             precision: str) -> tuple[float, int, dict[str, float]]:
    """Mean loss per counted unit (token, or pair for DPO) over all batches, the count, and the objective's
    extra scalars averaged with the same weights."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device, dtype=torch.float64), 0
    extras: dict[str, torch.Tensor] = {}
    for batch in batches:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with autocast_context(device, precision):
            loss_sum, n, extra = loss_fn(model, batch)
        total += loss_sum.double()
        count += int(n)
        for k, v in extra.items():
            extras[k] = extras.get(k, 0) + v.detach().double() * int(n)
    model.train(was_training)
    return total.item() / max(count, 1), count, {k: v.item() / max(count, 1) for k, v in extras.items()}


class _NoLog:
    """What ranks other than 0 log: nothing (rank 0 writes metrics.jsonl, TensorBoard and the console)."""

    def log(self, step: int, values: dict[str, Any]) -> None:
        pass

    def print(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class _SignalFlag:
    """Turns SIGINT/SIGTERM into a flag checked between steps, so a checkpoint is never torn by the signal.
    A second SIGINT falls through to Python's default and interrupts at once."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. a test runner thread): leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train(stage: Stage, model: nn.Module, mcfg: ModelConfig, tcfg: TrainConfig, run_dir: str | Path,
          resume: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Run (or resume) a stage to tcfg.max_steps. Returns a summary of the run."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Under torchrun: join the process group, this rank's device, and the model wrapped in DDP or FSDP2.
    # `model` is what forward/backward run through; `raw` is the model itself (saved, measured, loaded).
    world = distributed.world()
    device = distributed.setup(resolve_device(tcfg.device))
    quiet = quiet or not world.is_main
    torch.manual_seed(tcfg.seed)
    raw = model
    raw.to(device)
    raw.train()
    if device.type == "cuda":
        # fp32 matmuls (the fp32 parts of autocast too) on tensor cores, or not: set both ways, since an earlier
        # run in this process may have turned them on
        torch.backends.cuda.matmul.allow_tf32 = tcfg.tf32
        torch.backends.cudnn.allow_tf32 = tcfg.tf32
        # peak_mem_gb is this run's: not --micro-batch auto's probe (which ran up to out-of-memory) or DPO's
        # reference pass, earlier in this process
        torch.cuda.reset_peak_memory_stats(device)
    if hasattr(raw, "activation_checkpointing"):
        raw.activation_checkpointing = tcfg.activation_checkpointing
    model = distributed.wrap(raw, device, fsdp=tcfg.fsdp)
    fsdp = distributed.is_fsdp(model)
    # What forward/backward run through. Compiled when asked; evaluation and sampling use the plain model,
    # which shares the parameters, so they never trigger a recompile for their shapes.
    forward_model = torch.compile(model) if tcfg.compile else model
    optimizer = build_optimizer(raw, tcfg, device)  # after wrapping: FSDP2 replaces parameters by shards
    params = [p for p in raw.parameters() if p.requires_grad]
    injections = parse_injections(tcfg.inject_nonfinite)

    # Mutable run state: everything here goes into state.json, so a resumed run continues exactly.
    st: dict[str, Any] = dict(step=0, precision=tcfg.precision, lr_scale=1.0, skipped_steps=0, rollbacks=0,
                              best_val_loss=None, evals_since_best=0, tokens_seen=0)
    scaler = torch.amp.GradScaler(device.type, enabled=st["precision"] == "fp16")

    if resume:
        last = ckpt.latest_checkpoint(run_dir)
        if last is None:
            raise NanoforgeError(f"--resume: {run_dir} has no checkpoint to resume from "
                                 f"(looked in {run_dir / 'checkpoints'})")
        saved = _restore(last, model, optimizer, stage)
        st.update(saved["run_state"])
        scaler = torch.amp.GradScaler(device.type, enabled=st["precision"] == "fp16")
        if "scaler" in saved["trainer"] and scaler.is_enabled():
            scaler.load_state_dict(saved["trainer"]["scaler"])
        ckpt.set_rng_states(saved["trainer"]["rng"])
        if not quiet:
            print(f"resuming {stage.name} from {last} (step {st['step']})", flush=True)

    config = config_dicts(mcfg, tcfg)
    log = MetricsLog(run_dir, tensorboard=tcfg.tensorboard, wandb_project=tcfg.wandb_project,
                     resume_step=st["step"], config=config, quiet=quiet) if world.is_main else _NoLog()
    n_params = sum(p.numel() for p in raw.parameters())
    flops_per_token = raw.flops_per_token(tcfg.seq_len) if hasattr(raw, "flops_per_token") else 0
    peak = peak_flops(device, st["precision"]) if flops_per_token else 0.0
    log.print(f"{stage.name}: {n_params / 1e6:.2f}M parameters on {device}, {st['precision']}, "
              f"{tcfg.batch_size}x{tcfg.seq_len} x {tcfg.grad_accum} accum"
              + (f" x {world.world_size} processes ({'FSDP2' if fsdp else 'DDP'})" if world.distributed else "")
              + f", {tcfg.max_steps} steps -> {run_dir}")
    if tcfg.warmup_steps >= tcfg.max_steps and st["step"] == 0:
        log.print(f"note: warmup_steps={tcfg.warmup_steps} covers the whole run of {tcfg.max_steps} steps: the "
                  f"learning rate never gets past its warmup to the peak {tcfg.lr:g} (lower --warmup-steps)")

    def save(step: int) -> Path:
        weights = raw.state_dict_for_save() if hasattr(raw, "state_dict_for_save") else raw.state_dict()
        if fsdp:  # gather full weights and optimizer state on rank 0, so any world size can resume
            weights = distributed.full_state_dict(model, list(weights))
            optimizer_state = distributed.full_optimizer_state(model, optimizer)
        else:
            optimizer_state = optimizer.state_dict()
        path = run_dir / "checkpoints" / ckpt.step_dir_name(step)
        if world.is_main:
            trainer = {"optimizer": optimizer_state, "rng": ckpt.rng_states()}
            if scaler.is_enabled():
                trainer["scaler"] = scaler.state_dict()
            state = {"stage": stage.name, "run_state": {**st, "step": step},
                     "data": stage.train_batches.state_dict(), "config": config, "run": stage.run_info,
                     "versions": _versions()}
            path = ckpt.save_checkpoint(run_dir, step, weights, trainer, state, keep_last=tcfg.keep_last)
        distributed.barrier()  # no rank reads or rolls back to a checkpoint before it is complete
        return path

    def rollback(reason: str) -> None:
        last = ckpt.latest_checkpoint(run_dir)
        if last is None:
            raise NanoforgeError(f"{reason} for {tcfg.nonfinite_patience} consecutive steps at step {st['step']}, "
                                 f"and there is no checkpoint to roll back to yet; lower --lr or use "
                                 f"--precision bf16/fp32")
        data_state = stage.train_batches.state_dict()  # keep moving forward: the bad batches stay behind us
        saved = _restore(last, model, optimizer, stage)
        stage.train_batches.load_state_dict(data_state)
        st["lr_scale"] *= tcfg.rollback_lr_factor
        st["rollbacks"] += 1
        new_precision = fallback_precision(device) if st["precision"] == "fp16" else st["precision"]
        log.print(f"step {st['step']}: {reason} {tcfg.nonfinite_patience} times in a row; rolled back to "
                  f"{last.name} (step {saved['run_state']['step']}), lr scale now {st['lr_scale']:g}"
                  + (f", precision {st['precision']} -> {new_precision}" if new_precision != st["precision"] else ""))
        st["precision"] = new_precision
        log.log(st["step"], {"event": "rollback", "to_step": saved["run_state"]["step"],
                             "lr_scale": st["lr_scale"], "precision": st["precision"]})

    # Bookkeeping of non-finite steps without reading the device every step: where the optimizer can skip an
    # update on a device flag (fused AdamW's found_inf), the flags accumulate on the device and are read only
    # at steps that log, evaluate, sample or save. Elsewhere (fp16's scaler, distributed runs, optimizers
    # without the flag) each step reads them, as it must to decide.
    dev = _NonfiniteCounters(device)
    step_times: list[float] = []
    consecutive_bad = 0
    window = _new_window(device)
    timing = tcfg.sync_timing and device.type == "cuda"
    last_saved: Path | None = None
    summary: dict[str, Any] = {}
    stop_reason = "max_steps"
    try:
        with _SignalFlag() as flag:
            while st["step"] < tcfg.max_steps:
                step = st["step"]
                t0 = time.perf_counter()
                micro = [_to_device(stage.train_batches.next_batch(), device) for _ in range(tcfg.grad_accum)]
                t_data = _clock(timing, device)
                # The whole step's supervised tokens on ALL ranks. DDP/FSDP average gradients over ranks, so each
                # rank's loss is its token-loss sum / global count x world size: the mean of the ranks'
                # gradients is then exactly the gradient of one process's loss on the global batch.
                local_count = torch.as_tensor(sum(stage.count_fn(b) for b in micro), device=device)
                n_supervised = distributed.all_reduce_sum(local_count).clamp(min=1)
                step_loss = torch.zeros((), device=device)
                extras: dict[str, torch.Tensor] = {}
                for i, batch in enumerate(micro):
                    # no gradient all-reduce until the last micro-batch
                    with distributed.gradient_sync(model, i == len(micro) - 1):
                        with autocast_context(device, st["precision"]):
                            loss_sum, _, extra = stage.loss_fn(forward_model, batch)
                        loss = loss_sum.float() / n_supervised * world.world_size
                        if step in injections["loss"]:
                            loss = loss * float("inf")
                        scaler.scale(loss).backward()
                    step_loss += loss.detach() / world.world_size
                    for k, v in extra.items():
                        extras[k] = extras.get(k, 0) + v.detach() / tcfg.grad_accum
                if world.distributed:  # the logged loss (and extras) are global means
                    keys = sorted(extras)
                    reduced = distributed.all_reduce_sum(torch.stack([step_loss, *(extras[k].float() for k in keys)]))
                    step_loss = reduced[0]
                    extras = {k: reduced[j + 1] / world.world_size for j, k in enumerate(keys)}
                if step in injections["grad"]:
                    next(iter(params)).grad.view(-1)[0] = float("nan")
                t_fwd_bwd = _clock(timing, device)
                scaler.unscale_(optimizer)
                max_norm = tcfg.grad_clip if tcfg.grad_clip > 0 else math.inf
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
                    grad_norm = grad_norm.full_tensor()
                lr = lr_at(step, tcfg) * st["lr_scale"]
                n_tokens = sum(b["input_ids"].numel() for b in micro) * world.world_size  # ranks' batches: same shape
                if not world.distributed and not scaler.is_enabled() and _skips_on_flag(optimizer):
                    # Decided on the device: the fused optimizer skips the update when found_inf is set, and the
                    # count is read at the next step that logs, evaluates, samples or saves.
                    bad = ~(torch.isfinite(step_loss) & torch.isfinite(grad_norm))
                    set_lr(optimizer, lr)
                    optimizer.found_inf = bad.float()
                    optimizer.step()
                    dev.add(bad)
                    window["loss"] += torch.where(bad, 0.0, step_loss)
                    window["steps"] += (~bad).int()
                    signum = flag.signum
                else:
                    loss_ok, grads_ok = bool(torch.isfinite(step_loss)), bool(torch.isfinite(grad_norm))
                    signum = flag.signum
                    if world.distributed:
                        # Every rank must take the same branch (skip, roll back, stop), so the flags are agreed on.
                        flags = distributed.all_reduce_sum(torch.tensor(
                            [not loss_ok, not grads_ok, flag.signum is not None], dtype=torch.float32, device=device))
                        loss_ok, grads_ok = bool(flags[0] == 0), bool(flags[1] == 0)
                        signum = (flag.signum or signal.SIGTERM) if flags[2] > 0 else None
                    if loss_ok and grads_ok:
                        set_lr(optimizer, lr)
                        scaler.step(optimizer)
                        scaler.update()
                        consecutive_bad = 0
                        window["loss"] += step_loss
                        window["steps"] += 1
                    else:
                        st["skipped_steps"] += 1
                        # Under fp16 an overflowing gradient is routine while the scaler finds its level (it halves
                        # the scale and we skip); it only counts towards a rollback once the scale is down to 1,
                        # where scaling can no longer be the cause.
                        scaler_routine = scaler.is_enabled() and loss_ok and scaler.get_scale() > 1.0
                        if scaler.is_enabled():
                            scaler.update()  # sees the inf recorded by unscale_ and backs off
                        if not scaler_routine:
                            consecutive_bad += 1
                            log.print(f"step {step}: non-finite {'loss' if not loss_ok else 'gradients'}, "
                                      f"update skipped")
                optimizer.zero_grad(set_to_none=True)
                t_optim = _clock(timing, device)
                st["step"] = step = step + 1
                st["tokens_seen"] += n_tokens
                if dev.pending and _sync_due(step, tcfg, stage, signum):
                    bad_steps, longest = dev.read_and_reset()
                    st["skipped_steps"] += bad_steps
                    if bad_steps:
                        log.print(f"step {step}: {bad_steps} update(s) skipped since the last report "
                                  f"(non-finite loss or gradients)")
                    consecutive_bad = longest
                if consecutive_bad >= tcfg.nonfinite_patience:
                    rollback("non-finite loss or gradients")
                    consecutive_bad = 0
                    dev.reset()
                    scaler = torch.amp.GradScaler(device.type, enabled=st["precision"] == "fp16")

                dt = time.perf_counter() - t0
                step_times.append(dt)
                window["tokens"] += n_tokens
                window["supervised"] += n_supervised
                window["time"] += dt
                window["data"] += t_data - t0
                window["fwd_bwd"] += t_fwd_bwd - t_data
                window["optim"] += t_optim - t_fwd_bwd
                window["n"] += 1

                if step % tcfg.log_every == 0 or step == tcfg.max_steps:
                    tokens_per_s = window["tokens"] / max(window["time"], 1e-9)
                    # FLOP/s of one process, as the peak is one device's (tokens_per_s counts all ranks' tokens)
                    achieved = flops_per_token * tokens_per_s / world.world_size
                    if peak and achieved > peak:  # the peak was under-measured: see observed_peak
                        log.print(f"step {step}: {achieved / 1e9:,.0f} GFLOP/s, above the measured peak of "
                                  f"{peak / 1e9:,.0f}; taking it as the peak")
                        peak = observed_peak(device, st["precision"], peak, achieved)
                    values: dict[str, Any] = {
                        "loss": (window["loss"] / max(int(window["steps"]), 1)).item(),
                        "lr": lr, "grad_norm": grad_norm.item(), "tokens_per_s": tokens_per_s,
                        "supervised_tokens_per_s": int(window["supervised"]) / max(window["time"], 1e-9),
                        "mfu": achieved / peak if peak else 0.0,  # never above 1: see observed_peak
                        "peak_mem_gb": peak_memory_bytes(device) / 1e9, "skipped_steps": st["skipped_steps"],
                        # where a step's time goes, ms per step (exact on CUDA only with --sync-timing)
                        **{f"{k}_ms": 1e3 * window[k] / window["n"] for k in ("data", "fwd_bwd", "optim")},
                    }
                    values.update({k: float(v) for k, v in extras.items()})
                    if scaler.is_enabled():
                        values["loss_scale"] = scaler.get_scale()
                    recent = sorted(step_times[-50:])[len(step_times[-50:]) // 2]
                    log.log(step, values)
                    log.print(progress_line(step, tcfg.max_steps, values, recent * (tcfg.max_steps - step)))
                    window = _new_window(device)

                evaluated = False
                if stage.val_batches and tcfg.eval_every and (step % tcfg.eval_every == 0 or step == tcfg.max_steps):
                    evaluated = True
                    # Every rank evaluates the same batches (so all agree on early stopping); under DDP on the model
                    # itself, since a forward through the wrapper alone on one rank would wait for the others.
                    val_loss, val_count, val_extras = evaluate(model if fsdp else raw, stage.val_batches(),
                                                               stage.loss_fn, device, st["precision"])
                    if world.distributed:  # GPU kernels need not agree to the last bit across ranks: average, so
                        # every rank takes the same early-stopping decision (one that differed would hang the rest)
                        val_loss = distributed.all_reduce_sum(
                            torch.tensor(val_loss, dtype=torch.float64, device=device)).item() / world.world_size
                    # val_count: what the mean is over (supervised tokens; pairs for DPO), so runs whose validation
                    # covered different amounts (eval_batches x batch_size windows) can be told apart
                    values = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)), "val_count": val_count,
                              **{f"val_{k}": v for k, v in val_extras.items()}}
                    if stage.val_bytes_per_token:
                        values["val_bpb"] = val_loss / math.log(2) / stage.val_bytes_per_token
                    log.log(step, values)
                    log.print(f"step {step}: val loss {val_loss:.4f} | ppl {values['val_ppl']:.2f}"
                              + (f" | bpb {values['val_bpb']:.4f}" if "val_bpb" in values else ""))
                    summary.update(values)
                    if st["best_val_loss"] is None or val_loss < st["best_val_loss"]:
                        st["best_val_loss"], st["evals_since_best"] = val_loss, 0
                    else:
                        st["evals_since_best"] += 1

                if (stage.sampler and tcfg.sample_every and world.is_main and not fsdp
                        and (step % tcfg.sample_every == 0 or step == tcfg.max_steps)):
                    raw.eval()
                    try:
                        stage.sampler(raw, step, log)
                    finally:
                        raw.train()

                if tcfg.save_every and step % tcfg.save_every == 0:
                    last_saved = save(step)
                if signum is not None or (not world.distributed and flag.signum is not None):
                    last_saved = save(step)
                    raise TrainingInterrupted(signum or flag.signum, last_saved)
                if evaluated and tcfg.early_stop_patience and st["evals_since_best"] >= tcfg.early_stop_patience:
                    log.print(f"step {step}: validation loss has not improved for {tcfg.early_stop_patience} "
                              f"evaluations (best {st['best_val_loss']:.4f}); stopping early")
                    stop_reason = "early_stop"
                    break
            if dev.pending:  # a run stopped between reports (early stop, signal) still counts its skips
                st["skipped_steps"] += dev.read_and_reset()[0]
            if last_saved is None or last_saved.name != ckpt.step_dir_name(st["step"]):
                last_saved = save(st["step"])
    finally:
        log.close()
    summary.update(step=st["step"], checkpoint=str(last_saved), stop_reason=stop_reason,
                   skipped_steps=st["skipped_steps"], rollbacks=st["rollbacks"])
    return summary


class _NonfiniteCounters:
    """Skipped steps and the longest run of consecutive ones, kept on the device between reads."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        self.run = torch.zeros((), dtype=torch.int64, device=self.device)
        self.longest = torch.zeros((), dtype=torch.int64, device=self.device)
        self.pending = False

    def add(self, bad: torch.Tensor) -> None:
        bad = bad.long()
        self.skipped += bad
        self.run = (self.run + 1) * bad
        self.longest = torch.maximum(self.longest, self.run)
        self.pending = True

    def read_and_reset(self) -> tuple[int, int]:
        """(skipped steps, longest run of bad steps) since the last read; the current run carries over."""
        skipped, longest = int(self.skipped), int(self.longest)
        self.skipped.zero_()
        self.longest.copy_(self.run)
        self.pending = False
        return skipped, longest


def _skips_on_flag(optimizer: torch.optim.Optimizer) -> bool:
    """Whether optimizer.step() honours a `found_inf` tensor (skips the update on the device when it is 1)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return bool(optimizer.defaults.get("fused"))
    return bool(getattr(optimizer, "supports_found_inf", False))


def _sync_due(step: int, tcfg: TrainConfig, stage: Stage, signum: int | None) -> bool:
    """Steps at which the host looks at the device's counters: before anything is logged, evaluated, sampled
    or saved, so that a checkpoint never holds a run of bad steps that should have been rolled back."""
    due = lambda every: bool(every) and step % every == 0  # noqa: E731
    return (step == tcfg.max_steps or signum is not None or due(tcfg.log_every) or due(tcfg.save_every)
            or (stage.val_batches is not None and due(tcfg.eval_every))
            or (stage.sampler is not None and due(tcfg.sample_every)))


def _new_window(device: torch.device) -> dict[str, Any]:
    """What the progress line averages over the steps since it was last printed."""
    return {"loss": torch.zeros((), device=device), "steps": 0, "tokens": 0, "supervised": 0, "time": 0.0,
            "data": 0.0, "fwd_bwd": 0.0, "optim": 0.0, "n": 0}


def _to_device(batch: Batch, device: torch.device) -> Batch:
    """Host batch -> device. On CUDA through pinned memory, so the copy is asynchronous and overlaps the
    work already queued."""
    if device.type == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


def _clock(sync_cuda: bool, device: torch.device | None = None) -> float:
    if sync_cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _restore(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, stage: Stage) -> dict[str, Any]:
    """Load weights, optimizer state and data position from a checkpoint into live objects. Checkpoints hold
    full weights and optimizer state, so any world size (DDP or FSDP2) resumes any other's."""
    state = ckpt.load_state(path)
    weights = ckpt.load_weights_file(path)
    fsdp = distributed.is_fsdp(model)
    raw = distributed.unwrap(model)
    if fsdp:
        if hasattr(raw, "state_dict_for_save"):  # the same strict key and shape check as load_weights
            expected = {k: tuple(v.shape) for k, v in raw.state_dict_for_save().items()}
            if {k: tuple(v.shape) for k, v in weights.items() if k in expected} != expected:
                raise NanoforgeError(f"{path}: weights do not match this model")
        distributed.load_full_weights(model, weights)
    elif hasattr(raw, "load_weights"):
        raw.load_weights(weights)
    else:
        raw.load_state_dict(weights)
    trainer = ckpt.load_trainer_file(path)
    try:
        if fsdp:
            distributed.load_full_optimizer_state(model, optimizer, trainer["optimizer"])
        else:
            optimizer.load_state_dict(trainer["optimizer"])
    except (ValueError, KeyError) as e:
        raise NanoforgeError(f"{path}: optimizer state does not match this model/stage: {e}") from None
    stage.train_batches.load_state_dict(state["data"])
    return {"run_state": state["run_state"], "trainer": trainer}


def _versions() -> dict[str, str]:
    import tokenizers
    return {"nanoforge": __version__, "torch": torch.__version__, "tokenizers": tokenizers.__version__}
