"""`nanoforge sft`, `nanoforge lora` and `nanoforge lora merge`: the recipes. Each opens its run directory
(train/rundir.py), builds its batches, model and objective, and hands them to the one loop (train/loop.py)."""
from pathlib import Path
from typing import Any, Sequence

from nanoforge.core.config import build_config, config_dicts
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.dirlock import staged_dir
from nanoforge.core.fsutil import check_out_apart, writing
from nanoforge.model.lora import LoraConfig, LoraModel
from nanoforge.recipes.common import SFT_DEFAULTS, initial_gpt, lm_batches, make_sampler, train_and_report
from nanoforge.train.loop import Stage
from nanoforge.train.objectives import causal_lm_loss
from nanoforge.train.rundir import (StageSetup, copy_tokenizer, fresh_run_guard, saved_run_info, setup_from_init,
                                    write_run_config)
from nanoforge.weights import checkpoint as ckpt
from nanoforge.weights.load import (adapter_metadata, check_base, init_tokenizer_dir, init_weights,
                                   load_adapter_checkpoint)

LORA_DEFAULTS = {**SFT_DEFAULTS, "lr": 1e-4}  # adapters start at zero and tolerate a larger step (MiniMind's too)


@fresh_run_guard
def sft(init: str | None, data: Sequence[str], out: str | Path, config_file: str | None = None,
        overrides: dict[str, Any] | None = None, resume: bool = False, quiet: bool = False,
        lora=None) -> dict[str, Any]:
    """`nanoforge sft` (and `nanoforge lora`, with a LoraConfig): next-token loss on assistant replies only,
    conversations packed without padding. With LoRA only the adapters train and checkpoints hold only them,
    with a reference (path, sha256, fingerprint) to the base they belong to."""
    if resume and saved_run_info(out).get("stage") == "lora":
        lora = LoraConfig.from_dict(saved_run_info(out))
    name = "lora" if lora else "sft"
    spec = StageSetup(name, LORA_DEFAULTS if lora else SFT_DEFAULTS, lora.to_dict() if lora else {})
    run = setup_from_init(spec, init, data, out, config_file, dict(overrides or {}), resume, quiet)
    batches, val_batches, _ = lm_batches(run.data, run.tcfg, run.tokenizer, quiet, need="sft")
    model = initial_gpt(run.mcfg, run.tcfg, None if lora else run.init, resume)
    if lora:
        base_weights = init_weights(run.init)  # every time: the checkpoints hold adapters only
        if resume:
            check_base(run.info, run.init)
        else:
            run.info.update(adapter_metadata(run.init, base_weights))
            write_run_config(run.run_dir, run.mcfg, run.tcfg, run.info)
        model.load_weights(base_weights)
        model = LoraModel(model, lora)
    stage = Stage(name, batches, causal_lm_loss, val_batches, None, run.info,
                  sampler=make_sampler(run.run_dir, run.tcfg, run.tokenizer, run.prompts, chat=True))
    return train_and_report(stage, model, run, resume, quiet)


def lora_merge(run: str | Path, out: str | Path) -> Path:
    """`nanoforge lora merge`: fold a LoRA run's adapters into its base and write a plain run directory
    (config, tokenizer, one checkpoint) that chat, export and further training read like any other."""
    out = Path(out)
    check_out_apart(out, [run])
    src = ckpt.resolve_checkpoint(run)
    state = ckpt.load_state(src)
    if out.exists() and any(out.iterdir()):
        raise NanoforgeError(f"{out} exists and is not empty; choose another --out")
    model = load_adapter_checkpoint(src)
    cfg = state.get("config", {})
    mcfg, tcfg = build_config(None, None, None, base={"model": cfg.get("model", {}), "train": cfg.get("train", {})})
    run_info = {"stage": "lora-merge", "merged_from": str(src.resolve()), "tokenizer": "tokenizer"}
    with writing(out), staged_dir(out) as tmp:  # renamed into place once whole
        copy_tokenizer(init_tokenizer_dir(src), tmp)
        write_run_config(tmp, mcfg, tcfg, run_info)
        ckpt.save_checkpoint(tmp, state["step"], model.state_dict_for_save(), {},
                             {"stage": "lora-merge", "config": config_dicts(mcfg, tcfg), "run": run_info,
                              "run_state": {"step": state["step"]}, "data": {}})
    return out
