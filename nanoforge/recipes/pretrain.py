"""`nanoforge pretrain`: the recipe. It opens its run directory (train/rundir.py), builds its batches, model and
objective, and hands them to the one loop (train/loop.py)."""
from pathlib import Path
from typing import Any, Sequence

from nanoforge.core.errors import NanoforgeError
from nanoforge.recipes.common import initial_gpt, lm_batches, make_sampler, sample_prompts, train_and_report
from nanoforge.chat.tokenizer import load_tokenizer
from nanoforge.train.loop import Stage
from nanoforge.train.microbatch import fit_micro_batch
from nanoforge.train.objectives import causal_lm_loss
from nanoforge.weights.minimind import is_pth
from nanoforge.train.rundir import (PreparedRun, copy_tokenizer, finetune_setup, fit_vocab, fresh_run_guard, open_run,
                                    resolve_data, saved_data_dir, saved_run_info, write_run_config)


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
        run = finetune_setup("pretrain", init, data, out, config_file, dict(overrides or {}), resume, quiet, {})
        prompts = sample_prompts(run.tcfg)
    else:
        run_dir, mcfg, tcfg, saved_run, explicit = open_run(out, resume, preset, config_file, overrides or {})
        prompts = sample_prompts(tcfg)  # a bad prompts file stops the run before data is prepared
        data_dir = saved_data_dir(saved_run, run_dir) if resume and saved_run.get("data") and not data else \
            resolve_data("pretrain", data, run_dir, tokenizer, mcfg, tcfg, quiet)
        tok = load_tokenizer(data_dir / "tokenizer")
        fit_vocab(mcfg, tok, explicit)
        fit_micro_batch(mcfg, tcfg)  # --micro-batch auto|N: before any batch source is sized
        run_info = {"stage": "pretrain", "data": str(data_dir.resolve()), "tokenizer": "tokenizer"}
        copy_tokenizer(data_dir / "tokenizer", run_dir)
        write_run_config(run_dir, mcfg, tcfg, run_info)
        run = PreparedRun(run_dir, mcfg, tcfg, run_info, None, tok, data_dir)
    batches, val_batches, val_bpt = lm_batches(run.data, run.tcfg, run.tokenizer, quiet, need="pretrain")
    model = initial_gpt(run.mcfg, run.tcfg, run.init, resume)
    stage = Stage("pretrain", batches, causal_lm_loss, val_batches, val_bpt, run.info,
                  sampler=make_sampler(run.run_dir, run.tcfg, run.tokenizer, prompts, chat=False))
    return train_and_report(stage, model, run, resume, quiet)
