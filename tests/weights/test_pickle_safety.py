"""Checkpoints are data, never code: a `trainer.pt` or `model.safetensors` that carries a pickle whose
__reduce__ would run something is refused with a NanoforgeError, and the payload never runs.

The payload here is harmless but observable: unpickling it calls `open(marker, "w")`, which creates a marker
file. Each test first proves the payload is live (an unsafe torch.load does create the marker), so a refusal
cannot pass merely because the file was broken in some other way."""
from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from nanoforge.core.errors import NanoforgeError
from nanoforge.weights.load import load_model
from nanoforge.weights import checkpoint as ckpt

from test_generate import make_tiny_run


class Payload:
    """Unpickles as `open(marker, "w")`: code run by the loader, creating a file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_malicious_trainer(path: Path, marker: Path) -> None:
    """A torch.save-format zip (data.pkl inside) whose pickle holds the payload among real-looking state."""
    torch.save({"optimizer": {"state": {}, "param_groups": []}, "rng": {"cpu": torch.get_rng_state()},
                "extra": Payload(marker)}, path)


def assert_payload_is_live(path: Path, marker: Path) -> None:
    """The premise: loading `path` the unsafe way runs the payload. Then the marker is removed again."""
    assert not marker.exists()
    with open(path, "rb") as f:
        data = f.read(4)
    if data[:2] == b"PK":  # torch.save's zip format; a file object, as torch.load treats a *.safetensors path apart
        with open(path, "rb") as f:
            torch.load(f, weights_only=False)  # deliberately unsafe, to show the payload works
    else:
        with open(path, "rb") as f:
            pickle.load(f)  # noqa: S301 - deliberately unsafe, to show the payload works
    assert marker.exists(), "the payload did not run even when loaded unsafely; the test proves nothing"
    marker.unlink()


@pytest.fixture()
def fake_ckpt(tmp_path) -> Path:
    d = tmp_path / "checkpoints" / "step_000001"
    d.mkdir(parents=True)
    return d


def test_a_pickle_payload_in_trainer_pt_is_refused(fake_ckpt, tmp_path):
    marker = tmp_path / "PWNED"
    write_malicious_trainer(fake_ckpt / "trainer.pt", marker)
    assert_payload_is_live(fake_ckpt / "trainer.pt", marker)
    with pytest.raises(NanoforgeError, match="trainer.pt"):
        ckpt.load_trainer_file(fake_ckpt)
    assert not marker.exists(), "loading trainer.pt ran code from its pickle"


def test_a_bare_pickle_named_trainer_pt_is_refused(fake_ckpt, tmp_path):
    """The legacy (non-zip) torch format: a plain pickle stream."""
    marker = tmp_path / "PWNED"
    (fake_ckpt / "trainer.pt").write_bytes(pickle.dumps({"extra": Payload(marker)}))
    assert_payload_is_live(fake_ckpt / "trainer.pt", marker)
    with pytest.raises(NanoforgeError):
        ckpt.load_trainer_file(fake_ckpt)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["zip", "pickle"])
def test_model_safetensors_that_is_a_pickle_is_refused(fake_ckpt, tmp_path, kind):
    marker = tmp_path / "PWNED"
    path = fake_ckpt / "model.safetensors"
    if kind == "zip":
        torch.save({"tok_emb.weight": torch.zeros(2, 2), "x": Payload(marker)}, path)
    else:
        path.write_bytes(pickle.dumps({"x": Payload(marker)}))
    assert_payload_is_live(path, marker)
    with pytest.raises(NanoforgeError, match="model.safetensors"):
        ckpt.load_weights_file(fake_ckpt)
    assert not marker.exists(), "reading model.safetensors ran code from a pickle"


@pytest.fixture()
def run_copy(tmp_path_factory, tiny_tokenizer, tmp_path) -> Path:
    """A private copy of the tiny trained run (the shared one must stay intact for other tests)."""
    src = make_tiny_run(tmp_path_factory, tiny_tokenizer)
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_loading_a_run_whose_weights_are_a_pickle_is_refused(run_copy, tmp_path):
    marker = tmp_path / "PWNED"
    latest = ckpt.latest_checkpoint(run_copy)
    path = latest / "model.safetensors"
    torch.save({"x": Payload(marker)}, path)
    assert_payload_is_live(path, marker)
    with pytest.raises(NanoforgeError):
        load_model(run_copy)
    assert not marker.exists()


@pytest.mark.slow
def test_resuming_from_a_malicious_trainer_pt_is_refused(run_copy, tmp_path):
    from nanoforge.recipes.pretrain import pretrain

    marker = tmp_path / "PWNED"
    latest = ckpt.latest_checkpoint(run_copy)
    write_malicious_trainer(latest / "trainer.pt", marker)
    assert_payload_is_live(latest / "trainer.pt", marker)
    with pytest.raises(NanoforgeError, match="trainer.pt"):
        pretrain([], run_copy, resume=True, quiet=True, overrides={"max_steps": 31})
    assert not marker.exists(), "resuming a run ran code from its trainer.pt"
    assert ckpt.latest_checkpoint(run_copy) == latest, "a refused resume must not write a checkpoint"
