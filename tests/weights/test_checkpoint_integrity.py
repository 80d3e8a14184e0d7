"""Damaged checkpoints are refused where they are read, by every command: a byte flipped since the save (its
checksum, written with every checkpoint and export), and a NaN weight (refused at load, naming the tensor).
Real commands: exit 1, one line, no traceback, and the damaged run left byte-identical; `--resume` names the
previous intact checkpoint, and resumes from it once the damaged one is moved aside."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoforge.core.checksums import LISTING, sha256_of, write_dir_checksums
from nanoforge.data.prepare import prepare_dataset
from nanoforge.recipes.pretrain import pretrain
from nanoforge.weights import checkpoint as ckpt
from nanoforge.weights.export import export_hf

ROOT = Path(__file__).resolve().parents[2]
TINY = {"tensorboard": False, "log_every": 1, "eval_every": 0, "precision": "fp32", "device": "cpu",
        "seq_len": 32, "max_steps": 4, "save_every": 2}
TENSOR = "model.layers.0.mlp.up_proj.weight"


def nf(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoforge", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def snapshot(path: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def one_clear_line(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny pretraining run with checkpoints at steps 2 and 4, its prepared data, and SFT data."""
    from conftest import tiny_corpus
    work = tmp_path_factory.mktemp("integrity")
    quiet = lambda *a: None  # noqa: E731
    corpus = tiny_corpus(work)
    for kind, source in (("pretrain", corpus[0]), ("sft", corpus[1])):
        prepare_dataset(kind, [source], tiny_tokenizer_dir, work / kind, val_fraction=0.1, workers=1, log=quiet)
    pretrain([str(work / "pretrain")], work / "run", preset="tiny", overrides=TINY, quiet=True)
    return work


def damaged_copy(world: Path, dst: Path, how: str) -> Path:
    """A copy of the run whose latest model.safetensors has a flipped byte, or a NaN saved as a diverged run
    would save it (checksums rewritten to match: only the finite check can catch it)."""
    shutil.copytree(world / "run", dst)
    weights = ckpt.latest_checkpoint(dst) / "model.safetensors"
    if how == "flip":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x10  # inside a tensor: safetensors itself reads it without complaint
        weights.write_bytes(bytes(data))
    else:
        tensors = load_file(str(weights))
        tensors[TENSOR][3, 5] = float("nan")
        save_file(tensors, str(weights), metadata={"format": "pt"})
        write_dir_checksums(weights.parent)
    return dst


def reading_commands(run: Path, world: Path, port: int) -> dict[str, list]:
    return {"generate": ["generate", run, "--prompt", "hello", "--max-new-tokens", "4"],
            "chat": ["chat", run],
            "eval": ["eval", run, "--data", world / "pretrain", "--no-write", "--max-tokens", "2000"],
            "serve": ["serve", run, "--port", port],
            "resume": ["pretrain", "--out", run, "--resume"],
            "init": ["sft", "--init", run, "--data", world / "sft", "--out", run.parent / f"{run.name}-sft",
                     "--max-steps", "1", "--seq-len", "128", "--device", "cpu", "--tensorboard", "false"],
            "export": ["export", run, "--out", run.parent / f"{run.name}-hf"]}


@pytest.mark.slow
@pytest.mark.parametrize("how,words", [
    ("flip", ["model.safetensors: the file is corrupted or was replaced since it was written: its sha256 is",
              "checksums.sha256 recorded"]),
    ("nan", [f"model.safetensors: tensor {TENSOR} holds non-finite values (1 NaN of 12,288)"])])
def test_a_damaged_checkpoint_is_refused_by_every_command(world, tmp_path, how, words):
    run = damaged_copy(world, tmp_path / "copy", how)
    before = snapshot(run)
    commands = reading_commands(run, world, free_port())
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(commands, pool.map(lambda a: nf(*a, stdin="hi\n" if a[0] == "chat" else None),
                                              commands.values())))
    for r in results.values():
        one_clear_line(r, *words)
    assert str(run / "checkpoints" / "step_000004" / "model.safetensors") in results["generate"].stderr
    assert f"the previous checkpoint {run / 'checkpoints' / 'step_000002'} is intact" in results["resume"].stderr
    assert snapshot(run) == before, "the damaged run was changed"
    assert not (tmp_path / "copy-sft").exists() and not (tmp_path / "copy-hf").exists()


