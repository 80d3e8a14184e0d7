"""Non-finite loss or gradients: skip the step, count it, and say when to roll back.

A step whose loss or gradient norm is not finite makes no update and is counted in `skipped_steps`;
`nonfinite_patience` such steps in a row ask the loop to roll back to the last checkpoint (train/loop.py).
Under fp16 an overflowing gradient is routine while the scaler finds its level (it halves the scale and the
step is skipped); it counts towards a rollback only once the scale is down to 1, where scaling can no longer
be the cause. The guard owns the fp16 scaler for that reason.

Where the optimizer can skip an update on a device flag (fused AdamW's `found_inf`; one process, no fp16
scaler), the decision stays on the device and the counts are read only at steps that log, evaluate, sample or
save (`settle`), so the host never waits for the GPU on the other steps. Elsewhere each step reads the flags,
as it must to decide; under torchrun the ranks agree on them, so every rank takes the same branch."""
import signal
from typing import Any

import torch

from nanoforge.train import distributed
from nanoforge.train.optim import set_lr


class NonFiniteGuard:
    """`step()` updates or skips; `settle()` says when to roll back; `reset()` after a rollback."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, precision: str, patience: int,
                 state: Any, log: Any):
        self.optimizer, self.device, self.patience = optimizer, device, patience
        self.state, self.log = state, log  # the RunState whose skipped_steps it counts; where it reports
        self.reset(precision)

    def reset(self, precision: str) -> None:
        """A fresh start: no bad steps pending, and a new scaler for `precision` (fp16 only)."""
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=precision == "fp16")
        self.counters = _DeviceCounters(self.device)
        self.consecutive = 0

    def step(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float,
             signum: int | None) -> tuple[torch.Tensor | None, torch.Tensor | int, int | None]:
        """Step the optimizer at `lr` unless the loss or gradients are not finite. Returns the loss to average
        into the progress line (None if skipped), the number of steps it stands for (1, 0, or a device count),
        and the stop signal the ranks agree on."""
        if self.decides_on_device:
            bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
            set_lr(self.optimizer, lr)
            self.optimizer.found_inf = bad.float()  # the fused kernel skips the update where this is 1
            self.optimizer.step()
            self.counters.add(bad)
            return torch.where(bad, 0.0, loss), (~bad).int(), signum
        loss_ok, grads_ok = bool(torch.isfinite(loss)), bool(torch.isfinite(grad_norm))
        if distributed.world().distributed:
            flags = distributed.all_reduce_sum(torch.tensor(
                [not loss_ok, not grads_ok, signum is not None], dtype=torch.float32, device=self.device))
            loss_ok, grads_ok = bool(flags[0] == 0), bool(flags[1] == 0)
            signum = (signum or signal.SIGTERM) if flags[2] > 0 else None
        if loss_ok and grads_ok:
            set_lr(self.optimizer, lr)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.consecutive = 0
            return loss, 1, signum
        self._skip(loss_ok)
        return None, 0, signum

    @property
    def decides_on_device(self) -> bool:
        return not distributed.world().distributed and not self.scaler.is_enabled() and skips_on_flag(self.optimizer)

    def _skip(self, loss_ok: bool) -> None:
        self.state.skipped_steps += 1
        routine = self.scaler.is_enabled() and loss_ok and self.scaler.get_scale() > 1.0
        if self.scaler.is_enabled():
            self.scaler.update()  # sees the inf recorded by unscale_ and backs off
        if not routine:
            self.consecutive += 1
            self.log.print(f"step {self.state.step}: non-finite {'loss' if not loss_ok else 'gradients'}, "
                           f"update skipped")

    def settle(self, due: bool) -> bool:
        """After a step: read the device's counts when `due` (a step that logs, evaluates, samples or saves);
        True when `patience` bad steps in a row call for a rollback."""
        if self.counters.pending and due:
            bad_steps, longest = self.counters.read_and_reset()
            self.state.skipped_steps += bad_steps
            if bad_steps:
                self.log.print(f"step {self.state.step}: {bad_steps} update(s) skipped since the last report "
                               f"(non-finite loss or gradients)")
            self.consecutive = longest
        return self.consecutive >= self.patience

    def flush(self) -> None:
        """A run stopped between reports (early stop, a signal) still counts its skips."""
        if self.counters.pending:
            self.state.skipped_steps += self.counters.read_and_reset()[0]


class _DeviceCounters:
    """Skipped steps and the longest run of consecutive ones, kept on the device between reads."""

    def __init__(self, device: torch.device):
        self.skipped, self.run, self.longest = (torch.zeros((), dtype=torch.int64, device=device) for _ in range(3))
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


def skips_on_flag(optimizer: torch.optim.Optimizer) -> bool:
    """Whether optimizer.step() honours a `found_inf` tensor (skips the update on the device when it is 1)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return bool(optimizer.defaults.get("fused"))
    return bool(getattr(optimizer, "supports_found_inf", False))
