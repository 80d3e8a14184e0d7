"""An HF model directory (our own export) as --init for SFT, and as a model for chat via the CLI."""
import subprocess
import sys
from pathlib import Path

import torch

from nanoforge.data.prepare import prepare_dataset
from nanoforge.weights.load import load_model
from nanoforge.recipes.pretrain import pretrain
from nanoforge.recipes.sft import sft

FAST = {"tensorboard": False, "log_every": 1, "eval_every": 0, "precision": "fp32", "warmup_steps": 1}


def test_sft_from_an_hf_directory_and_export_cli(tmp_path, tiny_tokenizer):
    from conftest import tiny_corpus
    files = tiny_corpus(tmp_path)
    prepare_dataset("pretrain", files[:1], tiny_tokenizer, tmp_path / "pre", val_fraction=0.1, workers=1,
                    log=lambda *a: None)
    prepare_dataset("sft", files[1:], tiny_tokenizer, tmp_path / "sft", val_fraction=0.1, workers=1,
                    log=lambda *a: None)
    pretrain([str(tmp_path / "pre")], tmp_path / "base", preset="tiny", overrides={**FAST, "max_steps": 3},
             quiet=True)
    r = subprocess.run([sys.executable, "-m", "nanoforge", "export", str(tmp_path / "base"), "--format", "hf",
                        "--out", str(tmp_path / "hf")], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    # the HF directory loads as --init exactly like the run it came from
    a, _, _ = load_model(tmp_path / "base")
    b, _, _ = load_model(tmp_path / "hf")
    x = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x))
    s = sft(str(tmp_path / "hf"), [str(tmp_path / "sft")], tmp_path / "ft", overrides={**FAST, "max_steps": 2},
            quiet=True)
    assert s["step"] == 2 and (tmp_path / "ft" / "tokenizer" / "tokenizer.json").is_file()
