"""Reading prepared data: a prepared directory's manifest, checked, and memmap views of its token shards
(data/prepare.py writes them). A prepared directory holds everything a training run needs, nothing else:

    manifest.json               format version, kind, tokenizer hash, sources, per-split counts and per shard
                                the sha256 of its files (the data's identity: `data_identity`)
    tokenizer/                  a copy of the tokenizer, so the directory is self-contained
    {split}_{k:05d}.bin         flat token ids (uint16 when the vocabulary fits, else uint32)
    {split}_{k:05d}.idx         int64 document start offsets within the shard, plus the final end offset
    {split}_{k:05d}.mask        (sft, dpo) uint8 loss mask, one per token: 1 on assistant tokens

dpo documents come in pairs (manifest "layout": "pairs"): 2i is pair i's chosen conversation, 2i+1 its rejected
one; the mask covers only the FINAL assistant reply and its <|im_end|>, and the train/val split is drawn per pair.
Flat binary shards read by memmap (as nanoGPT's train.bin): the OS pages data in and out, so training memory
stays flat however large the corpus, and any window is one slice away."""
import hashlib
import json
from pathlib import Path

import numpy as np

from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import read_json

FORMAT = "nanoforge-token-shards"
FORMAT_VERSION = 1
MASKED_KINDS = ("sft", "dpo")  # kinds stored with a loss mask


def read_manifest(directory) -> dict:
    """The manifest of a prepared directory, checked for format and version."""
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        raise NanoforgeError(f"{directory}: not a prepared dataset (no manifest.json); "
                             "create it with `nanoforge prepare`")
    manifest = read_json(path, "manifest", "; re-run `nanoforge prepare`")
    if manifest.get("format") != FORMAT:
        raise NanoforgeError(f"{path}: not a nanoforge token-shard manifest; re-run `nanoforge prepare`")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise NanoforgeError(f"{path}: format version {manifest.get('format_version')} but this nanoforge "
                             f"reads version {FORMAT_VERSION}; re-run `nanoforge prepare`")
    return manifest


def check_tokenizer(directory, tokenizer) -> None:
    """Raise if the data in `directory` was tokenized by a different tokenizer than `tokenizer`."""
    expected = read_manifest(directory)["tokenizer"]
    if expected["sha256"] != tokenizer.sha256:
        raise NanoforgeError(
            f"{directory} was prepared with a different tokenizer (sha256 {expected['sha256'][:12]}, vocab "
            f"{expected['vocab_size']}) than the one in use (sha256 {tokenizer.sha256[:12]}, vocab "
            f"{tokenizer.vocab_size}); re-run `nanoforge prepare` with this tokenizer, or train with "
            f"{Path(directory) / 'tokenizer'}")


def data_identity(manifest: dict) -> dict:
    """What a run records about its prepared data, to know it again on --resume: `shards`, a digest of every
    shard's content (the sha256 prepare recorded; None for data prepared before it did), `sources`, a digest of
    what the data was prepared from and how (input sha256s, tokenizer, kind, split counts: for older manifests),
    and the inputs themselves (name, bytes, sha256), to say what changed."""
    def digest(value) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()

    splits = manifest.get("splits", {})
    shard_sums = {split: [shard.get("sha256") for shard in entry.get("shards", [])] for split, entry in splits.items()}
    inputs = [{"name": Path(str(s.get("path", ""))).name, "bytes": s.get("bytes"), "sha256": s.get("sha256")}
              for s in manifest.get("sources", [])]
    made = {"kind": manifest.get("kind"), "tokenizer": manifest.get("tokenizer", {}).get("sha256"),
            "val_fraction": manifest.get("val_fraction"), "inputs": [(i["sha256"], i["bytes"]) for i in inputs],
            "splits": {split: (entry.get("tokens"), entry.get("docs")) for split, entry in splits.items()}}
    complete = all(all(sums) for sums in shard_sums.values())
    return {"shards": digest(shard_sums) if complete else None, "sources": digest(made), "inputs": inputs}


def identity_change(saved: dict, now: dict) -> str | None:
    """How the data `now` differs from the data `saved` (both `data_identity`), in words; None if it is the same
    (by the shards' content where both record it, else by what it was prepared from)."""
    key = "shards" if saved.get("shards") and now.get("shards") else "sources"
    if saved.get(key) == now.get(key):
        return None
    before = {i["name"]: i for i in saved.get("inputs", [])}
    after = {i["name"]: i for i in now.get("inputs", [])}
    changes = [f"{name} is another file ({_input(before[name])} at the start, {_input(after[name])} now)"
               for name in before if name in after and before[name]["sha256"] != after[name]["sha256"]]
    if set(before) != set(after):
        changes.append(f"it was prepared from {', '.join(sorted(before)) or '?'} at the start, now from "
                       f"{', '.join(sorted(after)) or '?'}")
    if not changes:
        changes.append("its inputs are the same files, but its shards hold other tokens (prepared with other "
                       "options or tokenizer, or edited since)")
    return "; ".join(changes)


