"""Every command that starts from trained weights (--init) takes the model's shape from them: a --config whose
[model] asks for another RoPE base or context length is refused by each, through the real command, with
nothing written; a [model] that repeats --init's shape is fine."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import save_random_run, write_sum_prompts
from nanoforge.core.config import load_toml
from nanoforge.recipes.grpo import RLOptions, grpo

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
RL = ["--num-generations", "2", "--prompts-per-step", "1", "--max-new-tokens", "4"]
COMMANDS = {  # command: its arguments besides --init, --config and --out ({w}: the world's directory)
    "pretrain": ["--data", "{w}/text.jsonl"],
    "sft": ["--data", "{w}/chat.jsonl"],
    "lora": ["--data", "{w}/chat.jsonl"],
    "dpo": ["--data", "{w}/pairs.jsonl"],
    "distill": ["--teacher", "{w}/init", "--data", "{w}/chat.jsonl"],
    "grpo": ["--data", "{w}/prompts.jsonl", *RL],
    "ppo": ["--data", "{w}/prompts.jsonl", *RL],
}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer) -> Path:
    """A random tiny --init (rope_theta 1e4, 128 positions), a little data of each kind, and two configs."""
    w = tmp_path_factory.mktemp("init_shape")
    save_random_run(w / "init", tiny_tokenizer, max_seq_len=128)
    (w / "text.jsonl").write_text("".join(json.dumps({"text": f"a short story number {i}."}) + "\n"
                                          for i in range(20)))
    (w / "chat.jsonl").write_text(json.dumps({"conversations": CHAT}) + "\n")
    pair = {"chosen": CHAT, "rejected": [CHAT[0], {"role": "assistant", "content": "no"}]}
    (w / "pairs.jsonl").write_text(json.dumps(pair) + "\n")
    (w / "prompts.jsonl").write_text(write_sum_prompts(w).read_text())
    (w / "other.toml").write_text("[model]\nrope_theta = 1e6\nmax_seq_len = 256\n\n[train]\nmax_steps = 1\n")
    (w / "same.toml").write_text("[model]\nrope_theta = 1e4\nmax_seq_len = 128\n\n[train]\nmax_steps = 1\n")
    return w


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_config_asking_for_another_shape_than_init_is_refused(world, command, tmp_path):
    args = [a.format(w=world) for a in COMMANDS[command]]
    r = subprocess.run([sys.executable, "-m", "nanoforge", command, "--init", str(world / "init"), "--config",
                        str(world / "other.toml"), "--out", str(tmp_path / "out"), *args, "--device", "cpu",
                        "--tensorboard", "false"], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.startswith(f"error: --init {world / 'init'} has another model shape"), r.stderr
    for asked in ("rope_theta 10000.0, requested 1000000.0", "max_seq_len 128, requested 256"):
        assert f"{asked} (by --config {world / 'other.toml'})" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a real grpo step: about 10 s on a quiet 2-core CPU
def test_a_config_repeating_the_init_shape_is_fine(world, tmp_path):
    options = RLOptions(num_generations=2, prompts_per_step=1, max_new_tokens=4, reward="math")
    grpo(str(world / "init"), str(world / "prompts.jsonl"), tmp_path / "run", options,
         config_file=str(world / "same.toml"), overrides={"device": "cpu", "tensorboard": False}, quiet=True)
    model = load_toml(tmp_path / "run" / "config.toml")["model"]
    assert (model["rope_theta"], model["max_seq_len"]) == (1e4, 128)
