"""--epochs E: a run's length from the data's size instead of a step count, for every stage, and how it
layers with --max-steps (presets, config files, the command line, a resumed run)."""
import json
import math
import shutil
from pathlib import Path

import pytest

from conftest import prepare_tiny
from nanoforge.core.config import ConfigError, build_config
from nanoforge.data.batches import PretrainBatches, SFTBatches
from nanoforge.data.shards import TokenShards
from nanoforge.weights import checkpoint as ckpt
from nanoforge.recipes.pretrain import pretrain
from nanoforge.recipes.sft import sft

FAST = {"tensorboard": False, "log_every": 1, "eval_every": 0, "precision": "fp32", "warmup_steps": 1,
        "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "seq_len": 64, "max_seq_len": 64}


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("epochs")
    prepare_tiny(root / "pre", tiny_tokenizer, val_fraction=0.0)
    prepare_tiny(root / "sft", tiny_tokenizer, "sft", val_fraction=0.0)
    return root


def steps_run(run_dir):
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return max(r["step"] for r in recs if "loss" in r)


def test_epochs_sets_the_step_count_from_the_data(data, tmp_path):
    windows = PretrainBatches(TokenShards(data / "pre", "train"), 2, 64, 0).num_windows
    expected = math.ceil(0.5 * windows / (2 * 2))  # half an epoch at batch 2 x accumulation 2
    s = pretrain([str(data / "pre")], tmp_path / "pre", preset="tiny", quiet=True,
                 overrides={**FAST, "epochs": 0.5, "batch_size": 2, "grad_accum": 2})
    assert s["step"] == expected == steps_run(tmp_path / "pre")
    saved = (tmp_path / "pre" / "config.toml").read_text()
    assert f"max_steps = {expected}\n" in saved and "epochs = 0.5\n" in saved
    # the data position after half an epoch: half the windows consumed, still in epoch 0
    state = ckpt.load_state(ckpt.latest_checkpoint(tmp_path / "pre"))
    assert state["data"]["epoch"] == 0 and state["data"]["cursor"] == expected * 4


@pytest.mark.slow
def test_sft_epochs_count_packed_rows_and_resume_extends_them(data, tmp_path):
    base = tmp_path / "base"
    pretrain([str(data / "pre")], base, preset="tiny", quiet=True, overrides={**FAST, "max_steps": 2})
    rows = SFTBatches(TokenShards(data / "sft", "train"), 2, 64).sequences_per_epoch
    out = tmp_path / "sft"
    s = sft(str(base), [str(data / "sft")], out, quiet=True,
            overrides={**FAST, "epochs": 1.0, "batch_size": 2, "save_every": 1, "keep_last": 100})
    one_epoch = math.ceil(rows / 2)
    assert s["step"] == one_epoch
    # --resume with --epochs 2 continues to two epochs; a plain --max-steps on resume wins over the saved epochs
    shutil.copytree(out, tmp_path / "two")
    assert sft(None, [], tmp_path / "two", resume=True, quiet=True,
               overrides={"epochs": 2.0})["step"] == math.ceil(2 * rows / 2)
    assert sft(None, [], out, resume=True, quiet=True, overrides={"max_steps": one_epoch + 1})["step"] == one_epoch + 1


def test_epochs_and_max_steps_layering(tmp_path):
    _, t = build_config("tiny", None, {"epochs": 2.0})
    assert t.epochs == 2.0  # the preset's max_steps is below the command line's epochs
    _, t = build_config(None, None, {"max_steps": 7}, base={"train": {"epochs": 3.0, "max_steps": 90}})
    assert (t.epochs, t.max_steps) == (0.0, 7)  # resume: --max-steps replaces the saved epochs
    _, t = build_config(None, None, {}, base={"train": {"epochs": 3.0, "max_steps": 90}})
    assert t.epochs == 3.0  # resume without a length flag keeps the saved epochs
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nepochs = 1.5\n")
    _, t = build_config("tiny", str(cfg), {})
    assert t.epochs == 1.5
    _, t = build_config("tiny", str(cfg), {"max_steps": 5})
    assert (t.epochs, t.max_steps) == (0.0, 5)
    with pytest.raises(ConfigError, match="--epochs or --max-steps"):
        build_config("tiny", None, {"epochs": 1.0, "max_steps": 5})
    with pytest.raises(ConfigError, match="epochs=-1.0 must be >= 0"):
        build_config("tiny", None, {"epochs": -1.0})


def test_a_warmup_longer_than_the_run_is_pointed_out(data, tmp_path, capsys):
    pretrain([str(data / "pre")], tmp_path / "a", preset="tiny", overrides={**FAST, "max_steps": 2, "warmup_steps": 5})
    assert "warmup_steps=5 covers the whole run of 2 steps" in capsys.readouterr().err
    pretrain([str(data / "pre")], tmp_path / "b", preset="tiny", overrides={**FAST, "max_steps": 2, "warmup_steps": 1})
    assert "covers the whole run" not in capsys.readouterr().err
