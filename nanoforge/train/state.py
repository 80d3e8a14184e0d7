"""A live run: where it is (RunState, saved in every checkpoint), what it works with (Run), and its checkpoints:
save, resume, restore, and the rollback the non-finite guard asks for.

Checkpoints hold full weights and optimizer state (FSDP2 gathers them on rank 0), so any world size resumes any
other's; the layout on disk is weights/checkpoint.py's."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanoforge import __version__
from nanoforge.core.checksums import DamagedFile
from nanoforge.core.config import TrainConfig
from nanoforge.core.device import resolve_precision
from nanoforge.core.errors import NanoforgeError
from nanoforge.weights import checkpoint as ckpt
from nanoforge.train import distributed
from nanoforge.train.guard import NonFiniteGuard
from nanoforge.train.stage import Stage
from nanoforge.train.world import World


@dataclass
class RunState:
    """Where a run is: everything here goes into state.json, so a resumed run continues exactly."""
    step: int = 0
    precision: str = "fp32"  # changes once if fp16 keeps overflowing (to resolve_precision("auto"))
    lr_scale: float = 1.0  # halved (rollback_lr_factor) by each rollback
    skipped_steps: int = 0
    rollbacks: int = 0
    best_val_loss: float | None = None
    evals_since_best: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0  # the training loop's wall time so far: a resumed run continues its time budget

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> RunState:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in known})

@dataclass
class Run:
    """What one call of train() works with: the stage, the model three ways, the optimizer, the state."""
    stage: Stage
    tcfg: TrainConfig
    run_dir: Path
    world: World
    device: torch.device
    raw: nn.Module  # the model itself: saved, measured, loaded, sampled
    model: nn.Module  # raw wrapped in DDP or FSDP2 under torchrun (raw itself in one process)
    forward_model: nn.Module  # model, compiled with --compile: what the training forwards run through
    optimizer: torch.optim.Optimizer
    state: RunState
    log: Any
    guard: NonFiniteGuard
    config: dict[str, Any] = field(default_factory=dict)  # config_dicts(mcfg, tcfg), saved in state.json
    injections: dict[str, set[int]] = field(default_factory=dict)  # NANOFORGE_INJECT_NONFINITE, for tests

    @property
    def fsdp(self) -> bool:
        return distributed.is_fsdp(self.model)

def save(run: Run) -> Path:
    """A checkpoint of the current step (on every rank: FSDP2 gathers full weights and optimizer state, so any
    world size can resume; only rank 0 writes)."""
    weights = run.raw.state_dict_for_save()
    if run.fsdp:
        weights = distributed.full_state_dict(run.model, list(weights))
        optimizer_state = distributed.full_optimizer_state(run.model, run.optimizer)
    else:
        optimizer_state = run.optimizer.state_dict()
    step = run.state.step
    path = run.run_dir / "checkpoints" / ckpt.step_dir_name(step)
    if run.world.is_main:
        trainer = {"optimizer": optimizer_state, "rng": ckpt.rng_states()}
        if run.guard.scaler.is_enabled():
            trainer["scaler"] = run.guard.scaler.state_dict()
        state = {"stage": run.stage.name, "run_state": asdict(run.state), "data": run.stage.train_batches.state_dict(),
                 "config": run.config, "run": run.stage.run_info, "versions": versions()}
        path = ckpt.save_checkpoint(run.run_dir, step, weights, trainer, state, keep_last=run.tcfg.keep_last)
    distributed.barrier()  # no rank reads or rolls back to a checkpoint before it is complete
    return path


def rollback(run: Run, reason: str) -> None:
    """Back to the last checkpoint's weights and optimizer, the data moving on past the bad batches, with the
    learning rate scaled down (and fp16 swapped for a wider format)."""
    state, tcfg = run.state, run.tcfg
    last = ckpt.latest_checkpoint(run.run_dir)
    if last is None:
        raise NanoforgeError(f"{reason} for {tcfg.nonfinite_patience} consecutive steps at step {state.step}, and "
                             f"there is no checkpoint to roll back to yet; lower --lr or use --precision bf16/fp32")
    data_state = run.stage.train_batches.state_dict()  # keep moving forward: the bad batches stay behind us
    saved = restore(last, run.model, run.optimizer, run.stage)
    run.stage.train_batches.load_state_dict(data_state)
    state.lr_scale *= tcfg.rollback_lr_factor
    state.rollbacks += 1
    precision = resolve_precision("auto", run.device) if state.precision == "fp16" else state.precision
    run.log.print(f"step {state.step}: {reason} {tcfg.nonfinite_patience} times in a row; rolled back to "
                  f"{last.name} (step {saved['run_state']['step']}), lr scale now {state.lr_scale:g}"
                  + (f", precision {state.precision} -> {precision}" if precision != state.precision else ""))
    state.precision = precision
    run.log.log(state.step, {"event": "rollback", "to_step": saved["run_state"]["step"],
                             "lr_scale": state.lr_scale, "precision": state.precision})
    run.guard.reset(precision)

def resume(run: Run, quiet: bool) -> None:
    """Weights, optimizer, scaler, data position, RNG and run state from the run's latest checkpoint."""
    last = ckpt.latest_checkpoint(run.run_dir)  # there is one: train/rundir.py fresh_run_guard checked
    try:
        saved = restore(last, run.model, run.optimizer, run.stage)
    except DamagedFile as e:
        raise DamagedFile(f"--resume: {e}; {ckpt.previous_intact_advice(last)}") from None
    for key, value in asdict(RunState.from_dict(saved["run_state"])).items():
        setattr(run.state, key, value)  # the guard holds this same object
    run.guard.reset(run.state.precision)
    if "scaler" in saved["trainer"] and run.guard.scaler.is_enabled():
        run.guard.scaler.load_state_dict(saved["trainer"]["scaler"])
    ckpt.set_rng_states(saved["trainer"]["rng"])
    if not quiet:
        print(f"resuming {run.stage.name} from {last} (step {run.state.step})", flush=True)

def restore(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, stage: Stage) -> dict[str, Any]:
    """Load weights, optimizer state and data position from a checkpoint into live objects. Checkpoints hold
    full weights and optimizer state, so any world size (DDP or FSDP2) resumes any other's."""
    state = ckpt.load_state(path)
    weights = ckpt.load_weights_file(path)
    fsdp, raw = distributed.is_fsdp(model), distributed.unwrap(model)
    if fsdp:  # the same strict key and shape check as load_weights
        expected = {k: tuple(v.shape) for k, v in raw.state_dict_for_save().items()}
        if {k: tuple(v.shape) for k, v in weights.items() if k in expected} != expected:
            raise NanoforgeError(f"{path}: weights do not match this model")
        distributed.load_full_weights(model, weights)
    else:
        raw.load_weights(weights)
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


def versions() -> dict[str, str]:
    import tokenizers
    return {"nanoforge": __version__, "torch": torch.__version__, "tokenizers": tokenizers.__version__}
