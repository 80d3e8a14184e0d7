"""The stage contract: a stage is a batch source plus a loss. The one loop (train/loop.py) trains any of them.

A loss returns (sum of per-token losses, number of supervised tokens, extra scalars to log); the loop divides
the sums of a whole accumulated step by the count of the whole step, so unequal micro-batches weigh right."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import nn

from nanoforge.data.batches import IGNORE

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


def count_supervised(batch: Batch) -> torch.Tensor:
    return (batch["labels"] != IGNORE).sum()
