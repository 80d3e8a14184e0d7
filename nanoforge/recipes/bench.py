"""`nanoforge bench`: what the real training loop does on this machine. Tokens/s, MFU, peak memory and the time
split between data, forward+backward and optimizer, for any preset, precision and micro-batch; with
`--compare-naive`, the same model trained by the naive fp32 loop a first training script would be, side by side.

How the figures are made (each printed with the table):
- "ours" runs `train/loop.py:train()` itself on seeded random tokens (or --data) in a temporary run directory;
  tokens/s and the data/fwd_bwd/optim split are medians of the logged steps after `warmup` (sync_timing on).
- MFU = flops_per_token * tokens/s / peak, FLOPs by the PaLM convention 6N + 12 L h s (model.flops_per_token); the
  peak is the datasheet entry of train/metrics.py's GPU table on CUDA, on CPU the best measured 1024 x 1024
  matmul rate in the run's precision.
- Each configuration runs in its own process, so its peak memory is its own: the CUDA allocator's peak on a GPU,
  the process's peak resident memory (ru_maxrss) on CPU."""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from nanoforge.core.config import TRAIN_FIELDS, config_dicts
from nanoforge.core.device import autocast_context, build_run_config, precision_note, resolve_device
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import write_atomic
from nanoforge.model.gpt import GPT
from nanoforge.chat.tokenizer import load_tokenizer
from nanoforge.train import metrics
from nanoforge.train.loop import Stage, train
from nanoforge.train.metrics import observed_peak, op_split, peak_memory_bytes
from nanoforge.train.microbatch import fit_micro_batch
from nanoforge.train.objectives import causal_lm_loss
from nanoforge.train.optim import build_optimizer
from nanoforge.recipes.common import lm_batches


class RandomTokens:
    """A BatchSource of uniformly random tokens from a fixed seed: the benchmark measures the model and the
    loop, not the disk. Batches are (batch, seq_len) input_ids and the next-token labels."""

    def __init__(self, vocab: int, batch: int, seq: int, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab, self.batch, self.seq, self.i = vocab, batch, seq, 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        self.i += 1
        x = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.generator)  # (B, T+1)
        return {"input_ids": x[:, :-1], "labels": x[:, 1:]}

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["i"]


def peak_and_source(device: torch.device, precision: str) -> tuple[float, str]:
    """MFU's denominator and where it came from, in words."""
    if device.type == "cpu":
        # A benchmark measures the CPU peak afresh and keeps the higher of that and the cached figure, so that
        # a figure cached on a busy machine is corrected by the next benchmark on a quiet one.
        peak = metrics.record_cpu_peak(precision, metrics.measure_cpu_matmul_flops(precision))
        return peak, (f"measured CPU matmul peak ({peak / 1e9:.0f} GFLOP/s, best {precision} matmul now or "
                      f"cached in {metrics.cpu_peak_cache_dir()})")
    peak = metrics.peak_flops(device, precision)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = metrics.gpu_table_entry(name)
        if key is None:
            return 0.0, f"{name} is not in the GPU table of train/metrics.py: MFU unknown"
        note = "bf16/fp16 dense" if precision != "fp32" else "TF32 dense, half the bf16 entry"
        return peak, f"GPU table entry {key!r} ({peak / 1e12:.0f} TFLOP/s {note}) for {name}"
    return 0.0, f"no peak known for {device.type}: MFU unknown"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_settings(steps: int, warmup: int) -> dict[str, Any]:
    """What a benchmark run of the loop fixes: log (and so time) every step, exact phase timing, no
    validation, samples, TensorBoard or intermediate checkpoints."""
    fixed = {"max_steps": warmup + steps, "log_every": 1, "eval_every": 0, "save_every": 0, "sample_every": 0,
             "tensorboard": False, "wandb_project": "", "sync_timing": True, "keep_last": 1}
    return {k: v for k, v in fixed.items() if k in TRAIN_FIELDS}


