"""`pretrain --init`: continued pretraining from a trained model (its shape, tokenizer and weights; a fresh
optimizer and schedule), resumable like any run."""
import shutil

import pytest
import torch

from nanoforge.data.prepare import prepare_dataset
from nanoforge.core.errors import NanoforgeError
from nanoforge.weights import checkpoint as ckpt
from nanoforge.recipes.pretrain import pretrain

FAST = {"tensorboard": False, "log_every": 1, "eval_every": 0, "precision": "fp32", "warmup_steps": 1,
        "seq_len": 64, "batch_size": 2}


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_tokenizer):
    from conftest import tiny_corpus
    work = tmp_path_factory.mktemp("cpt")
    files = tiny_corpus(work)[:1]
    prepare_dataset("pretrain", files, tiny_tokenizer, work / "pre", val_fraction=0.1, workers=1, log=lambda *a: None)
    pretrain([str(work / "pre")], work / "base", preset="tiny", overrides={**FAST, "max_steps": 4}, quiet=True)
    return work


def weights(run):
    return ckpt.load_weights_file(ckpt.latest_checkpoint(run))


def test_init_starts_from_the_trained_weights_and_shape(base, tmp_path):
    # with a vanishing learning rate one step leaves the weights where --init had them
    s = pretrain([str(base / "pre")], tmp_path / "cpt", init=str(base / "base"), quiet=True,
                 overrides={**FAST, "max_steps": 1, "lr": 1e-12, "weight_decay": 0.0})
    assert s["step"] == 1
    a, b = weights(base / "base"), weights(tmp_path / "cpt")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    saved = (tmp_path / "cpt" / "config.toml").read_text()
    assert 'stage = "pretrain"' in saved and f'init = "{ckpt.latest_checkpoint(base / "base").resolve()}"' in saved


def test_continued_run_resumes_exactly(base, tmp_path):
    common = {**FAST, "max_steps": 6, "save_every": 3, "keep_last": 5}
    pretrain([str(base / "pre")], tmp_path / "straight", init=str(base / "base"), overrides=common, quiet=True)
    shutil.copytree(tmp_path / "straight", tmp_path / "again")
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "step_000006")
    pretrain([], tmp_path / "again", resume=True, quiet=True)  # --init and the data come from config.toml
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "again")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_init_refuses_a_preset_a_tokenizer_and_another_shape(base, tmp_path):
    with pytest.raises(NanoforgeError, match="--preset with --init"):
        pretrain([str(base / "pre")], tmp_path / "a", preset="tiny", init=str(base / "base"), quiet=True)
    with pytest.raises(NanoforgeError, match="--tokenizer with --init"):
        pretrain([str(base / "pre")], tmp_path / "b", tokenizer="tok", init=str(base / "base"), quiet=True)
    with pytest.raises(NanoforgeError, match="model shape comes from --init"):
        pretrain([str(base / "pre")], tmp_path / "c", init=str(base / "base"), overrides={"d_model": 32},
                 quiet=True)
    assert not any((tmp_path / n).exists() for n in "abc")
