"""What each `nanoforge` command does once cli.py has parsed its arguments: one small function per command,
importing the module that does the work when it runs (a command loads its own recipe, never all of them). cli.py
imports this module only after parsing, so that `--help` and usage errors need neither torch nor these modules.
Nothing at the top of this module loads torch either: `nanoforge report` only reads files, and never loads it."""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any

from nanoforge.core.config import MODEL_FIELDS, TRAIN_FIELDS, LoraConfig, build_config, parse_value
from nanoforge.data.columnar import dataset_split
from nanoforge.data.options import PrepareOptions
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import check_out_apart, writing
from nanoforge.eval.options import EvalOptions
from nanoforge.infer.options import CHAT_SAMPLING, ChatOptions, DeviceOptions
from nanoforge.recipes.options import DistillOptions, DPOOptions
from nanoforge.rl.options import PPOOptions, RLOptions
from nanoforge.serve.options import ServeOptions
from nanoforge.train.world import is_main


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; its exit status (errors are one line on stderr, not a traceback)."""
    if not is_main():  # under torchrun only rank 0 talks to the user
        sys.stdout = open(os.devnull, "w")
    try:
        resolve_auto_resume(args)
        pair_pth_tokenizer(args)
        choose_split(args)
        COMMANDS[args.command](args)
        code = 0
    except NanoforgeError as e:
        signum = getattr(e, "signum", None)  # train/loop.py's TrainingInterrupted: a checkpoint was written
        print(f"error: {e}" if signum is None else str(e), file=sys.stderr)
        code = 1 if signum is None else 128 + signum
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM where a command takes it so (core/interrupt.py)
        print("interrupted", file=sys.stderr)
        code = 128 + getattr(e, "signum", signal.SIGINT)
    # under torchrun: leave the process group and exit here; a command that never loaded train/distributed.py
    # (report) has no group to leave
    distributed = sys.modules.get("nanoforge.train.distributed")
    return distributed.leave(code) if distributed else code


def resolve_auto_resume(args: argparse.Namespace) -> None:
    """--resume auto (every training command's, grpo's too): resume or a fresh start, from the run's files."""
    if not getattr(args, "resume", None):
        return
    from nanoforge.train.autoresume import AUTO, resolve_resume
    if args.resume == AUTO:
        args.resume = resolve_resume(AUTO, args.out, args.command)


def pair_pth_tokenizer(args: argparse.Namespace) -> None:
    """A MiniMind .pth model takes its tokenizer from --tokenizer; anywhere else (but raw JSONL's) it is refused."""
    if not any(getattr(args, name, None) for name in ("init", "run", "teacher", "tokenizer")):
        return  # no model named (report, ...): nothing to pair, and no torch to load
    from nanoforge.weights.minimind import is_pth, pair_tokenizer
    models = [getattr(args, name) for name in ("init", "run", "teacher") if is_pth(getattr(args, name, None))]
    for pth in models:
        pair_tokenizer(pth, getattr(args, "tokenizer", None))
    if getattr(args, "tokenizer", None) and not models and args.command not in ("pretrain", "prepare", "tokenizer"):
        raise NanoforgeError("--tokenizer is for a model given as a MiniMind .pth; a run or HF directory brings "
                             "its own")


