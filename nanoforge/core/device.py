"""Where and in what precision a process computes: the device a --device name means, the precision
--precision auto means there (and falls back to when fp16 keeps overflowing), and autocast for a precision."""
import contextlib
import ctypes
import functools
import platform

import torch

from nanoforge.core.config import PRECISIONS, ModelConfig, TrainConfig, build_config
from nanoforge.core.errors import NanoforgeError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise NanoforgeError(f"--device {name!r} is not a device (auto, cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NanoforgeError("--device cuda was asked for but CUDA is not available on this machine")
    return device


def autocast_context(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def keep_freed_memory() -> None:
    """glibc: keep freed memory for reuse, or every CPU step page-faults its large tensors back in, zeroed by the
    kernel (6% of a bf16 mini-model step, docs/perf.md). No-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0), libc.mallopt(-1, -1)  # M_MMAP_MAX 0: no mappings; M_TRIM_THRESHOLD -1: never trim
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def eval_mode(model):
    """model.eval() for the duration, then back to whatever mode it was in (a caller's training model)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


# CPU flags of native bf16 arithmetic: x86's AVX-512 BF16 and AMX, ARM's FEAT_BF16 ("bf16" in Linux's Features).
# Without one, PyTorch emulates bf16 on the CPU: measured 8.6x slower than fp32 on an AVX2-only AMD EPYC.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@functools.cache  # read once per process: every run resolves its precision and MFU key from it
def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """This CPU's model name and feature flags. Linux has them in /proc/cpuinfo; elsewhere (macOS, Windows)
    there are no flags to read, so no native bf16 is claimed and --precision auto picks fp32 there, which
    is never the slow choice (PyTorch's CPU bf16 is only fast where these flags are)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            block = f.read().split("\n\n", 1)[0]  # the first processor's entry
    except OSError:
        block = ""
    first = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in block.splitlines())}
    flags = frozenset((first.get("flags") or first.get("Features") or "").split())  # Features: ARM's flags
    return first.get("model name") or platform.processor() or platform.machine() or "unknown cpu", flags


def native_bf16(device: torch.device, cpu: tuple[str, set[str]] | None = None) -> tuple[bool, str]:
    """Whether `device` computes bf16 natively, and the hardware in words. cpu: a (model, flags) to judge
    instead of this machine's cpu_info(). MPS counts as native, as it always has here."""
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return native, f"{torch.cuda.get_device_name(device)} has {'' if native else 'no '}native bf16"
    if device.type != "cpu":
        return True, f"{device.type} computes bf16"
    model, flags = cpu or cpu_info()
    have = [f for f in NATIVE_BF16_FLAGS if f in flags]
    return bool(have), (f"this CPU ({model}) has native bf16: {', '.join(have)}" if have else f"this CPU ({model}) "
                        "has no native bf16 (avx512_bf16/amx_bf16): bf16 would be emulated, about 8x slower than fp32")


def resolve_precision(precision: str, device: torch.device | str, cpu: tuple[str, set[str]] | None = None) -> str:
    """What --precision means on `device`, the one rule of every command: auto is bf16 where the device computes
    it natively, else fp32 (also the fallback where fp16 keeps overflowing: bf16 has fp32's range); any other
    value is itself."""
    if precision not in PRECISIONS:
        raise NanoforgeError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    device = resolve_device(device) if isinstance(device, str) else device
    return "bf16" if native_bf16(device, cpu)[0] else "fp32"


def build_run_config(*layers, **kwargs) -> tuple[ModelConfig, TrainConfig]:
    """config.build_config, with --precision auto resolved for --device: a run's config never says auto, and
    config.toml records the precision it computes in (so a resume keeps it)."""
    mcfg, tcfg = build_config(*layers, **kwargs)
    tcfg.precision = resolve_precision(tcfg.precision, tcfg.device)
    return mcfg, tcfg


def precision_note(precision: str, device: torch.device, cpu: tuple[str, set[str]] | None = None) -> str:
    """The line a run prints about its precision: what it is and why, or a warning where bf16 is emulated."""
    native, hardware = native_bf16(device, cpu)
    auto = "bf16" if native else "fp32"
    if precision == "bf16" and not native:
        return f"warning: bf16 was asked for, but {hardware.replace('would be', 'is')}; --precision auto picks fp32"
    return f"precision: {precision} ({'auto' if precision == auto else 'auto would pick ' + auto}: {hardware})"
