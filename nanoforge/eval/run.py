"""`nanoforge eval`: evaluation of a trained run; and here, loss and bits per byte on data.

Five questions, one function each:

    evaluate_data                        how well does it predict this text?  loss, perplexity, bits per byte
    evaluate_choices (eval/choice.py)    does it pick the right answer?       accuracy per subject, 95% CI
    evaluate_gsm8k (eval/gsm8k.py)       does it solve the word problem?      accuracy, tool-call parse rate
    evaluate_toolcall (eval/toolcall.py) does it call tools right?            parse/valid/match rates, answers
    generate_samples (infer/samples.py)  what does it actually write?         a few completions, samples.jsonl

Bits per byte (bpb), the total NLL in bits over the text's UTF-8 bytes, does not depend on the tokenizer as loss per
token does: models with different vocabularies compare on one file (Gao et al. 2020, "The Pile", arXiv 2101.00027)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from nanoforge.core.config import load_toml
from nanoforge.data.batches import IGNORE
from nanoforge.data.prepare import prepare_dataset
from nanoforge.data.shards import TokenShards, check_tokenizer, read_manifest
from nanoforge.data.sources import data_kind, prepared_dir
from nanoforge.core.device import autocast_context, eval_mode, precision_note, resolve_precision
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import check_out_apart, write_atomic, writing
from nanoforge.eval.choice import evaluate_choices, padded_batch
from nanoforge.eval.common import Progress, format_table, load_run
from nanoforge.eval.options import EvalOptions
from nanoforge.eval.gsm8k import evaluate_gsm8k, read_gsm8k
from nanoforge.eval.toolcall import evaluate_toolcall, read_toolcall
from nanoforge.infer.samples import generate_samples, load_prompts, write_samples
from nanoforge.chat.tools import parse_tool_names
from nanoforge.weights.checkpoint import load_state
from nanoforge.weights.layout import read_parts


def own_validation_data(run) -> Path | None:
    """The prepared data directory a run trained on ([run] data of its config.toml) when it still exists, is
    pretraining or SFT data and its validation split holds tokens; None otherwise (a checkpoint of unknown
    origin, an HF directory, DPO pairs)."""
    path = Path(run)
    if path.parent.name == "checkpoints":  # a checkpoint directory: its run is two levels up
        path = path.parent.parent
    with contextlib.suppress(NanoforgeError, OSError, KeyError, TypeError):
        data = load_toml(path / "config.toml").get("run", {}).get("data")
        manifest = read_manifest(data) if data else None
        if manifest and manifest["kind"] in ("pretrain", "sft") and manifest["splits"]["val"]["tokens"] > 0:
            return Path(data)
    return None


def token_byte_lengths(tokenizer) -> np.ndarray | None:
    """UTF-8 bytes each token id stands for, (vocab,) int64; 0 for special tokens. None if the tokenizer is
    not byte-level BPE (then a token's bytes are not a property of the token alone). In byte-level BPE (GPT-2's
    scheme) every character of a token's string is one byte of the text mapped to a printable character, so the
    byte length is the string length: summed over a text's tokens, exactly the UTF-8 bytes bpb divides by."""
    from tokenizers import decoders, pre_tokenizers

    inner = tokenizer.backend
    if not isinstance(inner.decoder, decoders.ByteLevel):
        return None
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    specials = {i for i, t in inner.get_added_tokens_decoder().items() if t.special}
    out = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for i in range(tokenizer.vocab_size):
        piece = inner.id_to_token(i)
        if piece is None or i in specials:
            continue
        if not all(c in alphabet for c in piece):
            return None  # a non-special added token written as plain text: byte length unknown, don't guess
        out[i] = len(piece)
    return out


@dataclass
class _Totals:
    nll: float = 0.0  # nats, summed over scored tokens
    tokens: int = 0
    bytes: int = 0  # from the token byte table (0 when there is none)


DEFAULT_MAX_WINDOW = 2048


