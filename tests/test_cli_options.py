"""Every command's flags and defaults, against a recorded snapshot (tests/cli_options.json): moving code around must
not change what a user types or gets by default. A deliberate change of a flag updates the snapshot in the same
commit: NANOFORGE_UPDATE_CLI_SNAPSHOT=1 pytest tests/test_cli_options.py rewrites it; review its diff."""
import argparse
import dataclasses
import json
import os
import re
from pathlib import Path

from nanoforge.cli import build_parser
from nanoforge.core.config import LoraConfig
from nanoforge.data.options import PrepareOptions
from nanoforge.eval.options import EvalOptions
from nanoforge.infer.options import CHAT_SAMPLING, ChatOptions, DeviceOptions
from nanoforge.recipes.options import DistillOptions, DPOOptions
from nanoforge.rl.options import PPOOptions, RLOptions
from nanoforge.serve.options import ServeOptions

SNAPSHOT = Path(__file__).with_name("cli_options.json")
OUT, PREPARE = ["--out", "RUN"], ["--kind", "sft", "--data", "F", "--tokenizer", "T", "--out", "D"]


def _commands(parser: argparse.ArgumentParser, prefix: str = ""):
    yield prefix or "nanoforge", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{prefix} {name}".strip())


def _option(action: argparse.Action) -> str:
    """One line per flag: its spellings, default, const, nargs, choices and the default its help states."""
    stated = re.findall(r"\(default: ([^)]*)\)", action.help or "")
    parts = {"default": action.default, "const": action.const, "nargs": action.nargs,
             "choices": sorted(map(str, action.choices)) if action.choices else None,
             "stated": stated[-1] if stated else None}
    return " ".join([*(action.option_strings or [action.dest]),
                     *(f"{k}={v!r}" for k, v in parts.items() if v is not None)])


def options() -> dict:
    return {name: [_option(a) for a in p._actions if not isinstance(a, (argparse._HelpAction,
                                                                           argparse._SubParsersAction))]
            for name, p in _commands(build_parser())}


def test_every_flag_and_default_is_the_recorded_one():
    now = options()
    if os.environ.get("NANOFORGE_UPDATE_CLI_SNAPSHOT") == "1":
        SNAPSHOT.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(SNAPSHOT.read_text())
    assert sorted(now) == sorted(recorded), "commands added or removed"
    for command in recorded:
        assert now[command] == recorded[command], f"`{command}`: its flags or defaults changed"


# The commands whose options are a dataclass (cli.add_option_flags), with a command line that gives none of them.
OPTIONS = {"eval": ([EvalOptions], ["RUN"]), "prepare": ([PrepareOptions], PREPARE), "grpo": ([RLOptions], OUT),
           "ppo": ([PPOOptions], OUT), "lora": ([LoraConfig], OUT), "dpo": ([DPOOptions], OUT),
           "distill": ([DistillOptions], OUT), "chat": ([CHAT_SAMPLING, ChatOptions, DeviceOptions], ["RUN"]),
           "generate": ([CHAT_SAMPLING, DeviceOptions], ["RUN"]), "serve": ([ServeOptions, DeviceOptions], ["RUN"])}


def test_each_flag_states_its_fields_default_and_an_omitted_flag_gets_it():
    """The default --help shows is the dataclass field's (none is written by hand), and parsing a command line
    without the flag gives the field's default (a resumable command leaves it out of the namespace: the
    dataclass fills it, and a --resume can tell it was not given)."""
    parsers = dict(_commands(build_parser()))
    for command, (classes, minimal) in OPTIONS.items():
        actions = {a.dest: a for a in parsers[command]._actions}
        formatter = parsers[command]._get_formatter()
        parsed = vars(build_parser().parse_args([command, *minimal]))
        for options, f in ((c, f) for c in classes for f in dataclasses.fields(c) if f.metadata.get("flag", True)):
            default = getattr(options, f.name)  # of an instance (CHAT_SAMPLING): its value
            shown = re.findall(r"\(default: ([^)]*)\)", formatter._expand_help(actions[f.name]))
            where = f"{command} --{f.name.replace('_', '-')}"
            if default is not None and (shown or default not in (False, 0)):  # argparse shows no 0 or False
                assert shown and shown[-1] == str(default), f"{where}: help says {shown}, the field {default!r}"
            assert parsed.get(f.name, default) == default, f"{where}: parsed {parsed.get(f.name)!r}"
            assert (f.name in parsed) == (actions[f.name].default != argparse.SUPPRESS), where


def test_every_field_says_what_it_is():
    """Help is data on the field (config.option(..., help=...)), never read from the source: a config or options
    field without it fails here, and its flag's --help shows exactly that text."""
    from nanoforge.core.config import ModelConfig, TrainConfig

    parsers = dict(_commands(build_parser()))
    pretrain = {a.dest: a for a in parsers["pretrain"]._actions}
    for cls in [ModelConfig, TrainConfig, *(c for classes, _ in OPTIONS.values() for c in classes)]:
        for f in dataclasses.fields(cls):
            text = f.metadata.get("help")
            assert isinstance(text, str) and len(text.split()) >= 2, f"{cls.__name__}.{f.name} has no help"
    for f in dataclasses.fields(TrainConfig):
        assert pretrain[f"cfg_{f.name}"].help.startswith(f.metadata["help"].replace("%", "%%")), f.name