def bench_ours(mcfg, tcfg, steps: int, warmup: int, data: str | None = None) -> dict[str, Any]:
    """The real loop, `warmup + steps` steps; medians over the last `steps`."""
    for key, value in bench_settings(steps, warmup).items():
        setattr(tcfg, key, value)
    if data:
        tok = load_tokenizer(Path(data) / "tokenizer")
        mcfg.vocab_size = max(mcfg.vocab_size, tok.vocab_size)
        source = lm_batches(Path(data), tcfg, tok, quiet=True)[0]
    else:
        source = RandomTokens(mcfg.vocab_size, tcfg.batch_size, tcfg.seq_len, seed=tcfg.seed)
    torch.manual_seed(tcfg.seed)
    model = GPT(mcfg)
    device = resolve_device(tcfg.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory(prefix="nanoforge-bench-") as run_dir:
        train(Stage("bench", source, causal_lm_loss), model, mcfg, tcfg, run_dir, quiet=True)
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "tokens_per_s" in r][warmup:]
    if not timed:
        raise NanoforgeError("the benchmark logged no timed steps: raise --steps")
    tokens_per_step = tcfg.batch_size * tcfg.seq_len * tcfg.grad_accum
    out = _figures(model, device, tcfg.precision, tcfg.seq_len, tokens_per_step,
                   statistics.median(r["tokens_per_s"] for r in timed), peak_memory_bytes(device))
    for phase in ("data_ms", "fwd_bwd_ms", "optim_ms"):  # the loop logs them at every progress line
        out[phase] = statistics.median(r[phase] for r in timed)
    out["final_loss"] = timed[-1]["loss"]
    return {**out, **profiled_split(model, mcfg, tcfg, device)}


def loop_step(model, mcfg, tcfg, device: torch.device):
    """One training step of the loop's pieces on seeded random tokens, as a function: autocast at tcfg.precision,
    causal_lm_loss, backward, clip 1.0, the loop's optimizer (train/optim.py), zero_grad (for the profile of
    profiled_split; the loop's own logging, guards and data path left out)."""
    source = RandomTokens(mcfg.vocab_size, tcfg.batch_size, tcfg.seq_len, seed=tcfg.seed + 1)
    optimizer = build_optimizer(model, tcfg, device)

    def step() -> None:
        batch = {k: v.to(device) for k, v in source.next_batch().items()}
        with autocast_context(device, tcfg.precision):
            loss_sum, n, _ = causal_lm_loss(model, batch)
        (loss_sum.float() / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
    return step


def profiled_split(model, mcfg, tcfg, device: torch.device) -> dict[str, float]:
    """One more step of the benched model, eager, under torch.profiler (after one unprofiled step): its time in
    matmuls, attention and the rest (train/metrics.op_split), with the matmuls' own FLOP rate."""
    step = loop_step(model, mcfg, tcfg, device)
    model.train()
    step()
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
    split = op_split(prof, device_time=cuda)
    cfg = model.cfg  # the 6N part of the FLOPs is the matmuls'; attention's 12 L h s is in attention
    matmul_flops = model.flops_per_token(tcfg.seq_len) - 12.0 * cfg.n_layers * cfg.d_model * tcfg.seq_len
    split["matmul_flops_per_s"] = matmul_flops * tcfg.batch_size * tcfg.seq_len / max(split["matmul_ms"], 1e-9) * 1e3
    return split


def naive_loop(model: torch.nn.Module, source, steps: int, device: torch.device, on_step=None) -> torch.nn.Module:
    """What a first training script looks like: fp32, mean loss per micro-batch, default (non-fused) AdamW,
    no accumulation, no autocast. `on_step(data_s, fwd_bwd_s, optim_s)` gets each step's phase times."""
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.1, fused=False)
    for _ in range(steps):
        t0 = time.perf_counter()
        b = {k: v.to(device) for k, v in source.next_batch().items()}
        _sync(device)
        t1 = time.perf_counter()
        logits = model(b["input_ids"])  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), b["labels"].reshape(-1))
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        _sync(device)
        if on_step:
            on_step(t1 - t0, t2 - t1, time.perf_counter() - t2)
    return model


