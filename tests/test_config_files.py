"""The TOML recipes in configs/: each loads with no unknown key, matches the preset it is named after, and works
where its comment says it does (`nanoforge plan --config`, the speedrun script)."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nanoforge.core.config import build_config, load_toml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def test_there_are_recipes():
    assert {p.stem for p in CONFIGS} >= {"mini", "mini-sft", "base", "speedrun-shakespeare"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    # an unknown key or a bad value raises, naming the file; the fine-tuning recipes on the model they are for
    build_config("minimind-3" if path.stem.startswith("minimind-3") else None, path, {})
    assert "vocab_size" not in load_toml(path).get("model", {}), "the embedding should follow the tokenizer"


@pytest.mark.parametrize("name", ["mini", "base", "minimind-3"])
def test_model_shape_is_the_preset(name):
    from_file, _ = build_config(None, ROOT / "configs" / f"{name}.toml", {})
    from_preset, _ = build_config(name, None, {})
    assert from_file == from_preset


def test_mini_is_the_26m_reference():
    from nanoforge.model.gpt import GPT
    m, t = build_config(None, ROOT / "configs" / "mini.toml", {})
    assert sum(p.numel() for p in GPT(m).parameters()) == 25_829_888  # vocab 6400, as MiniMind's tokenizer
    assert (t.batch_size * t.grad_accum, t.seq_len, t.epochs) == (256, 512, 1.0)


@pytest.mark.parametrize("name", ["mini-sft"] + [f"minimind-3-{stage}" for stage in ("sft", "lora", "dpo", "grpo", "ppo")])
def test_finetuning_recipes_leave_the_model_to_init(name):
    assert "model" not in load_toml(ROOT / "configs" / f"{name}.toml")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_commands_a_recipe_shows_parse(path):
    """Each `nanoforge ...` line of a recipe's comment (with its continuations) is a valid command line."""
    from nanoforge.cli import build_parser
    text = re.sub(r"\\\n#\s*", " ", path.read_text(encoding="utf-8"))
    commands = [line.split("nanoforge", 1)[1] for line in text.splitlines() if line.startswith("#   nanoforge")]
    for command in commands:
        args = build_parser().parse_args(shlex.split(command.replace("...", "--out R")))
        assert args.command in command


def test_plan_reads_a_recipe():
    proc = subprocess.run([sys.executable, "-m", "nanoforge", "plan", "--config", "configs/mini.toml",
                           "--device", "rtx3090"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "25.8M parameters (8 layers, d_model 512, 8 heads of 64 / 2 KV, SwiGLU 1408 (8/3 rule), vocab 6400)" in proc.stdout


def test_speedrun_script_trains_with_the_recipe():
    """benchmarks/speedrun_shakespeare.py's pretrain flags are configs/speedrun-shakespeare.toml's, every entry."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speedrun_shakespeare.py"), "--print-config"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    flags = json.loads(proc.stdout)
    m, t = build_config(None, ROOT / "configs" / "speedrun-shakespeare.toml", {})
    assert flags["d-model"] == m.d_model == 128 and flags["optimizer"] == t.optimizer == "muon"
    assert len(flags) == sum(len(s) for s in load_toml(ROOT / "configs" / "speedrun-shakespeare.toml").values())
