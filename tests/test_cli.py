"""The `nanoforge` command as a user runs it: real processes, real files, exit codes and messages."""
import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from nanoforge.cli import build_parser
from nanoforge.commands import config_overrides
from nanoforge.core.config import MODEL_FIELDS, TRAIN_FIELDS, ConfigError, build_config

ROOT = Path(__file__).resolve().parents[1]


def flat(text):
    return " ".join(text.split())  # help text wraps at the terminal width


def nf(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "nanoforge", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT)


def test_help_lists_commands_and_defaults():
    top = nf("--help")
    assert top.returncode == 0
    for command in ("tokenizer", "prepare", "pretrain"):
        assert command in top.stdout
    pre = flat(nf("pretrain", "--help").stdout)
    assert "--max-steps N optimizer steps to train (see also epochs) (default: 1000)" in pre and "--resume" in pre
    # every config field explains itself (its help on the field: tests/test_cli_options.py)
    assert "--epochs X > 0: train this many passes over the data" in pre
    assert "--micro-batch STR \"\" trains batch_size x grad_accum as given;" in pre
    assert "(default: 0.01)" in flat(nf("prepare", "--help").stdout)
    assert "(default: 6400)" in flat(nf("tokenizer", "train", "--help").stdout)


def test_pipeline_tokenizer_prepare_pretrain_resume(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    words = "the cat sat on the mat while a dog ran in the park and birds sang".split()
    with open(corpus, "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(40))}) + "\n")
    r = nf("tokenizer", "train", "--data", corpus, "--vocab-size", 300, "--out", tmp_path / "tok")
    assert r.returncode == 0, r.stderr
    r = nf("prepare", "--kind", "pretrain", "--data", corpus, "--tokenizer", tmp_path / "tok",
           "--out", tmp_path / "pre", "--val-fraction", 0.1)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    common = ["--preset", "tiny", "--seq-len", 32, "--log-every", 2, "--eval-every", 4, "--save-every", 4,
              "--tensorboard", "false"]
    r = nf("pretrain", "--data", tmp_path / "pre", "--out", run, "--max-steps", 4, *common)
    assert r.returncode == 0, r.stderr
    assert "val loss" in r.stderr and "tok/s" in r.stderr
    r = nf("pretrain", "--data", tmp_path / "pre", "--out", run, "--max-steps", 4, *common)
    assert r.returncode == 1 and "already holds a run; add --resume" in r.stderr
    r = nf("pretrain", "--out", run, "--resume", "--max-steps", 6)
    assert r.returncode == 0, r.stderr
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6


def test_pretrain_on_raw_jsonl_prepares_into_the_run(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} of some text to learn from"}) + "\n"
                              for i in range(200)))
    run = tmp_path / "run"
    r = nf("pretrain", "--data", corpus, "--out", run, "--preset", "tiny", "--vocab-size", 300, "--max-steps", 2,
           "--seq-len", 16, "--tensorboard", "false", "--val-fraction", 0.1)
    assert r.returncode == 0, r.stderr
    assert (run / "data" / "manifest.json").is_file() and (run / "tokenizer" / "tokenizer.json").is_file()


@pytest.mark.parametrize("args,message", [
    (["pretrain", "--out", "{tmp}/r", "--resume"], "not a run directory"),
    (["pretrain", "--out", "{tmp}/r", "--data", "{tmp}/missing.jsonl"], "missing.jsonl"),
    (["pretrain", "--out", "{tmp}/r", "--data", "{tmp}/bad.jsonl", "--preset", "tiny", "--n-kv-heads", "3"],
     "n_heads=4 is not divisible by n_kv_heads=3"),
    (["pretrain", "--out", "{tmp}/r", "--max-steps", "ten"], "--max-steps: 'ten' is not a valid int"),
    (["prepare", "--kind", "pretrain", "--data", "{tmp}/bad.jsonl", "--tokenizer", "{tmp}/none", "--out", "{tmp}/p"],
     "none"),
])
def test_bad_input_gives_clear_error_and_nonzero_exit(tmp_path, args, message):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n')
    r = nf(*[a.format(tmp=tmp_path) for a in args])
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_prepare_bad_jsonl_names_file_line_and_field(tmp_path, tiny_tokenizer_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"txt": "typo"}\n')
    r = nf("prepare", "--kind", "pretrain", "--data", bad, "--tokenizer", tiny_tokenizer_dir, "--out", tmp_path / "p")
    assert r.returncode == 1
    assert f"{bad}:3:" in r.stderr and "text" in r.stderr
    assert not (tmp_path / "p").exists() and not list(tmp_path.glob(".p*"))
    r = nf("prepare", "--kind", "pretrain", "--data", bad, "--tokenizer", tiny_tokenizer_dir, "--out", tmp_path / "p",
           "--skip-invalid", "--val-fraction", 0)
    assert r.returncode == 0, r.stderr
    assert "1" in r.stderr + r.stdout and "skip" in (r.stderr + r.stdout).lower()


