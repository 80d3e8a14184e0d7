"""`nanoforge distill`: the recipe. It opens its run directory (train/rundir.py), loads the teacher, builds its
batches, student and objective, and hands them to the one loop (train/loop.py)."""
from pathlib import Path
from typing import Any, Sequence

from nanoforge.core.config import PRESETS
from nanoforge.core.device import resolve_device
from nanoforge.core.errors import NanoforgeError
from nanoforge.recipes.common import SFT_DEFAULTS, initial_gpt, lm_batches, make_sampler, train_and_report
from nanoforge.train.distributed import setup
from nanoforge.train.loop import Stage
from nanoforge.train.objectives import causal_lm_loss, make_distill_loss
from nanoforge.recipes.options import DistillOptions
from nanoforge.train.rundir import (StageSetup, check_same_origin, fresh_run_guard, resolve_run_options,
                                    saved_run_info, setup_from_init, setup_from_scratch)
from nanoforge.weights.load import init_tokenizer_dir, load_model

# config.toml's [run] init of a student that began as a fresh model of a preset (not the weights of an --init)
PRESET_ORIGIN = "preset:"


def student_preset(out: str | Path, init: str | None, resume: bool) -> str | None:
    """The preset a fresh student is built from (on --resume: was, and --init, if given, must name it again);
    None for a student that starts from the weights of --init."""
    if not resume:
        return init if init in PRESETS else None
    origin = str(saved_run_info(out).get("init", ""))
    if not origin.startswith(PRESET_ORIGIN):
        return None
    check_same_origin(Path(out), "--init", init, origin[len(PRESET_ORIGIN):])
    return origin[len(PRESET_ORIGIN):]


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

    preset = student_preset(out, init, resume)
    origin = {"init": PRESET_ORIGIN + preset} if preset else {}
    spec = StageSetup("distill", SFT_DEFAULTS, {**origin, **options}, probe_loss=probe_loss)
    if preset:  # a fresh student of a preset's shape, speaking the teacher's tokenizer
        run = setup_from_scratch(spec, None if resume else preset, str(init_tokenizer_dir(teacher_path)), data, out,
                                 config_file, overrides, resume, quiet)
    else:
        run = setup_from_init(spec, init, data, out, config_file, overrides, resume, quiet)
    mcfg, tcfg, tok = run.mcfg, run.tcfg, run.tokenizer
    if tok.sha256 != teacher_tok.sha256:
        raise NanoforgeError(f"the student's tokenizer ({tok.sha256[:12]}, {tok.vocab_size} tokens) is not the "
                             f"teacher's ({teacher_tok.sha256[:12]}, {teacher_tok.vocab_size} tokens): "
                             f"distillation compares distributions token by token, so they must be the same")
    if mcfg.vocab_size != teacher_model.cfg.vocab_size:
        raise NanoforgeError(f"student vocab_size {mcfg.vocab_size} differs from the teacher's "
                             f"{teacher_model.cfg.vocab_size}")
    batches, val_batches, val_bpt = lm_batches(run.data, tcfg, tok, quiet)
    model = initial_gpt(mcfg, tcfg, run.init, resume)
    # setup(): under torchrun cuda:LOCAL_RANK (plain "cuda" is cuda:0 on every rank until setup has run, e.g.
    # on `distill --resume` without --data, where nothing else called it yet)
    teacher_model.to(setup(resolve_device(tcfg.device)))
    # samples speak the way the data does: chat turns for conversation data, plain text for pretraining text
    stage = Stage("distill", batches, loss, val_batches, None, run.info,
                  sampler=make_sampler(run.run_dir, tcfg, tok, run.prompts, chat=batches.shards.kind == "sft"))
    return train_and_report(stage, model, run, resume, quiet)