def bench_naive(mcfg, tcfg, steps: int, warmup: int) -> dict[str, Any]:
    """The naive loop on the same model shape and micro-batch; medians over the last `steps`."""
    device = resolve_device(tcfg.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(tcfg.seed)
    model = GPT(mcfg)
    times: list[tuple[float, float, float]] = []
    naive_loop(model, RandomTokens(mcfg.vocab_size, tcfg.batch_size, tcfg.seq_len, seed=tcfg.seed),
               warmup + steps, device, on_step=lambda *t: times.append(t))
    timed = times[warmup:]
    tokens_per_step = tcfg.batch_size * tcfg.seq_len
    step_s = statistics.median(sum(t) for t in timed)
    out = _figures(model, device, "fp32", tcfg.seq_len, tokens_per_step, tokens_per_step / step_s,
                   peak_memory_bytes(device))
    for i, phase in enumerate(("data_ms", "fwd_bwd_ms", "optim_ms")):
        out[phase] = 1000 * statistics.median(t[i] for t in timed)
    return out


def _figures(model, device: torch.device, precision: str, seq_len: int, tokens_per_step: int,
             tokens_per_s: float, peak_mem: int) -> dict[str, Any]:
    peak, source = peak_and_source(device, precision)
    flops = model.flops_per_token(seq_len)
    if peak and flops * tokens_per_s > peak:  # under-measured: the run's own rate is the peak (observed_peak)
        peak = observed_peak(device, precision, peak, flops * tokens_per_s)
        source += f", raised to this run's {peak / 1e9:.0f} GFLOP/s"
    return {"device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
            "precision": precision, "precision_note": precision_note(precision, device), "params": model.num_params(),
            "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_s,
            "step_ms": 1000 * tokens_per_step / tokens_per_s, "flops_per_token": flops,
            "mfu": flops * tokens_per_s / peak if peak else None, "peak_flops": peak, "peak_source": source,
            "peak_memory_gb": peak_mem / 1e9}


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    mcfg, tcfg = build_run_config(spec["preset"], spec["config"], spec["overrides"])  # before the probe runs in it
    fit_micro_batch(mcfg, tcfg, log=lambda m: print(m, file=sys.stderr))  # --micro-batch auto|N
    out = (bench_naive(mcfg, tcfg, spec["steps"], spec["warmup"]) if spec["kind"] == "naive"
           else bench_ours(mcfg, tcfg, spec["steps"], spec["warmup"], spec.get("data")))
    return {**out, "batch_size": tcfg.batch_size, "grad_accum": tcfg.grad_accum}


def run_bench(preset: str | None = None, config_file: str | None = None, overrides: dict[str, Any] | None = None,
              steps: int = 10, warmup: int = 2, data: str | None = None, compare_naive: bool = False,
              log=print) -> dict[str, Any]:
    """Measure ours (and the naive loop) each in a fresh process; returns {"config": ..., "ours": ..., "naive": ...}."""
    overrides = {**(overrides or {}), **bench_settings(steps, warmup)}
    mcfg, tcfg = build_run_config(preset, config_file, overrides)  # errors here, before any process starts
    overrides["precision"] = tcfg.precision  # the children measure what this process picked and reports
    results: dict[str, Any] = {"config": config_dicts(mcfg, tcfg), "steps": steps, "warmup": warmup,
                               "data": data or "random tokens (seed %d)" % tcfg.seed,
                               "torch": torch.__version__, "threads": torch.get_num_threads()}
    for kind in ["ours"] + (["naive"] if compare_naive else []):
        log(f"bench: {kind} loop, {warmup} warm-up + {steps} timed steps ...")
        spec = {"kind": kind, "preset": preset, "config": config_file, "overrides": overrides, "steps": steps,
                "warmup": warmup, "data": data}
        results[kind] = _run_child(spec)
    return results


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, "-m", "nanoforge.recipes.bench", json.dumps(spec)], capture_output=True,
                       text=True, env=env)
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-8:])
        raise NanoforgeError(f"the {spec['kind']} benchmark failed (exit {r.returncode}):\n{tail}")
    return json.loads(line[len("RESULT "):])