def choose_split(args: argparse.Namespace) -> None:
    """--split (cli.add_split_flag): a datasets DatasetDict directory in --data stands for its split's directory."""
    if getattr(args, "dataset_split", None) is not None and args.data:
        args.data = [str(dataset_split(path, args.dataset_split)) for path in args.data]


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields given on the command line (cli.add_config_flags's --field-name flags)."""
    given = {name: (f, getattr(args, f"cfg_{name}", None)) for name, f in {**MODEL_FIELDS, **TRAIN_FIELDS}.items()}
    return {name: parse_value(name, f, text) for name, (f, text) in given.items() if text is not None}


def cmd_demo(args) -> None:
    from nanoforge.demo.pipeline import run_demo
    run_demo(args.out, minutes=args.minutes)


def cmd_report(args) -> None:
    from nanoforge.report.markdown import write_report
    print(f"report written to {write_report(args.runs, args.out)}")


def cmd_tokenizer(args) -> None:
    from nanoforge.data.sources import train_tokenizer
    tok = train_tokenizer(args.data, vocab_size=args.vocab_size, out_dir=args.out, min_frequency=args.min_frequency,
                          force=args.force)
    print(f"tokenizer with {tok.vocab_size} tokens written to {args.out}")


def cmd_prepare(args) -> None:
    from nanoforge.data.parts import merge_prepared
    from nanoforge.data.prepare import prepare_dataset
    if args.action == "merge":
        merge_prepared(args.parts, args.out, force=args.force, allow_incomplete=args.allow_incomplete)
    else:
        options = dataclasses.asdict(options_from(args, PrepareOptions)[0])
        prepare_dataset(args.kind, args.data, args.tokenizer, args.out, **options)


def cmd_pretrain(args) -> None:
    from nanoforge.recipes.pretrain import pretrain
    preset = args.preset or (None if (args.config or args.resume or args.init) else "mini")
    summary = pretrain(args.data, args.out, preset=preset, config_file=args.config, overrides=config_overrides(args),
                       resume=args.resume, tokenizer=args.tokenizer, quiet=args.quiet, init=args.init)
    print(f"pretrain finished at step {summary['step']}: checkpoint {summary['checkpoint']}")


def cmd_sft(args) -> None:
    from nanoforge.recipes.sft import sft
    summary = sft(args.init, args.data, args.out, config_file=args.config, overrides=config_overrides(args),
                  resume=args.resume, quiet=args.quiet)
    print(f"sft finished at step {summary['step']}: checkpoint {summary['checkpoint']}")


def options_from(args: argparse.Namespace, cls) -> tuple[Any, set[str]]:
    """A command's options dataclass from its flags (cli.add_option_flags; given an instance, that instance with
    them), and the names of those given: a resumable command's omitted flags are absent from the namespace, and
    the dataclass defaults fill them."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return (dataclasses.replace(cls, **given) if not isinstance(cls, type) else cls(**given)), set(given)


def cmd_lora(args) -> None:
    from nanoforge.recipes.sft import lora_merge, sft
    from nanoforge.train.rundir import check_resume_options
    if args.action == "merge":
        print(f"merged model written to {lora_merge(args.run, args.out)}")
        return
    lcfg, given = options_from(args, LoraConfig)
    if args.resume:
        check_resume_options(Path(args.out), {key: (f"--{key[5:]}", value) for key, value in lcfg.to_dict().items()
                                              if key[5:] in given})
    summary = sft(args.init, args.data, args.out, config_file=args.config, overrides=config_overrides(args),
                  resume=args.resume, quiet=args.quiet, lora=lcfg)
    print(f"lora finished at step {summary['step']}: adapters in {summary['checkpoint']}")


def cmd_dpo(args) -> None:
    from nanoforge.recipes.dpo import dpo
    options, given = options_from(args, DPOOptions)
    summary = dpo(args.init, args.data, args.out, config_file=args.config, overrides=config_overrides(args),
                  resume=args.resume, options=options, quiet=args.quiet, given=given)
    print(f"dpo finished at step {summary['step']}: checkpoint {summary['checkpoint']}")


def cmd_rl(args) -> None:
    """grpo and ppo: the stage's options dataclass filled from the flags of the same names."""
    from nanoforge.recipes.grpo import grpo
    from nanoforge.recipes.ppo import ppo
    options_cls, train_rl = {"grpo": (RLOptions, grpo), "ppo": (PPOOptions, ppo)}[args.command]
    options, given = options_from(args, options_cls)
    summary = train_rl(args.init, args.data, args.out, options, config_file=args.config,
                       overrides=config_overrides(args), resume=args.resume, quiet=args.quiet, given=given)
    print(f"{args.command} finished at step {summary['step']}: checkpoint {summary['checkpoint']}")


def cmd_distill(args) -> None:
    from nanoforge.recipes.distill import distill
    options, given = options_from(args, DistillOptions)
    summary = distill(args.teacher, args.init, args.data, args.out, config_file=args.config,
                      overrides=config_overrides(args), resume=args.resume, options=options, quiet=args.quiet,
                      given=given)
    print(f"distill finished at step {summary['step']}: checkpoint {summary['checkpoint']}")


def cmd_plan(args) -> None:
    from nanoforge.train.plan import format_plan, make_plan
    preset = args.preset or (None if args.config else "mini")
    mcfg, tcfg = build_config(preset, args.config, config_overrides(args))
    p = make_plan(mcfg, tcfg, args.device, args.global_batch, args.tokens, args.mfu, args.tokens_per_s)
    print(format_plan(p, mcfg, tcfg, args.tokens))


def cmd_bench(args) -> None:
    from nanoforge.recipes.bench import format_bench, run_bench, write_json
    if args.json:  # before the measuring: a --json onto a file it reads is refused at once
        check_out_apart(args.json, [args.data, args.config], "--json")
    preset = args.preset or (None if args.config else "mini")
    res = run_bench(preset, args.config, config_overrides(args), steps=args.steps, warmup=args.warmup,
                    data=args.data, compare_naive=args.compare_naive,
                    log=(lambda *a: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True)))
    print(format_bench(res))
    if args.json:
        with writing(args.json):
            write_json(res, args.json)


def cmd_eval(args) -> None:
    from nanoforge.eval.run import run_eval
    run_eval(args.run, options_from(args, EvalOptions)[0])


def cmd_export(args) -> None:
    from nanoforge.weights.export import export_gguf, export_hf, export_minimind
    if args.format == "hf":
        out = export_hf(args.run, args.out, force=args.force)
    elif args.format == "gguf":
        out = export_gguf(args.run, args.out, dtype=args.dtype or "f32", force=args.force)
    else:
        out = export_minimind(args.run, args.out, dtype=args.dtype or "f16", force=args.force)
    print(f"wrote {out}")


def cmd_serve(args) -> None:
    from nanoforge.serve.app import run_server  # it needs fastapi and uvicorn, the optional `serve` extra
    options, _ = options_from(args, ServeOptions)
    options.api_key = options.api_key or os.environ.get("NANOFORGE_API_KEY") or None
    run_server(args.run, options, device=args.device, precision=args.precision)


def cmd_generate(args) -> None:
    from nanoforge.infer.chat import run_generate
    run_generate(args.run, prompt=args.prompt, num_samples=args.num_samples, **inference_options(args))


def cmd_chat(args) -> None:
    from nanoforge.infer.chat import run_chat
    run_chat(args.run, **vars(options_from(args, ChatOptions)[0]), **inference_options(args))


def inference_options(args) -> dict[str, Any]:
    """chat's and generate's sampling and device flags, as the keywords of infer/chat.py's run_chat/run_generate."""
    return {**vars(options_from(args, CHAT_SAMPLING)[0]), **vars(options_from(args, DeviceOptions)[0])}


COMMANDS = {"demo": cmd_demo, "report": cmd_report, "tokenizer": cmd_tokenizer, "prepare": cmd_prepare,
            "pretrain": cmd_pretrain, "sft": cmd_sft, "lora": cmd_lora, "dpo": cmd_dpo, "grpo": cmd_rl,
            "ppo": cmd_rl, "distill": cmd_distill, "plan": cmd_plan, "bench": cmd_bench, "eval": cmd_eval,
            "export": cmd_export, "serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat}