def _commands(parser, path=()):
    """(command words, parser) of every command and subcommand of the real parser."""
    if path:
        yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _out_of_range(kind, interval):
    """Values just outside `interval` ("[0, 1)" style): an open end itself, one step past a closed one."""
    low, high = (float(end) for end in interval[1:-1].split(","))
    step = 1 if kind == "int" else 0.5
    for end, closed, past in ((low, interval[0] == "[", low - step), (high, interval[-1] == "]", high + step)):
        if math.isfinite(end):
            yield f"{past if closed else end:g}"


def test_every_numeric_flag_of_every_command_refuses_non_finite_and_out_of_range_values(capsys):
    """Walks the real parser: a flag added later with a bare type=int/float, or a numeric metavar without a
    check, fails here. Flags refuse at parsing (exit 2, nothing run); config fields in build_config (exit 1)."""
    parser, checked, fields = build_parser(), 0, {**MODEL_FIELDS, **TRAIN_FIELDS}
    for path, sub in _commands(parser):
        for action in sub._actions:
            flag = "/".join(action.option_strings)
            if action.dest.startswith("cfg_"):  # a config field: the config's own validation (TOML values too)
                f = fields[action.dest[4:]]
                if f.type in ("int", "float", int, float):
                    for bad in ("nan", "inf", "-inf"):
                        with pytest.raises(ConfigError, match=action.dest[4:].replace("_", "[_-]")):
                            build_config("tiny", None, config_overrides(argparse.Namespace(**{action.dest: bad})))
                    checked += 1
                continue
            assert action.type not in (int, float), f"{' '.join(path)} {flag}: declare it with cli.number"
            interval = getattr(action.type, "interval", None)
            if interval is None:
                assert action.metavar not in ("N", "X", "G", "P", "K"), f"{' '.join(path)} {flag}: cli.number"
                continue
            for bad in ("nan", "inf", "-inf", "ten", *_out_of_range(action.type.__name__, interval)):
                with pytest.raises(SystemExit) as caught:
                    parser.parse_args([*path, f"{action.option_strings[0]}={bad}"])
                err = capsys.readouterr().err
                assert caught.value.code == 2 and f"argument {flag}: " in err, (path, flag, bad, err)
                assert any(w in err for w in ("is not a finite number", "must be", "invalid")), err
            checked += 1
    assert checked > 100  # every command's numeric flags, config fields included


@pytest.mark.parametrize("args, message", [
    (["grpo", "--beta", "nan"], "argument --beta: nan is not a finite number"),
    (["grpo", "--beta", "inf"], "argument --beta: inf is not a finite number"),
    (["grpo", "--temperature", "inf"], "argument --temperature: inf is not a finite number"),
    (["ppo", "--gamma", "1.5"], "argument --gamma: 1.5 must be in [0, 1]"),
    (["dpo", "--beta", "0"], "argument --beta: 0 must be > 0"),
    (["serve", "run", "--port", "0"], "argument --port: 0 must be in [1, 65535]"),
    (["prepare", "--workers", "-1"], "argument --workers: -1 must be >= 0"),
])
def test_a_bad_number_is_refused_before_anything_is_written(tmp_path, args, message):
    r = nf(*args, "--out", tmp_path / "out")
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
