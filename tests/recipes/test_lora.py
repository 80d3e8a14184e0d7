"""The lora stage end to end: adapter-only checkpoints tied to their base, merge, resume, wrong base."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import prepare_tiny
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.lora import LoraConfig
from nanoforge.weights.load import load_model
from nanoforge.weights import checkpoint as ckpt
from nanoforge.recipes.pretrain import pretrain
from nanoforge.recipes.sft import lora_merge, sft

ROOT = Path(__file__).resolve().parents[2]
FAST = {"tensorboard": False, "log_every": 1, "eval_every": 0, "precision": "fp32", "warmup_steps": 2}


@pytest.fixture(scope="module")
def base_and_data(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("lora")
    prepare_tiny(root / "pre", tiny_tokenizer)
    prepare_tiny(root / "sft", tiny_tokenizer, "sft")
    pretrain([str(root / "pre")], root / "base", preset="tiny", overrides={**FAST, "max_steps": 5, "seq_len": 128},
             quiet=True)
    return root


def test_lora_trains_adapters_only_and_merges(base_and_data, tmp_path):
    root = base_and_data
    base_ckpt = ckpt.latest_checkpoint(root / "base")
    base_before = ckpt.load_weights_file(base_ckpt)
    sft(str(root / "base"), [str(root / "sft")], tmp_path / "lora", overrides={**FAST, "max_steps": 6,
            "lr": 1e-2, "save_every": 3, "keep_last": 5}, lora=LoraConfig(rank=4, alpha=8, targets="q,k,v,o,gate,up,down"),
            quiet=True)
    adapters = ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / "lora"))
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    assert any(k.startswith("model.layers.0.mlp.down_proj.lora_B") for k in adapters)  # not only square layers
    for k, v in ckpt.load_weights_file(base_ckpt).items():  # the base run is untouched
        assert torch.equal(v, base_before[k])
    losses = [json.loads(l)["loss"] for l in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]
    # merged run == base + adapters, and loads like any other run
    merged = lora_merge(tmp_path / "lora", tmp_path / "merged")
    m1, _, _ = load_model(merged)
    m2, _, _ = load_model(tmp_path / "lora")
    x = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(m1(x), m2(x))
        base_model, _, _ = load_model(root / "base")
        assert not torch.allclose(base_model(x), m1(x))  # the adapters did something
    # resume from the middle: adapters equal the uninterrupted run's
    shutil.copytree(tmp_path / "lora", tmp_path / "again")
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "step_000006")
    sft(None, [], tmp_path / "again", resume=True, quiet=True)
    again = ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / "again"))
    for k in adapters:
        assert torch.equal(adapters[k], again[k]), k


def test_adapter_on_the_wrong_base_is_refused(base_and_data, tmp_path):
    root = base_and_data
    sft(str(root / "base"), [str(root / "sft")], tmp_path / "lora", overrides={**FAST, "max_steps": 1},
        lora=LoraConfig(rank=2, targets="q,v"), quiet=True)
    # retrain the base in place: same path, different weights
    shutil.rmtree(root / "base2", ignore_errors=True)
    pretrain([str(root / "pre")], root / "base2", preset="tiny",
             overrides={**FAST, "max_steps": 2, "seq_len": 128, "seed": 7}, quiet=True)
    base_file = ckpt.latest_checkpoint(root / "base") / "model.safetensors"
    listing = base_file.with_name("checksums.sha256")  # swapped with the weights, as a retrained base has its own
    saved, saved_listing = base_file.read_bytes(), listing.read_bytes()
    try:
        for name in (base_file.name, listing.name):
            shutil.copy(ckpt.latest_checkpoint(root / "base2") / name, base_file.with_name(name))
        with pytest.raises(NanoforgeError, match="adapter was trained on base"):
            load_model(tmp_path / "lora")
    finally:
        base_file.write_bytes(saved)
        listing.write_bytes(saved_listing)


@pytest.mark.slow
def test_two_runs_with_one_seed_draw_the_same_adapters(base_and_data, tmp_path):
    """Through the CLI, each run its own process: the adapters' random initial A matrices come from --seed, so
    two runs of one command line save the same adapters (not each process's own RNG's)."""
    root = base_and_data
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for out in ("one", "two"):
        proc = subprocess.run([sys.executable, "-m", "nanoforge", "lora", "--init", str(root / "base"), "--data",
                               str(root / "sft"), "--out", str(tmp_path / out), "--max-steps", "1", "--batch-size", "2", "--lr", "1e-2",
                               "--precision", "fp32", "--device", "cpu", "--tensorboard", "false",
                               "--eval-every", "0", "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    one, two = (ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / out)) for out in ("one", "two"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
