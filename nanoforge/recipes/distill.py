"""`nanoforge distill`: the recipe. It opens its run directory (train/rundir.py), loads the teacher, builds its
batches, student and objective, and hands them to the one loop (train/loop.py)."""
from pathlib import Path
from typing import Any, Sequence

from nanoforge.core.config import PRESETS
from nanoforge.data.shards import check_tokenizer
from nanoforge.data.sources import data_kind
from nanoforge.core.device import resolve_device
from nanoforge.core.errors import NanoforgeError
from nanoforge.recipes.common import (SFT_DEFAULTS, initial_gpt, lm_batches, make_sampler, sample_prompts,
                                     train_and_report)
from nanoforge.train.distributed import setup
from nanoforge.train.loop import Stage
from nanoforge.train.microbatch import fit_micro_batch
from nanoforge.train.objectives import causal_lm_loss, make_distill_loss
from nanoforge.recipes.options import DistillOptions
from nanoforge.train.rundir import (PreparedRun, check_same_origin, copy_tokenizer, finetune_setup, fit_vocab,
                                    fresh_run_guard, open_run, resolve_data, resolve_run_options, saved_run_info,
                                    write_run_config)
from nanoforge.weights.load import init_tokenizer_dir, load_model



@fresh_run_guard
def distill(teacher: str | None, init: str | None, data: Sequence[str], out: str | Path,
            config_file: str | None = None, overrides: dict[str, Any] | None = None, resume: bool = False,
            options: DistillOptions | None = None, quiet: bool = False, given=None) -> dict[str, Any]:
    """`nanoforge distill`: train a student (a run, or a fresh model of a preset) to match a teacher's
    softened distributions on the data's supervised positions, mixed with the data's own cross-entropy."""
    overrides = dict(overrides or {})
    if resume:
        saved = saved_run_info(out)
        check_same_origin(Path(out), "--teacher", teacher, saved.get("teacher"))
        teacher = saved.get("teacher", teacher)
    o = resolve_run_options(Path(out), options or DistillOptions(), resume, given)
    temperature, alpha = o["temperature"], o["alpha"]
    if not teacher:
        raise NanoforgeError("--teacher is required: the run or checkpoint to distill from")
    teacher_model, teacher_tok, teacher_path = load_model(teacher)
    teacher_model.eval().requires_grad_(False)
    options = {"teacher": str(teacher_path.resolve()), "temperature": temperature, "alpha": alpha}
    loss = make_distill_loss(teacher_model, temperature, alpha)

    def probe_loss(model, batch):
        """--micro-batch auto probes with the real objective: the teacher's weights and logits take room too.
        (A student of another vocabulary is refused below, with the reason; the probe just skips the teacher.)"""
        if model.cfg.vocab_size != teacher_model.cfg.vocab_size:
            return causal_lm_loss(model, batch)
        teacher_model.to(batch["input_ids"].device)
        return loss(model, batch)

    if not resume and init in PRESETS:
        # a fresh student of a preset's shape, speaking the teacher's tokenizer
        run_dir, mcfg, tcfg, _, explicit = open_run(out, False, init, config_file, overrides)
        fit_vocab(mcfg, teacher_tok, explicit)
        fit_micro_batch(mcfg, tcfg, loss_fn=probe_loss)  # --micro-batch auto|N: before any batch source is sized
        data_dir = resolve_data(data_kind(data), data, run_dir, str(init_tokenizer_dir(teacher_path)),
                                mcfg, tcfg, quiet)
        check_tokenizer(data_dir, teacher_tok)
        run_info = {"stage": "distill", "init": f"preset:{init}", "tokenizer": "tokenizer",
                    "data": str(data_dir.resolve()), **options}
        copy_tokenizer(init_tokenizer_dir(teacher_path), run_dir)
        write_run_config(run_dir, mcfg, tcfg, run_info)
        run = PreparedRun(run_dir, mcfg, tcfg, run_info, None, teacher_tok, data_dir)
    else:
        run = finetune_setup("distill", init, data, out, config_file, overrides, resume, quiet, SFT_DEFAULTS, options,
                             probe_loss)
        if str(run.info["init"]).startswith("preset:"):  # resuming a student that began as a preset
            run.init = None
    mcfg, tcfg, tok = run.mcfg, run.tcfg, run.tokenizer
    if tok.sha256 != teacher_tok.sha256:
        raise NanoforgeError(f"the student's tokenizer ({tok.sha256[:12]}, {tok.vocab_size} tokens) is not the "
                             f"teacher's ({teacher_tok.sha256[:12]}, {teacher_tok.vocab_size} tokens): "
                             f"distillation compares distributions token by token, so they must be the same")
    if mcfg.vocab_size != teacher_model.cfg.vocab_size:
        raise NanoforgeError(f"student vocab_size {mcfg.vocab_size} differs from the teacher's "
                             f"{teacher_model.cfg.vocab_size}")
    prompts = sample_prompts(tcfg)
    batches, val_batches, val_bpt = lm_batches(run.data, tcfg, tok, quiet)
    model = initial_gpt(mcfg, tcfg, run.init, resume)
    # setup(): under torchrun cuda:LOCAL_RANK (plain "cuda" is cuda:0 on every rank until setup has run, e.g.
    # on `distill --resume` without --data, where nothing else called it yet)
    teacher_model.to(setup(resolve_device(tcfg.device)))
    # samples speak the way the data does: chat turns for conversation data, plain text for pretraining text
    stage = Stage("distill", batches, loss, val_batches, None, run.info,
                  sampler=make_sampler(run.run_dir, tcfg, tok, prompts, chat=batches.shards.kind == "sft"))
    return train_and_report(stage, model, run, resume, quiet)
