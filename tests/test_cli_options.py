"""Every command's flags and defaults, against a recorded snapshot (tests/cli_options.json): moving code around must
not change what a user types or gets by default. A deliberate change of a flag updates the snapshot in the same
commit: NANOFORGE_UPDATE_CLI_SNAPSHOT=1 pytest tests/test_cli_options.py rewrites it; review its diff."""
import argparse
import json
import os
import re
from pathlib import Path

from nanoforge.cli import build_parser

SNAPSHOT = Path(__file__).with_name("cli_options.json")


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
