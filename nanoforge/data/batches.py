"""Batch sources for training and evaluation: deterministic, and resumable from a small JSON-able state.

Pretraining packs the token stream into fixed windows (no padding, documents separated by eos, as GPT-2 and
nanoGPT do). The order of the windows is a seeded permutation per epoch, so where a run is in the data is two
integers (epoch, cursor) that go into the checkpoint; resuming from them replays exactly the batches an
uninterrupted run would have seen.
"""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch

from nanoforge.data.shards import TokenShards
from nanoforge.errors import NanoforgeError


def _check_positive(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise NanoforgeError(f"{name} must be a positive integer, got {value!r}")


def _windows_batch(shards: TokenShards, window_ids, seq_len: int) -> dict[str, torch.Tensor]:
    """input_ids/labels for windows k (tokens [k*T, k*T + T + 1)); labels are the inputs shifted by one."""
    rows = np.stack([shards.read(int(k) * seq_len, seq_len + 1) for k in window_ids])  # (B, T+1)
    rows = torch.from_numpy(rows.astype(np.int64))
    return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}  # (B, T) each


class PretrainBatches:
    """Packed windows of seq_len+1 tokens, in a seeded random order per epoch, sharded across ranks.

    Window k covers tokens [k*seq_len, k*seq_len + seq_len + 1), k = 0..W-1 with W = (num_tokens-1)//seq_len,
    so consecutive windows share one token and every token but the first is a label exactly once per epoch.
    Each step consumes the next batch_size*world_size windows of the epoch's order (continuing into the next
    epoch's order when this one runs out); rank r takes its slice [r*B, (r+1)*B).
    """

    def __init__(self, shards: TokenShards, batch_size: int, seq_len: int, seed: int, rank: int = 0,
                 world_size: int = 1):
        _check_positive(batch_size=batch_size, seq_len=seq_len, world_size=world_size)
        if not 0 <= rank < world_size:
            raise NanoforgeError(f"rank {rank} is not in [0, world_size={world_size})")
        self.shards, self.batch_size, self.seq_len = shards, batch_size, seq_len
        self.seed, self.rank, self.world_size = int(seed), rank, world_size
        self.num_windows = max(shards.num_tokens - 1, 0) // seq_len
        needed = batch_size * world_size
        if self.num_windows < needed:
            raise NanoforgeError(
                f"{shards.directory} ({shards.split}) has {shards.num_tokens:,} tokens: {self.num_windows} "
                f"windows of {seq_len}+1 tokens, but one step needs {needed} (batch_size {batch_size} x "
                f"{world_size} processes), i.e. at least {needed * seq_len + 1:,} tokens; add data or lower "
                "--batch-size / --seq-len")
        self.epoch = 0
        self.cursor = 0  # windows of this epoch's order already consumed (by all ranks together)
        self._order_epoch, self._order = None, None

    def _order_for(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(self.num_windows, generator=generator)  # (W,)
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next batch for this rank: input_ids and labels, (batch_size, seq_len) int64 each."""
        step_windows = []
        needed = self.batch_size * self.world_size
        while needed:
            order = self._order_for(self.epoch)
            take = min(needed, self.num_windows - self.cursor)
            step_windows.extend(order[self.cursor:self.cursor + take].tolist())
            self.cursor += take
            needed -= take
            if self.cursor == self.num_windows:
                self.epoch, self.cursor = self.epoch + 1, 0
        mine = step_windows[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        return _windows_batch(self.shards, mine, self.seq_len)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """Where we are in the data, as plain JSON-able values (goes into the checkpoint's state.json)."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`. The data, seq_len and seed must be those of the run that saved it (else the
        position would point at different windows); batch size and process count may change."""
        for key in ("seed", "seq_len", "num_windows"):
            if key in state and state[key] != getattr(self, key):
                raise NanoforgeError(
                    f"cannot resume the data position: it was saved with {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)}; use the same data, --seq-len and --seed as the original run")
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor < self.num_windows:
            raise NanoforgeError(f"invalid data position in checkpoint: epoch {epoch}, cursor {cursor}")
        self.epoch, self.cursor = epoch, cursor


class EvalBatches:
    """Consecutive windows from the start of a split, in fixed batches: the same every time it is iterated.

    `bytes_per_token` (UTF-8 bytes of the split's source text per token) turns a mean loss in nats per token
    into bits per byte, a number comparable across tokenizers: bpb = loss / ln(2) / bytes_per_token.
    """

    def __init__(self, shards: TokenShards, batch_size: int, seq_len: int, max_batches: int):
        _check_positive(batch_size=batch_size, seq_len=seq_len, max_batches=max_batches)
        available = max(shards.num_tokens - 1, 0) // seq_len
        if available == 0:
            raise NanoforgeError(
                f"{shards.directory} ({shards.split}) has {shards.num_tokens} tokens, fewer than one window of "
                f"{seq_len}+1; prepare with a larger --val-fraction or evaluate with a smaller --seq-len")
        self.shards, self.batch_size, self.seq_len = shards, batch_size, seq_len
        self.num_windows = min(available, max_batches * batch_size)
        self.bytes_per_token = shards.num_bytes / shards.num_tokens

    def __len__(self) -> int:
        return math.ceil(self.num_windows / self.batch_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for start in range(0, self.num_windows, self.batch_size):
            windows = range(start, min(start + self.batch_size, self.num_windows))  # last batch may be smaller
            yield _windows_batch(self.shards, windows, self.seq_len)


def eval_batches(shards: TokenShards, batch_size: int, seq_len: int, max_batches: int) -> EvalBatches:
    """At most max_batches batches of consecutive windows from the start of `shards`; re-iterable, with
    `.bytes_per_token` for bits per byte."""
    return EvalBatches(shards, batch_size, seq_len, max_batches)
