"""`nanoforge pretrain`: the recipe. It opens its run directory (train/rundir.py), builds its batches, model and
objective, and hands them to the one loop (train/loop.py)."""
from pathlib import Path
from typing import Any, Sequence

from nanoforge.core.errors import NanoforgeError
from nanoforge.recipes.common import initial_gpt, lm_batches, make_sampler, train_and_report
from nanoforge.train.loop import Stage
from nanoforge.train.objectives import causal_lm_loss
from nanoforge.weights.minimind import is_pth
from nanoforge.train.rundir import StageSetup, fresh_run_guard, saved_run_info, setup_from_init, setup_from_scratch


@fresh_run_guard
def pretrain(data: Sequence[str], out: str | Path, preset: str | None = None, config_file: str | None = None,
             overrides: dict[str, Any] | None = None, resume: bool = False, tokenizer: str | None = None,
             quiet: bool = False, init: str | None = None) -> dict[str, Any]:
    """`nanoforge pretrain`: packed next-token prediction on a token stream, from random weights, or with
    `init` from a trained model (continued pretraining: its shape and tokenizer, a fresh optimizer)."""
    saved = saved_run_info(out) if resume else {}
    if init or saved.get("init"):  # continued pretraining: the fine-tuning plumbing, TrainConfig's defaults
        if preset:
            raise NanoforgeError("--preset with --init: the model's shape comes from --init; drop --preset")
        if tokenizer and not is_pth(init):  # a MiniMind .pth has none: --tokenizer is its (weights/minimind.py)
            raise NanoforgeError("--tokenizer with --init: the tokenizer is --init's; drop --tokenizer")
        run = setup_from_init(StageSetup("pretrain"), init, data, out, config_file, dict(overrides or {}), resume,
                              quiet)
    else:
        run = setup_from_scratch(StageSetup("pretrain", kind="pretrain"), preset, tokenizer, data, out, config_file,
                                 dict(overrides or {}), resume, quiet)
    batches, val_batches, val_bpt = lm_batches(run.data, run.tcfg, run.tokenizer, quiet, need="pretrain")
    model = initial_gpt(run.mcfg, run.tcfg, run.init, resume)
    stage = Stage("pretrain", batches, causal_lm_loss, val_batches, val_bpt, run.info,
                  sampler=make_sampler(run.run_dir, run.tcfg, run.tokenizer, run.prompts, chat=False))
    return train_and_report(stage, model, run, resume, quiet)
