"""What a run reports: a console progress line, metrics.jsonl, TensorBoard events, optional wandb.

metrics.jsonl holds one JSON object per logged step and is the source of truth for plots and tests. On
resume it is cut back to the checkpoint's step, so an interrupted-and-resumed run leaves the same log as an
uninterrupted one."""
import json
import math
import os
import resource
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch

from nanoforge.core.device import cpu_info
from nanoforge.core.durations import format_duration
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import read_json, write_atomic

# Dense bf16/fp16 tensor-core peaks in FLOP/s, from the vendors' datasheets (no sparsity). MFU divides by
# these. RTX 3090/4090 figures are for fp32 accumulate, which is what autocast matmuls use.
# Matched as substrings of the lower-cased device name, first match wins: a more specific name comes first.
GPU_PEAK_FLOPS = {
    "h200": 989e12, "h100 pcie": 756e12, "h100": 989e12, "a100": 312e12, "a10": 125e12, "l40s": 362e12,
    "l40": 181e12, "l4": 121e12, "4090": 165e12, "3090": 71e12, "3080": 59e12, "a6000": 155e12, "v100": 125e12,
    "t4": 65e12,
}


def gpu_table_entry(name: str) -> str | None:
    """The GPU_PEAK_FLOPS key for a device name such as torch.cuda.get_device_name() gives, or None."""
    low = name.lower()
    return next((key for key in GPU_PEAK_FLOPS if key in low), None)

# per process, keyed like the disk cache (see cpu_peak_key): the peak is looked up once per process
_cpu_peak_cache: dict[str, float] = {}
CPU_PEAK_FILE = "cpu_peak_flops.json"


def peak_flops(device: torch.device, precision: str) -> float:
    """The denominator of MFU: a datasheet figure for known GPUs, a measured matmul peak on CPU."""
    if device.type == "cuda":
        key = gpu_table_entry(torch.cuda.get_device_name(device))
        return 0.0 if key is None else GPU_PEAK_FLOPS[key] / (2 if precision == "fp32" else 1)  # TF32: about half rate
    if device.type == "cpu":
        return cpu_peak_flops(precision)
    return 0.0


def observed_peak(device: torch.device, precision: str, peak: float, achieved: float) -> float:
    """The peak to divide `achieved` (FLOP/s) by: `peak`, or `achieved` itself where the run went faster.

    A run cannot beat the machine's peak, so a run that does shows the peak was under-measured (on a shared CPU
    another process can take the cores during the measurement; we saw 50% of the usual figure). Clamping MFU
    to 100% would hide that and keep the wrong denominator for every later step and run; instead the faster
    figure becomes the peak (MFU reads 100% at that step), and on CPU it is kept in the disk cache, so later
    runs on this machine start from it."""
    if not peak or achieved <= peak:
        return peak
    return record_cpu_peak(precision, achieved) if device.type == "cpu" else achieved


def cpu_peak_flops(precision: str) -> float:
    """The practical matmul peak of this CPU: from the per-machine disk cache (see cpu_peak_cache_dir) when it
    holds one, else measured now and written there. Measured in each process, the figure moved by 2x on a
    shared 2-core machine (one process printed an MFU over 100%); cached, every run divides by the same one."""
    key = cpu_peak_key(precision)
    if key not in _cpu_peak_cache:
        cached = _read_peaks(cpu_peak_cache_dir() / CPU_PEAK_FILE).get(key)
        _cpu_peak_cache[key] = _write_peak(key, measure_cpu_matmul_flops(precision)) if cached is None else cached
    return _cpu_peak_cache[key]


def record_cpu_peak(precision: str, flops: float) -> float:
    """Raise the cached CPU peak to `flops` if it is higher (in this process and on disk); the peak now."""
    key = cpu_peak_key(precision)
    _cpu_peak_cache[key] = max(_cpu_peak_cache.get(key, 0.0), _write_peak(key, flops))
    return _cpu_peak_cache[key]


