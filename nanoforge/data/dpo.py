"""DPO batches and the reference model's log-probabilities, computed once and cached.

DPO (Rafailov et al. 2023, arXiv 2305.18290) compares, for each preference pair, how much more likely the
policy makes the chosen answer than the frozen reference does, against the same for the rejected answer. The
reference's per-sequence log-probabilities are so a property of the data: computed in one pass before training
and stored beside the run, instead of a second model forward every step as MiniMind runs (a third of the step's
compute and a second copy of the weights). The cache is keyed by a hash of the reference weights and the data.

In a prepared "dpo" split (data/shards.py) document 2i is pair i's chosen conversation and 2i+1 its rejected
one, each with a loss mask on its final assistant reply only. A batch of B pairs has 2B rows, the B chosen then
the B rejected in the same order, right-padded to the longest:
    input_ids  (2B, L) int64   tokens[:-1] of each conversation, pad_id after its end
    labels     (2B, L) int64   tokens[1:] where the mask is 1 (the final reply and its <|im_end|>), else -100
    ref_logps  (2B,)   float32 sum over the labelled tokens of log p_ref(token), same rows"""
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nanoforge.data.batches import IGNORE, EpochOrder
from nanoforge.data.shards import TokenShards
from nanoforge.core.device import autocast_context, eval_mode
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import write_atomic

CACHE_VERSION = 1


def _check_dpo_shards(shards: TokenShards) -> None:
    if shards.kind != "dpo" or not shards.has_mask:
        raise NanoforgeError(f"{shards.directory}: prepared as {shards.kind!r} data; DPO needs "
                             f"`nanoforge prepare --kind dpo`")
    if shards.num_docs % 2:
        raise NanoforgeError(f"{shards.directory} ({shards.split}): {shards.num_docs} documents, not whole "
                             "chosen/rejected pairs; re-run `nanoforge prepare --kind dpo`")


