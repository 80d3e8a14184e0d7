"""The training loop's throughput meter: loss, tokens/s, MFU and where each step's time went (data,
forward+backward, optimizer), averaged over the steps since the last progress line; and the time left."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoforge.train.metrics import observed_peak
from nanoforge.train.state import Run


@dataclass
class Window:
    """What the progress line averages over the steps since it was last printed."""
    loss: torch.Tensor
    steps: torch.Tensor | int = 0  # steps whose loss counts (skipped ones do not)
    tokens: int = 0
    supervised: torch.Tensor | int = 0
    n: int = 0
    time: float = 0.0
    phases: dict[str, float] = field(default_factory=lambda: {"data": 0.0, "fwd_bwd": 0.0, "optim": 0.0})


class Throughput:
    """Loss, tokens/s, MFU and where the time went, over the steps since the last progress line."""

    def __init__(self, device: torch.device, flops_per_token: float, peak: float):
        self.device, self.flops_per_token, self.peak = device, flops_per_token, peak
        self.window = Window(torch.zeros((), device=device))
        self.step_times: list[float] = []

    def add(self, kept_loss, kept_steps, n_tokens: int, n_supervised, clock: PhaseClock) -> None:
        w = self.window
        if kept_loss is not None:
            w.loss += kept_loss
            w.steps += kept_steps
        dt = clock.total()
        self.step_times.append(dt)
        w.tokens, w.supervised, w.time, w.n = w.tokens + n_tokens, w.supervised + n_supervised, w.time + dt, w.n + 1
        for phase, seconds in clock.phases.items():
            w.phases[phase] += seconds

    def take(self, run: Run) -> dict[str, Any]:
        """The window's figures; starts a new window."""
        w = self.window
        tokens_per_s = w.tokens / max(w.time, 1e-9)
        achieved = self.flops_per_token * tokens_per_s / run.world.world_size  # one process's, as the peak is
        if self.peak and achieved > self.peak:  # the peak was under-measured: see observed_peak
            run.log.print(f"step {run.state.step}: {achieved / 1e9:,.0f} GFLOP/s, above the measured peak of "
                          f"{self.peak / 1e9:,.0f}; taking it as the peak")
            self.peak = observed_peak(self.device, run.state.precision, self.peak, achieved)
        values = {"loss": (w.loss / max(int(w.steps), 1)).item(), "tokens_per_s": tokens_per_s,
                  "supervised_tokens_per_s": int(w.supervised) / max(w.time, 1e-9),
                  "mfu": achieved / self.peak if self.peak else 0.0,  # never above 1: see observed_peak
                  # where a step's time goes, ms per step (exact on CUDA only with --sync-timing)
                  **{f"{k}_ms": 1e3 * v / w.n for k, v in w.phases.items()}}
        self.window = Window(torch.zeros((), device=self.device))
        return values

    def seconds_left(self, steps_left: int) -> float:
        recent = sorted(self.step_times[-50:])
        return recent[len(recent) // 2] * steps_left


class PhaseClock:
    """Where a step's time goes: data, forward+backward, optimizer (exact on CUDA only when it syncs)."""

    def __init__(self, sync_cuda: bool, device: torch.device):
        self.sync_cuda, self.device = sync_cuda, device
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        if self.sync_cuda:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phases[phase], self.last = now - self.last, now

    def total(self) -> float:
        return time.perf_counter() - self.start