def cpu_peak_cache_dir() -> Path:
    """$NANOFORGE_CACHE_DIR, else $XDG_CACHE_HOME/nanoforge, else ~/.cache/nanoforge."""
    if os.environ.get("NANOFORGE_CACHE_DIR"):
        return Path(os.environ["NANOFORGE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanoforge"


def cpu_peak_key(precision: str) -> str:
    """What the peak depends on: the CPU model, the threads matmuls use, the precision and torch's kernels."""
    return f"{cpu_info()[0]} | {torch.get_num_threads()} threads | {precision} | torch {torch.__version__}"


def _read_peaks(path: Path) -> dict[str, float]:
    """The cache file's {key: FLOP/s}; empty when it is missing, unreadable or not what we wrote (a corrupt
    file is then measured over and replaced, never an error)."""
    try:
        data = read_json(path, "CPU peak cache")
    except NanoforgeError:
        return {}
    return {k: float(v) for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0}


def _write_peak(key: str, flops: float) -> float:
    """Merge `flops` into the cache file, keeping the highest figure seen for the key, written atomically
    (fsutil.write_atomic). Returns that highest figure. A cache that cannot be written is skipped."""
    path = cpu_peak_cache_dir() / CPU_PEAK_FILE
    peaks = _read_peaks(path)
    peaks[key] = max(peaks.get(key, 0.0), flops)
    with suppress(OSError):  # a read-only home, a full disk: the run goes on with the figure it has
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(peaks, indent=1, sort_keys=True) + "\n")
    return peaks[key]


def measure_cpu_matmul_flops(precision: str, seconds: float = 2.0, max_n: int = 2048) -> float:
    """Best of repeated n x n matmuls over about `seconds`: the practical peak this CPU reaches in this
    precision. n doubles from 256 until one matmul takes 50 ms (2048 for fp32 and bf16 on a 2-core machine;
    fp16, which CPUs mostly emulate at ~1 GFLOP/s, stops at 512), so the timer sees real work, and the best
    of many repeats is the one least disturbed by other processes."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16 if precision == "fp16" else torch.float32
    # a private generator: drawing from the global RNG here would shift the training stream (dropout) of the
    # first run in a process, and of a resumed run after its RNG state was restored
    gen = torch.Generator().manual_seed(0)
    n = 256
    while True:  # each size's first matmul is also the warm-up
        a, b = torch.randn(n, n, dtype=dtype, generator=gen), torch.randn(n, n, dtype=dtype, generator=gen)
        t0 = time.perf_counter()
        a @ b
        if time.perf_counter() - t0 >= 0.05 or n >= max_n:
            break
        n *= 2
    best, spent, repeats = math.inf, 0.0, 0
    while repeats < 3 or (spent < seconds and repeats < 100):
        t0 = time.perf_counter()
        a @ b
        took = time.perf_counter() - t0
        best, spent, repeats = min(best, took), spent + took, repeats + 1
    return 2 * n**3 / best


MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})


def op_split(prof, device_time: bool = False) -> dict[str, float]:
    """A profiled step's time by kind, ms: the matmuls (self time of mm/addmm/bmm), attention (the SDPA kernels',
    forward and backward) and the rest (element-wise work, norms, RoPE, casts, the loss, the optimizer). CPU time,
    or with `device_time` the GPU's (a CPU-side figure of a CUDA op is only its launch)."""
    times = {"matmul_ms": 0.0, "attention_ms": 0.0, "rest_ms": 0.0}
    for ev in prof.key_averages():
        t = (ev.self_device_time_total if device_time else ev.self_cpu_time_total) / 1000
        attention = "scaled_dot_product" in ev.key or "flash_attention" in ev.key or "efficient_attention" in ev.key
        times["matmul_ms" if ev.key in MATMUL_OPS else "attention_ms" if attention else "rest_ms"] += t
    return times


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # ru_maxrss is KiB on Linux: the process's peak resident memory, a fair figure for a CPU run.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# wandb.init's arguments we fill when the user's environment does not: wandb takes an argument over its environment
# variable, so passing ours would silence WANDB_DIR (files under RUN/wandb), WANDB_NAME (the run directory's name)
# and WANDB_RESUME (a resumed run may continue its wandb run)
WANDB_DEFAULTS = {"WANDB_DIR": "dir", "WANDB_NAME": "name", "WANDB_RESUME": "resume"}


