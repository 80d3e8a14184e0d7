"""The TOML recipes in configs/: each loads with no unknown key, matches the preset it is named after, and works
where its comment says it does (`nanoforge plan --config`, the speedrun script)."""
import subprocess
import sys
from pathlib import Path

import pytest

from nanoforge.config import build_config, load_toml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def test_there_are_recipes():
    assert {p.stem for p in CONFIGS} >= {"mini", "mini-sft", "base", "speedrun-shakespeare"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    build_config(None, path, {})  # an unknown key or a bad value raises, naming the file
    assert "vocab_size" not in load_toml(path).get("model", {}), "the embedding should follow the tokenizer"


@pytest.mark.parametrize("name", ["mini", "base"])
def test_model_shape_is_the_preset(name):
    from_file, _ = build_config(None, ROOT / "configs" / f"{name}.toml", {})
    from_preset, _ = build_config(name, None, {})
    assert from_file == from_preset


def test_mini_is_the_26m_reference():
    from nanoforge.model.gpt import GPT
    m, t = build_config(None, ROOT / "configs" / "mini.toml", {})
    assert sum(p.numel() for p in GPT(m).parameters()) == 25_829_888  # vocab 6400, as MiniMind's tokenizer
    assert (t.batch_size * t.grad_accum, t.seq_len, t.epochs) == (256, 512, 1.0)


def test_sft_recipe_leaves_the_model_to_init():
    assert "model" not in load_toml(ROOT / "configs" / "mini-sft.toml")


def test_plan_reads_a_recipe():
    proc = subprocess.run([sys.executable, "-m", "nanoforge", "plan", "--config", "configs/mini.toml",
                           "--device", "rtx3090"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "25.8M parameters (8 layers, d_model 512, 8 heads / 2 KV, vocab 6400)" in proc.stdout


def test_speedrun_script_trains_with_the_recipe():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import speedrun_shakespeare
    finally:
        sys.path.pop(0)
    flags = speedrun_shakespeare.CONFIG
    m, t = build_config(None, ROOT / "configs" / "speedrun-shakespeare.toml", {})
    assert flags["d-model"] == m.d_model == 128 and flags["optimizer"] == t.optimizer == "muon"
    assert len(flags) == sum(len(s) for s in load_toml(ROOT / "configs" / "speedrun-shakespeare.toml").values())