@pytest.mark.slow
def test_resume_goes_on_from_the_intact_checkpoint_it_offers(world, tmp_path):
    run = damaged_copy(world, tmp_path / "copy", "flip")
    refused = nf("pretrain", "--out", run, "--resume", "--max-steps", "6")
    offered = refused.stderr.split("(mv ")[1].split(")")[0].split()
    assert offered == [str(run / "checkpoints" / "step_000004"), str(run / "damaged-step_000004")]
    shutil.move(*offered)
    again = nf("pretrain", "--out", run, "--resume", "--max-steps", "6")
    assert again.returncode == 0, again.stderr
    assert "from " + str(run / "checkpoints" / "step_000002") in again.stdout + again.stderr
    assert [p.name for p in ckpt.list_checkpoints(run)][-1] == "step_000006"


def test_every_checkpoint_file_is_listed_with_its_sha256(world):
    latest = ckpt.latest_checkpoint(world / "run")
    listing = (latest / LISTING).read_text().splitlines()
    assert listing == [f"{sha256_of(latest / name)}  {name}" for name in ("model.safetensors", "state.json",
                                                                          "trainer.pt")]
    ckpt.verify_checkpoint(latest)


@pytest.mark.slow
def test_a_checkpoint_without_checksums_still_loads(world, tmp_path):
    """Checkpoints written before checksums existed load as before, without a word about it."""
    run = tmp_path / "old"
    shutil.copytree(world / "run", run)
    for listing in run.glob(f"checkpoints/*/{LISTING}"):
        listing.unlink()
    r = nf("generate", run, "--prompt", "hello", "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "checksum" not in r.stdout + r.stderr


@pytest.mark.slow
def test_an_hf_export_carries_checksums_that_transformers_ignores(world, tmp_path):
    hf = export_hf(world / "run", tmp_path / "hf")
    names = sorted(p.name for p in hf.iterdir() if p.is_file() and p.name != LISTING)
    listed = [line.split("  ") for line in (hf / LISTING).read_text().splitlines()]
    assert [name for _, name in listed] == names and all(sha256_of(hf / n) == s for s, n in listed)
    check = subprocess.run(["sha256sum", "-c", LISTING], cwd=hf, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    assert torch.isfinite(next(model.parameters())).all()
    data = bytearray((hf / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x10
    (hf / "model.safetensors").write_bytes(bytes(data))
    one_clear_line(nf("generate", hf, "--prompt", "hello", "--max-new-tokens", "2"),
                   f"{hf / 'model.safetensors'}: the file is corrupted or was replaced")


def flip_a_byte(path: Path) -> None:
    """One bit off in the last vocabulary entry's id ("ur": 505 -> 504): still a tokenizer.json that loads
    (before: silently, two tokens on one id)."""
    data = bytearray(path.read_bytes())
    data[data.index(b"\n", data.rindex(b'":', 0, data.index(b'"merges"'))) - 1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_damaged_tokenizer_is_refused_by_every_command(world, tmp_path):
    """A run's tokenizer/ carries its checksums.sha256 too (before: none, and a flipped byte in tokenizer.json
    changed what every command read and wrote without a word); an HF export's lists its tokenizer files."""
    run = tmp_path / "copy"
    shutil.copytree(world / "run", run)
    flip_a_byte(run / "tokenizer" / "tokenizer.json")
    hf = export_hf(world / "run", tmp_path / "hf")
    flip_a_byte(hf / "tokenizer.json")
    before = snapshot(tmp_path)
    commands = {name: args for name, args in reading_commands(run, world, free_port()).items() if name != "resume"}
    commands["hf"] = ["generate", hf, "--prompt", "hello", "--max-new-tokens", "2"]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(commands, pool.map(lambda a: nf(*a, stdin="hi\n" if a[0] == "chat" else None),
                                              commands.values())))
    for name, r in results.items():
        damaged = hf / "tokenizer.json" if name == "hf" else run / "tokenizer" / "tokenizer.json"
        one_clear_line(r, f"{damaged}: the file is corrupted or was replaced since it was written")
    assert snapshot(tmp_path) == before, "the damaged run was changed"
    old = shutil.copytree(world / "run", tmp_path / "old")
    (old / "tokenizer" / LISTING).unlink()  # as a run of an older nanoforge has it: read without a check
    r = nf("generate", old, "--prompt", "hello", "--max-new-tokens", "2")
    assert r.returncode == 0 and "checksum" not in r.stdout + r.stderr, r.stderr
