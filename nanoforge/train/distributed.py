"""Many processes through `torchrun --nproc-per-node N -m nanoforge pretrain ...`: the process group (this process's
place in it is train/world.py's), DDP / FSDP2 wrapping, and the few collectives the loop needs. With one process
(no torchrun, or WORLD_SIZE=1) every function here is a no-op or the identity, so the loop reads the same either
way.
Each rank reads its own slice of every step's global batch (the batch sources take rank and world_size), so
the global batch is batch_size x world_size x grad_accum. Only rank 0 writes files."""
from __future__ import annotations

import atexit
import contextlib
import datetime
import inspect
import os
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nanoforge.core.errors import NanoforgeError
from nanoforge.train.world import is_main, world


def _timeout_minutes() -> float:
    text = os.environ.get("NANOFORGE_DIST_TIMEOUT_MIN", "10")
    minutes = float(text) if text.replace(".", "", 1).isdigit() else 0.0
    if not minutes > 0:
        raise NanoforgeError(f"NANOFORGE_DIST_TIMEOUT_MIN={text!r} must be a positive number of minutes")
    return minutes


def setup(device: torch.device) -> torch.device:
    """Join the process group (once) and return this rank's device: cuda:LOCAL_RANK under CUDA (nccl),
    the given device otherwise (gloo)."""
    w = world()
    if not w.distributed:
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # --device cuda:N: make N current (synchronize, bf16 checks, streams)
        return device
    if device.type == "cuda":
        device = torch.device("cuda", w.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # a collective (or joining) that waits this long for a peer fails the rank, and torchrun the job
        timeout = datetime.timedelta(minutes=_timeout_minutes())
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=w.rank, world_size=w.world_size,
                                timeout=timeout, store=_attempt_store(timeout))
        atexit.register(dist.destroy_process_group)
    return device


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The store the group joins through. torchrun's static rendezvous, and c10d's unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, keep one store for every attempt, where a restarted rank would read the
    dead attempt's addresses and wait for peers that are gone: each attempt gets keys of its own, named by the
    launcher's restart count. Nodes disagree on that count (one restarted for another's failure keeps its
    own), so a job on several nodes that may restart is refused at its start. None: torch's env:// store."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if env.get("GROUP_WORLD_SIZE", "1") != "1" and env.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
        raise NanoforgeError(f"torchrun may restart this job on {env['GROUP_WORLD_SIZE']} nodes (--max-restarts "
                             f"{env['TORCHELASTIC_MAX_RESTARTS']}) with one store for all attempts, where a restarted"
                             " node would wait on the dead ranks. Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                             "torchrun --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB ...")
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"nanoforge/attempt{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def leave(code: int) -> int:
    """End a process that joined the group: leave it and exit with `code` at once, skipping the interpreter's
    teardown; without a group, return `code`. Gloo's worker threads can still hold the last collectives'
    finished work, whose tensors need the GIL to be freed; if the interpreter is already finalizing then, the
    thread aborts the process ("terminate called without an active exception", SIGABRT after a rank's last
    step; pytorch#179291), and torchrun fails a run that ended well. Files are closed by then (the loop's
    `finally`), and only the standard streams are left to flush."""
    if not (dist.is_available() and dist.is_initialized()):
        return code
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def main_first(device: torch.device | None = None):
    """Rank 0 runs the body first (e.g. preparing data into the run directory), the others after it, when
    its results are on disk."""
    w, group = world(), None
    if w.distributed:  # ranks > 0 may wait here for hours (rank 0 preparing a corpus), past the collectives' timeout
        setup(device or torch.device("cpu"))
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=3))
    if group is not None and not w.is_main:
        dist.barrier(group)
    yield
    if group is not None and w.is_main:
        dist.barrier(group)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place, and returned); the identity in a single process."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class DDP(DistributedDataParallel):
    """DistributedDataParallel that forwards unknown attributes to the wrapped model, so objectives can still
    call `model.cfg` and `model.aux_loss()` (the MoE load-balancing loss) through the wrapper."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def wrap(model: nn.Module, device: torch.device, fsdp: bool = False) -> nn.Module:
    """The model the loop trains: DDP (gradients all-reduced, averaged) or FSDP2 (parameters sharded per
    block and at the root, gradients reduce-scattered, averaged). The model itself with one process."""
    if not world().distributed:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for block in _blocks(model):
            fully_shard(block)
        fully_shard(model)
        return model
    # Mixture-of-experts layers may leave an expert without tokens in a step: DDP must look for unused ones.
    moe = getattr(getattr(model, "cfg", None), "n_experts", 0)
    ids = [device.index] if device.type == "cuda" else None
    # Buffers are only the RoPE tables, identical on every rank: no broadcast before every forward. torch 2.13
    # names it forward_sync_buffers (broadcast_buffers=False is deprecated there); older releases know only that.
    renamed = "forward_sync_buffers" in inspect.signature(DDP).parameters
    no_sync = "forward_sync_buffers" if renamed else "broadcast_buffers"
    return DDP(model, device_ids=ids, find_unused_parameters=bool(moe), **{no_sync: False})


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, the unit FSDP2 gathers at a time (found as the model's `layers` ModuleList,
    through a LoRA wrapper too)."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, nn.ModuleList):
            return list(module)
    return []


def unwrap(model: nn.Module) -> nn.Module:
    """The model without DDP's wrapper (FSDP2 shards in place: the model is itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def gradient_sync(model: nn.Module, enabled: bool):
    """A context in which backward does (enabled) or does not (accumulation micro-batches) reduce
    gradients across ranks."""
    sync = enabled or not world().distributed
    if not sync and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if is_fsdp(model):
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def full_state_dict(model: nn.Module, keys) -> dict[str, torch.Tensor]:
    """FSDP2: gather the full (unsharded) weights onto rank 0's CPU (a collective: every rank calls it).
    Only `keys` are kept, e.g. those of `state_dict_for_save()`; other ranks get an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: full[k] for k in keys} if is_main() else {}


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """FSDP2: the optimizer state gathered on rank 0, in the plain `optimizer.state_dict()` layout (parameters
    numbered in group order), so DDP and single-process runs load it as they load their own."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main():
        return {}
    index = {fqn: i for i, fqn in enumerate(fqn for group in osd["param_groups"] for fqn in group["params"])}
    groups = [{**group, "params": [index[fqn] for fqn in group["params"]]} for group in osd["param_groups"]]
    return {"state": {index[fqn]: s for fqn, s in osd["state"].items()}, "param_groups": groups}


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """FSDP2: load a plain-layout optimizer state (from any world size) into the sharded optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    names = {id(p): n for n, p in model.named_parameters()}
    fqns = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    if len(fqns) != sum(len(g["params"]) for g in saved["param_groups"]):
        raise ValueError("the saved optimizer has a different number of parameters")
    groups = [{**g, "params": [fqns[i] for i in g["params"]]} for g in saved["param_groups"]]
    osd = {"state": {fqns[int(i)]: s for i, s in saved["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))


def load_full_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """FSDP2: load full weights (every rank holds them) into the sharded model, each rank keeping its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