def format_bench(res: dict[str, Any]) -> str:
    t, m = res["config"]["train"], res["config"]["model"]
    ours, naive = res["ours"], res.get("naive")
    cols = [("nanoforge", ours)] + ([("naive fp32", naive)] if naive else [])

    def row(label: str, fmt, key: str, ratio: bool = False) -> str:
        cells = [fmt(c.get(key)) if c.get(key) is not None else "-" for _, c in cols]
        if naive:
            a, b = ours.get(key), naive.get(key)
            cells.append(f"{a / b:.2f}x" if ratio and a and b else "")
        return f"| {label} | " + " | ".join(cells) + " |"

    flags = [f for f in ("compile", "activation_checkpointing") if t.get(f)]
    head = (f"# {ours['params'] / 1e6:.1f}M parameters ({m['n_layers']} layers, d_model {m['d_model']}), "
            f"micro-batch {ours.get('batch_size', t['batch_size'])} x {t['seq_len']} x grad-accum "
            f"{ours.get('grad_accum', t['grad_accum'])}, "
            f"{ours['precision']}{', ' + ', '.join(flags) if flags else ''} on {ours['device']}; "
            f"{res['data']}; median of {res['steps']} steps after {res['warmup']} warm-up; torch {res['torch']}, "
            f"{res['threads']} threads")
    lines = [head, ours["precision_note"], "",
             "| | " + " | ".join(name for name, _ in cols) + (" | ours / naive |" if naive else " |"),
             "|---|" + "---:|" * (len(cols) + (1 if naive else 0)),
             row("precision", str, "precision"),
             row("tokens/s", lambda v: f"{v:,.0f}", "tokens_per_s", True),
             row("MFU", lambda v: f"{100 * v:.2f}%", "mfu"),  # against different peaks: no ratio
             row("peak memory", lambda v: f"{v:.2f} GB", "peak_memory_gb", True),
             row("step time", lambda v: f"{v:,.1f} ms", "step_ms", True),
             row("  data", lambda v: f"{v:,.1f} ms", "data_ms"),
             row("  forward+backward", lambda v: f"{v:,.1f} ms", "fwd_bwd_ms"),
             row("  optimizer", lambda v: f"{v:,.1f} ms", "optim_ms"),
             "",
             f"MFU: FLOPs per token by the PaLM convention 6N + 12 L h s = {ours['flops_per_token'] / 1e6:.0f} "
             f"MFLOP; peak: {ours['peak_source']}"
             + (f"; naive fp32 against {naive['peak_source']}" if naive else "") + ".",
             split_line(ours),
             "Peak memory: " + ("CUDA allocator peak" if ours["device"] not in ("cpu",) else
                                "peak resident memory of the measuring process") + "; each loop in its own process."]
    return "\n".join(lines)


def split_line(ours: dict[str, Any]) -> str:
    """Where a step goes: matmuls (and their rate against the peak), attention, the rest."""
    parts = {"matmuls": ours["matmul_ms"], "attention": ours["attention_ms"], "the rest": ours["rest_ms"]}
    total = sum(parts.values()) or 1.0
    rate = ours["matmul_flops_per_s"]
    peak = f", {100 * rate / ours['peak_flops']:.0f}% of the peak" if ours.get("peak_flops") else ""
    cells = [f"{name} {ms:,.0f} ms ({100 * ms / total:.0f}%)" for name, ms in parts.items()]
    cells[0] += f" at {rate / 1e9:,.0f} GFLOP/s{peak}"
    return ("Split of one more step (eager, under torch.profiler; its total is not the median step): "
            + ", ".join(cells) + ".")


def write_json(res: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":  # a measuring child of run_bench
    try:
        result = _child(json.loads(sys.argv[1]))
    except NanoforgeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print("RESULT " + json.dumps(result), flush=True)
