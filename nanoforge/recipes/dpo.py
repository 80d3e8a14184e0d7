"""`nanoforge dpo`: the recipe. It opens its run directory (train/rundir.py), computes the reference
log-probabilities once, builds its batches, model and objective, and hands them to the one loop (train/loop.py)."""
import functools
from pathlib import Path
from typing import Any, Sequence

from nanoforge.data.dpo import DPOBatches, count_pairs, reference_logps
from nanoforge.data.shards import TokenShards
from nanoforge.core.device import resolve_device
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.gpt import GPT
from nanoforge.recipes.common import SFT_DEFAULTS, initial_gpt, make_sampler, train_and_report
from nanoforge.train.distributed import main_first, setup, world
from nanoforge.train.loop import Stage
from nanoforge.train.objectives import dpo_loss
from nanoforge.recipes.options import DPOOptions
from nanoforge.train.rundir import StageSetup, fresh_run_guard, resolve_run_options, setup_from_init

# MiniMind's DPO default (lr 4e-8) leaves the loss at log 2 (its users' reports); measured on the tiny preset,
# held-out margin and accuracy move from lr 1e-4 up (see docs/perf.md). The SFT rate is a safe middle here.
DPO_DEFAULTS = {**SFT_DEFAULTS, "lr": 5e-5, "warmup_steps": 10, "max_steps": 300, "batch_size": 8}


@fresh_run_guard
def dpo(init: str | None, data: Sequence[str], out: str | Path, config_file: str | None = None,
        overrides: dict[str, Any] | None = None, resume: bool = False, options: DPOOptions | None = None,
        quiet: bool = False, given=None) -> dict[str, Any]:
    """`nanoforge dpo`: direct preference optimisation on chosen/rejected pairs. The reference model is the
    --init model; its log-probabilities are computed once, before training, and cached in the run."""
    beta = resolve_run_options(Path(out), options or DPOOptions(), resume, given)["beta"]
    spec = StageSetup("dpo", DPO_DEFAULTS, {"beta": beta}, rows_per_item=2)  # an item: chosen and rejected
    run = setup_from_init(spec, init, data, out, config_file, dict(overrides or {}), resume, quiet)
    mcfg, tcfg, tok, data_dir = run.mcfg, run.tcfg, run.tokenizer, run.data
    train_shards, val_shards = TokenShards(data_dir, "train"), TokenShards(data_dir, "val")
    if train_shards.kind != "dpo":
        raise NanoforgeError(f"{data_dir}: prepared as {train_shards.kind!r} data; dpo needs chosen/rejected "
                             f"pairs (`nanoforge prepare --kind dpo`)")
    # The reference is the initial policy, whatever step we resume at: rebuild it from --init.
    reference = initial_gpt(mcfg, tcfg, run.init, resume=False)
    device = setup(resolve_device(tcfg.device))  # under torchrun: this rank's GPU
    reference.to(device).eval()
    log = (lambda *a: None) if quiet else print
    with main_first(device):  # under torchrun rank 0 computes and caches; the others load the cache
        ref = {split: reference_logps(reference, shards, run.run_dir, tcfg.batch_size * 2, tcfg.seq_len,
                                      tcfg.precision, device, pad_id=tok.pad_id, log=log)
               for split, shards in (("train", train_shards), ("val", val_shards)) if shards.num_docs}
    model = reference if not resume else GPT(mcfg)  # the policy starts as the reference (train() moves it)
    if resume:
        del reference
    w = world()
    batches = DPOBatches(train_shards, ref["train"], tcfg.batch_size, tcfg.seq_len, tcfg.seed, w.rank, w.world_size,
                         pad_id=tok.pad_id)
    log(f"dpo train: {batches.summary()}")
    val_batches = None
    if "val" in ref:
        val = DPOBatches(val_shards, ref["val"], tcfg.batch_size, tcfg.seq_len, shuffle=False, pad_id=tok.pad_id)
        val_batches = lambda: val.eval_batches(tcfg.eval_batches)  # noqa: E731
    stage = Stage("dpo", batches, functools.partial(dpo_loss, beta=beta), val_batches, None, run.info,
                  count_fn=count_pairs, sampler=make_sampler(run.run_dir, tcfg, tok, run.prompts, chat=True))
    return train_and_report(stage, model, run, resume, quiet)