def wandb_init_args(run_dir: Path, project: str, config: dict | None) -> dict[str, Any]:
    """wandb.init's keywords: the project (--wandb-project), the run's config, and for each of WANDB_DEFAULTS left
    unset our default. What we never pass (WANDB_MODE, WANDB_ENTITY, WANDB_RUN_ID, ...) wandb reads itself."""
    ours = {"dir": str(run_dir), "name": run_dir.name, "resume": "allow"}
    return {"project": project, "config": config,
            **{key: ours[key] for env, key in WANDB_DEFAULTS.items() if not os.environ.get(env)}}


class MetricsLog:
    """Appends to metrics.jsonl and TensorBoard from rank 0; prints a progress line."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb_project: str = "",
                 resume_step: int | None = None, config: dict | None = None, quiet: bool = False):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.quiet = quiet
        # samples written during training (see recipes/common.py) are cut back to the same step as the metrics
        for path in (self.path, self.run_dir / "samples.jsonl"):
            truncate_metrics(path, resume_step or 0)
        self.file = open(self.path, "a", encoding="utf-8")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: it costs ~1 s
            self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=resume_step)
        self.wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise NanoforgeError("wandb_project is set but wandb is not installed: pip install wandb") from None
            self.wandb = wandb.init(**wandb_init_args(self.run_dir, wandb_project, config))

    def log(self, step: int, values: dict[str, Any]) -> None:
        # "time" (Unix seconds) lets the run report give the wall time; it is not a metric to plot
        record = {"step": step, **values, "time": round(time.time(), 3)}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for key, value in numbers.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Samples generated at `step` ({"prompt", "text", ...} each): TensorBoard text per prompt, and with
        wandb one table per step (step, prompt, text) under "samples". RUN/samples.jsonl is written by the
        sampler itself (evaluate.write_samples), so it exists without TensorBoard or wandb."""
        if self.tb is not None:
            for i, sample in enumerate(samples):
                self.tb.add_text(f"samples/{i}", f"{sample['prompt']} → {sample['text']}", step)
        if self.wandb is not None:
            import wandb
            rows = [[step, sample["prompt"], sample["text"]] for sample in samples]
            self.wandb.log({"samples": wandb.Table(columns=["step", "prompt", "text"], data=rows)}, step=step)

    def print(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def truncate_metrics(path: Path, keep_through_step: int) -> None:
    """Drop records after `keep_through_step` (atomically), so a resumed run does not log steps twice."""
    if not path.exists():
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= keep_through_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by a kill is dropped
    write_atomic(path, "".join(kept))


def progress_line(step: int, max_steps: int, values: dict[str, Any], eta_s: float | None) -> str:
    parts = [f"step {step:>{len(str(max_steps))}}/{max_steps}", f"loss {values['loss']:.4f}", f"lr {values['lr']:.2e}"]
    if "reward_mean" in values:  # the RL stages: the figure that matters most
        parts.append(f"reward {values['reward_mean']:.3f}")
    if "grad_norm" in values:
        parts.append(f"gnorm {values['grad_norm']:.2f}")
    parts.append(f"{values['tokens_per_s']:,.0f} tok/s")
    if values.get("mfu"):
        parts.append(f"mfu {100 * values['mfu']:.1f}%")
    if "peak_mem_gb" in values:
        parts.append(f"mem {values['peak_mem_gb']:.2f}GB")
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)