def pair_fits(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """(P,) bool: both conversations of pair p fit a row of seq_len inputs (n tokens give n-1 inputs).

    Pairs that do not fit are skipped, not truncated: cutting the reply would compare two answers that
    were not the ones judged, and cutting the prompt from the left would drop the system message or the
    question, whose tokens are identical in both rows anyway. `DPOBatches.skipped` says how many."""
    doc_fits = (lengths - 1 <= seq_len) & (lengths >= 2)
    return doc_fits[0::2] & doc_fits[1::2]


def _row(shards: TokenShards, offsets: np.ndarray, doc: int, length: int, pad_id: int):
    """input_ids and labels of one conversation, padded to `length`."""
    start, n = int(offsets[doc]), int(offsets[doc + 1] - offsets[doc])
    tokens = shards.read(start, n).astype(np.int64)
    mask = shards.read_mask(start, n).astype(bool)
    ids = np.full(length, pad_id, dtype=np.int64)
    labels = np.full(length, IGNORE, dtype=np.int64)
    ids[:n - 1] = tokens[:-1]
    labels[:n - 1] = np.where(mask[1:], tokens[1:], IGNORE)
    return ids, labels


def _rows(shards: TokenShards, offsets: np.ndarray, docs: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids/labels (len(docs), longest-1) for the given documents, right-padded."""
    length = max(int(offsets[d + 1] - offsets[d]) for d in docs) - 1
    ids, labels = zip(*(_row(shards, offsets, d, length, pad_id) for d in docs))
    return {"input_ids": torch.from_numpy(np.stack(ids)), "labels": torch.from_numpy(np.stack(labels))}


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(R, T, V) logits, (R, T) labels -> (R,) float32 sum of log p(label) over the labelled positions.

    float32 for the softmax: DPO's signal is a difference of two sums of hundreds of log-probabilities,
    and bf16's 8-bit mantissa would drown it."""
    token_logps = -F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE,
                                   reduction="none")  # (R, T), 0 where ignored
    return token_logps.sum(dim=1)


# ---------------------------------------------------------------------------------------------- reference

@torch.no_grad()
def compute_reference_logps(model: nn.Module, shards: TokenShards, batch_size: int, seq_len: int,
                            precision: str = "fp32", device: str | torch.device = "cpu",
                            pad_id: int = 0) -> np.ndarray:
    """(num_docs,) float32: for every conversation of `shards`, the sum of log-probabilities the model gives
    its final reply (the masked tokens). NaN for the documents of pairs that do not fit seq_len (never used).
    Conversations go through the model `batch_size` at a time, sorted by length so padding stays small."""
    _check_dpo_shards(shards)
    device = torch.device(device)
    offsets = shards.doc_offsets()  # (D+1,)
    lengths = np.diff(offsets)
    out = np.full(shards.num_docs, np.nan, dtype=np.float32)
    docs = np.flatnonzero(np.repeat(pair_fits(lengths, seq_len), 2))  # the documents of the pairs that fit
    docs = docs[np.argsort(lengths[docs], kind="stable")]
    with eval_mode(model):
        for start in range(0, len(docs), batch_size):
            chunk = docs[start:start + batch_size].tolist()
            batch = _rows(shards, offsets, chunk, pad_id)
            ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
            with autocast_context(device, precision):
                logits = model(ids)  # (R, T, V)
            out[chunk] = sequence_logps(logits, labels).cpu().numpy()
    return out


def exact_weights_sha256(model: nn.Module) -> str:
    """sha256 over the model's parameter and buffer names, shapes, dtypes and bytes: two models with this
    fingerprint compute the same function, whatever file (or no file) they came from."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _data_fingerprint(shards: TokenShards) -> str:
    manifest = shards.manifest
    key = {"tokenizer": manifest["tokenizer"]["sha256"], "sources": [s["sha256"] for s in manifest["sources"]],
           "split": shards.split, "split_entry": manifest["splits"][shards.split]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def reference_logps(model: nn.Module, shards: TokenShards, cache_dir: str | Path, batch_size: int, seq_len: int,
                    precision: str = "fp32", device: str | torch.device = "cpu", pad_id: int = 0,
                    fingerprint: str | None = None, log: Callable[[str], None] = print) -> np.ndarray:
    """compute_reference_logps, cached as cache_dir/ref_logps_{split}.npy with a .json key beside it.

    The key holds the reference fingerprint (default: `exact_weights_sha256(model)`; the dpo stage may pass
    the sha256 of the init checkpoint's model.safetensors instead), the data fingerprint, seq_len and
    precision. Any difference recomputes and overwrites the cache; a match loads it."""
    cache_dir = Path(cache_dir)
    npy, meta = cache_dir / f"ref_logps_{shards.split}.npy", cache_dir / f"ref_logps_{shards.split}.json"
    key = {"version": CACHE_VERSION, "reference": fingerprint or exact_weights_sha256(model),
           "data": _data_fingerprint(shards), "seq_len": seq_len, "precision": precision,
           "num_docs": shards.num_docs}
    if npy.is_file() and meta.is_file():
        try:
            saved = json.loads(meta.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            saved = None
        if saved == key:
            values = np.load(npy, allow_pickle=False)
            if values.shape == (shards.num_docs,):
                log(f"reference log-probs for {shards.split}: reusing {npy}")
                return values
        log(f"reference log-probs for {shards.split}: {npy} was computed for another reference model, data or "
            f"settings; recomputing")
    else:
        log(f"reference log-probs for {shards.split}: computing for {shards.num_docs // 2:,} pairs")
    values = compute_reference_logps(model, shards, batch_size, seq_len, precision, device, pad_id)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = npy.with_name(f".{npy.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, values, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    meta.unlink(missing_ok=True)  # the key goes last: a crash in between leaves no key, hence a recompute
    os.replace(tmp, npy)
    write_atomic(meta, json.dumps(key, indent=2) + "\n")
    return values


# ---------------------------------------------------------------------------------------------- batches

class DPOBatches(EpochOrder):
    """Batches of `batch_size` preference pairs, in a seeded order per epoch, sharded across ranks (EpochOrder:
    resuming replays exactly the batches an uninterrupted run would have seen). Pairs whose chosen or rejected
    conversation exceeds seq_len inputs are skipped (`self.skipped`); see `pair_fits`."""

    def __init__(self, shards: TokenShards, ref_logps: np.ndarray, batch_size: int, seq_len: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, pad_id: int = 0, shuffle: bool = True):
        self._init_order(batch_size, seq_len, seed, rank, world_size, "pair")
        _check_dpo_shards(shards)
        ref_logps = np.asarray(ref_logps, dtype=np.float32)
        if ref_logps.shape != (shards.num_docs,):
            raise NanoforgeError(f"ref_logps has shape {ref_logps.shape}, but {shards.directory} "
                                 f"({shards.split}) has {shards.num_docs} conversations")
        self.shards, self.ref_logps, self.pad_id, self.shuffle = shards, ref_logps, pad_id, shuffle
        self.offsets = shards.doc_offsets()  # (D+1,)
        self.num_pairs = shards.num_docs // 2
        self.data_size = {"pairs": self.num_pairs}
        self.usable = np.flatnonzero(pair_fits(np.diff(self.offsets), seq_len))  # (P',) pair indices
        self.skipped = self.num_pairs - len(self.usable)
        if np.isnan(ref_logps[2 * self.usable]).any() or np.isnan(ref_logps[2 * self.usable + 1]).any():
            raise NanoforgeError("ref_logps has no value for some usable pairs; it was computed with a smaller "
                                 "seq_len; recompute it with this one")
        if shuffle and len(self.usable) < batch_size * world_size:
            raise NanoforgeError(
                f"{shards.directory} ({shards.split}): {len(self.usable)} of {self.num_pairs} pairs fit "
                f"--seq-len {seq_len} ({self.skipped} too long), fewer than one step needs ({batch_size} x "
                f"{world_size}); add data, raise --seq-len or lower --batch-size")

    @property
    def sequences_per_epoch(self) -> int:
        """Pairs in one pass over the data (those that fit seq_len)."""
        return len(self.usable)

    def summary(self) -> str:
        return (f"{len(self.usable):,} of {self.num_pairs:,} pairs fit --seq-len {self.seq_len}; "
                f"{self.skipped:,} skipped as too long")

    def _make_order(self, epoch: int) -> np.ndarray:
        return self._shuffled(self.usable, epoch) if self.shuffle else self.usable

    def batch(self, pairs: list[int]) -> dict[str, torch.Tensor]:
        """The batch of the given pair indices: chosen rows, then rejected rows."""
        docs = [2 * p for p in pairs] + [2 * p + 1 for p in pairs]
        out = _rows(self.shards, self.offsets, docs, self.pad_id)
        out["ref_logps"] = torch.from_numpy(self.ref_logps[docs].copy())  # (2B,)
        return out

    def next_batch(self) -> dict[str, torch.Tensor]:
        return self.batch([int(p) for p in self._step_items()])

    def eval_batches(self, max_batches: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """The usable pairs in file order, batch_size at a time, at most max_batches batches (validation)."""
        limit = len(self.usable) if max_batches is None else min(len(self.usable), max_batches * self.batch_size)
        for start in range(0, limit, self.batch_size):
            yield self.batch(self.usable[start:min(start + self.batch_size, limit)].tolist())


def count_pairs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a DPO step's loss is normalised by (the loop's Stage.count_fn): the number of pairs."""
    return torch.tensor(batch["ref_logps"].shape[0] // 2, device=batch["ref_logps"].device)