def _input(source: dict) -> str:
    return f"sha256 {str(source.get('sha256'))[:12]}, {source.get('bytes')} bytes"


class TokenShards:
    """Read-only memmap view of one split of a prepared directory, as one flat token stream."""

    def __init__(self, directory, split: str):
        self.directory, self.split = Path(directory), split
        self.manifest = read_manifest(self.directory)
        splits = self.manifest.get("splits", {})
        if split not in splits:
            raise NanoforgeError(f"{self.directory}: no split {split!r} (have {', '.join(splits)})")
        entry = splits[split]
        self.dtype, self.kind = np.dtype(self.manifest["dtype"]), self.manifest["kind"]
        self.num_tokens, self.num_docs, self.num_bytes = (int(entry[k]) for k in ("tokens", "docs", "bytes"))
        self._tokens, self._idx, self._masks = [], [], []
        for shard in entry["shards"]:
            self._open_shard(shard)
        self._token_starts = np.cumsum([0] + [len(t) for t in self._tokens])  # (S+1,)
        self._doc_starts = np.cumsum([0] + [len(i) - 1 for i in self._idx])  # (S+1,)
        if self._token_starts[-1] != self.num_tokens or self._doc_starts[-1] != self.num_docs:
            raise NanoforgeError(f"{self.directory / 'manifest.json'}: split {split} totals do not match its "
                                 "shards; re-run `nanoforge prepare`")

    def _open_shard(self, shard: dict) -> None:
        base = self.directory / shard["name"]
        tokens, docs = int(shard["tokens"]), int(shard["docs"])
        self._tokens.append(self._map(base.with_suffix(".bin"), self.dtype, tokens))
        idx = self._map(base.with_suffix(".idx"), np.dtype(np.int64), docs + 1)
        if idx[0] != 0 or idx[-1] != tokens:
            raise NanoforgeError(f"{base.with_suffix('.idx')}: offsets do not match the manifest; "
                                 "the file is corrupt, re-run `nanoforge prepare`")
        self._idx.append(idx)
        if self.kind in MASKED_KINDS:
            self._masks.append(self._map(base.with_suffix(".mask"), np.dtype(np.uint8), tokens))

    @staticmethod
    def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
        if not path.is_file():
            raise NanoforgeError(f"{path}: missing; the prepared directory is incomplete, re-run `nanoforge prepare`")
        expected, actual = count * dtype.itemsize, path.stat().st_size
        if actual != expected:
            raise NanoforgeError(f"{path}: {actual} bytes but the manifest says {expected}; the file is corrupt "
                                 "or truncated, re-run `nanoforge prepare`")
        if count == 0:
            return np.zeros(0, dtype=dtype)  # numpy cannot memmap an empty file
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,))

    @property
    def has_mask(self) -> bool:
        return bool(self._masks)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the split's stream, across shard boundaries; a copy."""
        return self._gather(self._tokens, start, length)

    def read_mask(self, start: int, length: int) -> np.ndarray:
        """Loss mask [start, start+length) for sft and dpo data."""
        if not self._masks:
            raise NanoforgeError(f"{self.directory}: {self.kind} data has no loss mask")
        return self._gather(self._masks, start, length)

    def _gather(self, arrays: list, start: int, length: int) -> np.ndarray:
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) out of range for {self.num_tokens} tokens")
        parts = []
        shard = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        while length > 0:
            local = start - int(self._token_starts[shard])
            take = min(length, len(arrays[shard]) - local)
            parts.append(arrays[shard][local:local + take])
            start, length, shard = start + take, length - take, shard + 1
        if not parts:
            return np.zeros(0, dtype=arrays[0].dtype if arrays else self.dtype)
        return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])

    def doc_offsets(self) -> np.ndarray:
        """Start offset of every document in the split's flat stream, plus the end: (num_docs + 1,) int64."""
        parts = [idx[:-1] + int(start) for idx, start in zip(self._idx, self._token_starts[:-1])]
        return np.concatenate(parts + [np.array([self.num_tokens], dtype=np.int64)]).astype(np.int64)

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens (and the loss mask for sft/dpo, else None) of document i of the split."""
        if not 0 <= i < self.num_docs:
            raise IndexError(f"document {i} out of range for {self.num_docs} documents")
        shard = int(np.searchsorted(self._doc_starts, i, side="right")) - 1
        local = i - int(self._doc_starts[shard])
        start, end = int(self._idx[shard][local]), int(self._idx[shard][local + 1])
        mask = np.array(self._masks[shard][start:end]) if self._masks else None
        return np.array(self._tokens[shard][start:end]), mask