def _rows_pretrain(shards, eos_id: int, seq_len: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Non-overlapping windows over [eos] + the split's token stream: window k predicts stream tokens
    [k*T, k*T + T), so every token of the split (each document's first token included, as the continuation
    of an end-of-text, which is how the model saw it in training) is scored exactly once. The last window is shorter."""
    n = shards.num_tokens
    for lo in range(0, n, seq_len):
        hi = min(lo + seq_len, n)  # labels: split tokens [lo, hi); inputs: the hi-lo tokens before each
        # stream position p (with the leading eos at p=0) is split token p-1
        inputs = shards.read(lo - 1, hi - lo) if lo else np.concatenate([[eos_id], shards.read(0, hi - 1)])
        yield inputs.astype(np.int64), shards.read(lo, hi - lo).astype(np.int64)


def _rows_sft(shards, seq_len: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each conversation on its own (never attending to another), labels only on assistant tokens; one
    longer than the window is cut into consecutive windows, so every assistant token is still scored."""
    for i in range(shards.num_docs):
        tokens, mask = shards.doc(i)
        tokens = tokens.astype(np.int64)
        labels = np.where(mask[1:] == 1, tokens[1:], IGNORE)  # (n-1,)
        inputs = tokens[:-1]
        for start in range(0, len(inputs), seq_len):
            lab = labels[start:start + seq_len]
            if (lab != IGNORE).any():
                yield inputs[start:start + seq_len], lab


def _score_rows(model, rows: Iterable[tuple[np.ndarray, np.ndarray]], batch_size: int, device, precision: str,
                byte_table: np.ndarray | None, max_tokens: int | None, progress: Progress, totals: _Totals) -> bool:
    """Add the next-token NLL over all labelled positions of `rows` (right-padded into batches: causal attention
    never sees the padding) to `totals` until totals.tokens reaches max_tokens; whether max_tokens cut it short."""
    batch: list[tuple[np.ndarray, np.ndarray]] = []
    truncated = False

    def flush():
        inputs, labels = padded_batch(batch, device)
        with torch.no_grad(), autocast_context(device, precision):
            logits = model(inputs)  # (B, T, V)
        # float32 softmax: bf16 logits lose the small differences the loss is made of
        nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        totals.nll += float(nll.double())
        supervised = labels[labels != IGNORE].cpu().numpy()
        totals.tokens += int(supervised.size)
        if byte_table is not None:
            totals.bytes += int(byte_table[supervised].sum())
        batch.clear()
        progress.update(totals.tokens, f"loss {totals.nll / max(totals.tokens, 1):.4f}")

    for x, y in rows:
        if max_tokens is not None:
            room = max_tokens - totals.tokens - sum(int((b != IGNORE).sum()) for _, b in batch)
            if room <= 0:
                truncated = True
                break
            keep = np.flatnonzero(y != IGNORE)
            if len(keep) > room:  # cut the row after its room-th labelled token
                y = y[:keep[room - 1] + 1]
                x = x[:len(y)]
                truncated = True
        batch.append((x, y))
        if len(batch) == batch_size:
            flush()
        if truncated:
            break
    if batch:
        flush()
    return truncated


def evaluate_data(run, data_paths, batch_size: int = 8, seq_len: int | None = None, max_tokens: int | None = None,
                  precision: str = "fp32", device: str = "auto", progress: bool = True, split: str = "all",
                  log: Callable[[str], None] = print) -> dict:
    """Loss, perplexity and bits per byte of `run` (or a loaded (model, tokenizer) pair) on JSONL files (pretrain
    or SFT, tokenized with the run's own tokenizer, every record counting) or on `split` ("all", "train" or
    "val") of a prepared directory. Pretraining data: every token is scored once, in non-overlapping windows of
    seq_len (default: the model's max_seq_len, at most 2048) over the packed stream, as training validation
    does; bpb divides by the exact UTF-8 bytes of the texts (end-of-text tokens are scored, like any token, but
    have no bytes). SFT data: only assistant tokens (replies and their <|im_end|>) are scored, each conversation
    on its own; bpb divides by the bytes of those replies, counted from the tokens, which is exact for
    byte-level BPE (and left out for other tokenizers). Prints a table through `log` and returns the numbers."""
    precision = resolve_precision(precision, device)  # a bad one fails before the model loads
    if split not in ("all", "train", "val"):
        raise NanoforgeError(f"split {split!r} must be all, train or val")
    paths = [data_paths] if isinstance(data_paths, (str, os.PathLike)) else list(data_paths)
    prepared = prepared_dir(paths)  # before the model loads: a wrong --data fails at once
    model, tokenizer, dev, ckpt = load_run(run, device)
    window = model.cfg.max_seq_len  # the most positions the model attends over
    # MiniMind-3 and Qwen3 imports have 32768 positions: never windows of that by default
    seq_len = seq_len or min(window, DEFAULT_MAX_WINDOW)
    if not 1 <= seq_len <= window:
        raise NanoforgeError(f"--seq-len {seq_len} must be between 1 and the model's max_seq_len {window}")

    with tempfile.TemporaryDirectory(prefix="nanoforge-eval-") as tmp:
        if prepared is not None:
            check_tokenizer(prepared, tokenizer)
        data_dir = prepared or _prepare_raw(paths, tokenizer, Path(tmp) / "data",
                                            log if progress else (lambda *a: None))
        manifest = read_manifest(data_dir)
        kind = manifest["kind"]
        if kind not in ("pretrain", "sft"):
            raise NanoforgeError(f"{data_dir}: prepared as {kind!r}; evaluate pretraining or SFT data")
        splits = [s for s in ("train", "val") if split in ("all", s) and manifest["splits"][s]["tokens"] > 0]
        if not splits:
            raise NanoforgeError(f"{data_dir}: split {split!r} holds no tokens")
        byte_table = token_byte_lengths(tokenizer)
        total_tokens = sum(manifest["splits"][s]["tokens"] for s in splits)
        bar = Progress(progress, "eval tokens", total_tokens if kind == "pretrain" else None)
        totals, truncated = _score_splits(model, tokenizer.eos_id, data_dir, kind, splits, seq_len, batch_size,
                                          dev, precision, byte_table, max_tokens, bar)
        text_bytes = sum(manifest["splits"][s]["bytes"] for s in splits)

    if totals.tokens == 0:
        raise NanoforgeError(f"{paths[0]}: nothing to score (no supervised tokens)")
    loss = totals.nll / totals.tokens
    result = {"kind": kind, "data": [str(p) for p in paths], "checkpoint": str(ckpt) if ckpt else None,
              "tokens": totals.tokens, "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
              "seq_len": seq_len, "precision": precision, "truncated": truncated}
    nbytes = _add_bits_per_byte(result, totals, text_bytes, byte_table)
    rows_out = [["loss (nats/token)", f"{loss:.4f}"], ["perplexity", f"{result['perplexity']:.2f}"],
                ["bits per byte", f"{result['bpb']:.4f}" if "bpb" in result else "n/a"],
                ["tokens scored", f"{totals.tokens:,}"], ["bytes", f"{nbytes:,}" if nbytes else "n/a"]]
    log(format_table([f"{kind} data" + (" (cut at --max-tokens)" if truncated else ""), "value"], rows_out))
    return result


def _prepare_raw(paths, tokenizer, out: Path, log) -> Path:
    """Raw JSONL or text, tokenized with the run's own tokenizer into `out` (val_fraction 0: every record counts)."""
    kind = data_kind([str(p) for p in paths])
    if kind not in ("pretrain", "sft"):
        raise NanoforgeError(f"{paths[0]}: {kind} data; evaluate pretraining or SFT data "
                             "(a DPO pair has no single reference text)")
    prepare_dataset(kind, paths, tokenizer, out, val_fraction=0.0, workers=1, log=log)
    return out


def _score_splits(model, eos_id, data_dir: Path, kind: str, splits: list[str], seq_len: int, batch_size: int,
                  device, precision: str, byte_table, max_tokens: int | None, bar: Progress) -> tuple[_Totals, bool]:
    """The totals over `splits`, one after the other until max_tokens (if given), and whether they cut it short."""
    totals, truncated = _Totals(), False
    for s in splits:
        shards = TokenShards(data_dir, s)
        if kind == "pretrain" and eos_id is None:
            raise NanoforgeError("the tokenizer has no end-of-text token to start the stream with")
        rows = _rows_pretrain(shards, eos_id, seq_len) if kind == "pretrain" else _rows_sft(shards, seq_len)
        with eval_mode(model):
            truncated = _score_rows(model, rows, batch_size, device, precision, byte_table, max_tokens, bar, totals)
        if truncated:
            break
    bar.close()
    return totals, truncated


def _add_bits_per_byte(result: dict, totals: _Totals, text_bytes: int, byte_table) -> int:
    """Put bits per byte into `result` (or a note on why it is left out); return the bytes it divides by."""
    if result["kind"] == "pretrain" and not result["truncated"]:
        nbytes, how = text_bytes, "UTF-8 bytes of the texts"
    elif byte_table is not None:
        nbytes, how = totals.bytes, ("UTF-8 bytes of the scored tokens" if result["kind"] == "pretrain"
                                     else "UTF-8 bytes of the assistant replies")
    else:
        nbytes, how = 0, None
    if nbytes > 0:
        result.update(bytes=nbytes, bpb=totals.nll / math.log(2) / nbytes, bytes_counted=how)
    else:
        result["bpb_note"] = ("bits per byte left out: this tokenizer is not byte-level BPE, so the bytes of "
                              "the scored tokens cannot be counted exactly")
    return nbytes


# ------------------------------------------------------------------------------ what `nanoforge eval` calls

def run_eval(run, o: EvalOptions, log: Callable[[str], None] = print) -> dict:
    """`nanoforge eval RUN [--data F ...] [--bench PATH] [--gsm8k F] [--toolcall F] [--samples]`: any of them,
    loading the model once; --tools (calculator) are the built-in tools --gsm8k may call. Writes
    RUN/samples.jsonl for --samples (unless --no-write) and the whole result to --json.
    With none of them, the run's own held-out data: the whole validation split of the prepared directory it
    trained on (every token, whatever the batch size, unlike the capped validation during training).
    --split picks the split of a prepared directory (default: all of --data; val of the run's own data)."""
    # before the model loads, so that a wrong --tools or a bad file fails at once
    tool_names = parse_tool_names(o.tools)
    problems = read_gsm8k(o.gsm8k, o.limit) if o.gsm8k else None
    cases = read_toolcall(o.toolcall, o.limit) if o.toolcall else None
    data, split = o.data, o.split
    if not (data or o.bench or o.samples or o.gsm8k or o.toolcall):
        own = None if isinstance(run, tuple) else own_validation_data(run)
        if own is None:
            raise NanoforgeError("nothing to evaluate: give --data FILE..., --bench PATH, --gsm8k FILE, "
                                 "--toolcall FILE and/or --samples "
                                 f"({run} has no prepared data with a validation split to default to)")
        data, split = [str(own)], split or "val"
        log(f"evaluating on the {split} split of {own}, the data the run trained on")
    if o.json:  # before the model loads: a --json onto a file it reads is refused at once
        check_out_apart(o.json, [*([] if isinstance(run, tuple) else read_parts(run)), *(data or []), o.bench, o.dev,
                                 o.gsm8k, o.toolcall, o.prompts], "--json")
    model, tokenizer, dev_device, ckpt = load_run(run, o.device)
    loaded, precision = (model, tokenizer), resolve_precision(o.precision, dev_device)
    if not o.quiet:
        print(precision_note(precision, dev_device), file=sys.stderr)
    out: dict = {"checkpoint": str(ckpt) if ckpt else None}
    if data:
        out["data"] = evaluate_data(loaded, data, batch_size=o.batch_size, seq_len=o.seq_len, max_tokens=o.max_tokens,
                                    precision=precision, device=str(dev_device), progress=not o.quiet,
                                    split=split or "all", log=log)
    if o.bench:
        out["bench"] = evaluate_choices(loaded, o.bench, fmt=o.format, shots=o.shots, dev_path=o.dev,
                                        batch_size=o.batch_size, limit=o.limit, precision=precision,
                                        device=str(dev_device), progress=not o.quiet, log=log)
    generation = dict(think=o.think, batch_size=o.batch_size, max_new_tokens=o.max_new_tokens, max_turns=o.max_turns,
                      precision=precision, progress=not o.quiet, log=log)
    if o.gsm8k:
        out["gsm8k"] = {"file": str(o.gsm8k), **evaluate_gsm8k(model, tokenizer, problems, tools=tool_names,
                                                             **generation)}
    if o.toolcall:
        out["toolcall"] = {"file": str(o.toolcall), **evaluate_toolcall(model, tokenizer, cases, **generation)}
    if o.samples:
        prompts = load_prompts(o.prompts) if o.prompts else None
        got = generate_samples(model, tokenizer, prompts, chat=o.chat, precision=precision)  # its fixed-seed sampling
        for s in got:
            log(f"--- {s['prompt']!r}\n{s['prompt']}{s['text']}")
        out["samples"] = got
        if not o.no_write and ckpt is not None and not isinstance(run, tuple):
            step = None
            with contextlib.suppress(NanoforgeError):
                step = load_state(ckpt).get("step")
            run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else Path(run)
            out["samples_file"] = str(write_samples(run_dir, got, step))
    if o.json:
        with writing(o.json):
            Path(o.json).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(o.json, json.dumps(out, ensure_ascii=False, indent=1))
    return out
