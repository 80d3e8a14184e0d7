"""`--resume` continues on the data the run started on, or says what changed: the prepared data's identity (the
sha256 of its shards, recorded by `prepare`) goes into every checkpoint and is compared on resume, not only the
counts. Real commands: the data re-prepared in place from reordered records (the same token and window counts)
is refused in one line naming the file that changed, with the run and the data left byte-identical; the same
data prepared again resumes."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanoforge.core.checksums import write_dir_checksums
from nanoforge.data.prepare import prepare_dataset
from nanoforge.data.shards import data_identity, read_manifest
from nanoforge.recipes.pretrain import pretrain
from nanoforge.weights import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
TINY = {"tensorboard": False, "log_every": 1, "eval_every": 0, "precision": "fp32", "device": "cpu",
        "seq_len": 32, "max_steps": 2, "save_every": 2}
WORDS = "the cat sat on the mat while a dog ran in the park and birds sang near the old mill".split()


def nf(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoforge", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, stdin=subprocess.DEVNULL)


def snapshot(*paths: Path) -> dict:
    return {p: p.read_bytes() for path in paths for p in sorted(path.rglob("*")) if p.is_file()}


def records(n: int = 120) -> list[str]:
    return [json.dumps({"text": f"record {i}: " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(25))})
            + "\n" for i in range(n)]


@pytest.fixture(scope="module")
def template(tmp_path_factory, tiny_tokenizer_dir):
    """in.jsonl, its prepared data (no val split: every record in train) and a run of 2 steps on it."""
    work = tmp_path_factory.mktemp("data_identity")
    (work / "in.jsonl").write_text("".join(records()))
    prepare_dataset("pretrain", [work / "in.jsonl"], tiny_tokenizer_dir, work / "pre", val_fraction=0.0,
                    workers=1, log=lambda *a: None)
    pretrain([str(work / "pre")], work / "run", preset="tiny", overrides=TINY, quiet=True)
    return work


@pytest.fixture
def world(template, tmp_path):
    """A copy of the template; the run's config.toml names the copy's data."""
    for name in ("in.jsonl", "pre", "run"):
        (shutil.copytree if (template / name).is_dir() else shutil.copy)(template / name, tmp_path / name)
    config = tmp_path / "run" / "config.toml"
    config.write_text(config.read_text().replace(str((template / "pre").resolve()), str((tmp_path / "pre").resolve())))
    return tmp_path


def prepare_again(world: Path, tok: Path, *flags) -> None:
    r = nf("prepare", "--kind", "pretrain", "--data", world / "in.jsonl", "--tokenizer", tok, "--out", world / "pre",
           "--workers", "1", "--val-fraction", "0", "--force", *flags)
    assert r.returncode == 0, r.stderr


def resume(world: Path, *flags) -> subprocess.CompletedProcess:
    return nf("pretrain", "--out", world / "run", "--resume", *flags)


def assert_refused(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: "), r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


@pytest.mark.slow
def test_data_re_prepared_from_reordered_records_is_refused_naming_the_file(world, tiny_tokenizer_dir):
    before_counts = read_manifest(world / "pre")["splits"]["train"]
    lines = records()
    random.Random(0).shuffle(lines)
    (world / "in.jsonl").write_text("".join(lines))
    prepare_again(world, tiny_tokenizer_dir)
    after_counts = read_manifest(world / "pre")["splits"]["train"]
    assert (after_counts["tokens"], after_counts["docs"]) == (before_counts["tokens"], before_counts["docs"])
    kept = snapshot(world / "run", world / "pre")
    r = resume(world)
    assert_refused(r, f"cannot resume: {world / 'pre'} is not the data this run trained on: in.jsonl is another "
                      "file (sha256 ", "The saved position (window ", "resume with the data the run started on")
    assert snapshot(world / "run", world / "pre") == kept, "a refused resume changed the run or the data"


@pytest.mark.slow
def test_the_same_records_prepared_with_other_options_are_refused(world, tiny_tokenizer_dir):
    kept = snapshot(world / "run")
    prepare_again(world, tiny_tokenizer_dir, "--val-fraction", "0.2")  # (the later flag wins)
    assert_refused(resume(world), "its inputs are the same files, but its shards hold other tokens")
    assert snapshot(world / "run") == kept


@pytest.mark.slow
def test_the_same_data_prepared_again_resumes(world, tiny_tokenizer_dir):
    prepare_again(world, tiny_tokenizer_dir)
    r = resume(world, "--max-steps", 4)
    assert r.returncode == 0, r.stderr
    assert ckpt.latest_checkpoint(world / "run").name == "step_000004"


@pytest.mark.slow
def test_a_checkpoint_from_before_data_identities_resumes(world):
    """A checkpoint of an older nanoforge records no identity: it resumes on the counts, as before."""
    latest = ckpt.latest_checkpoint(world / "run")
    state = json.loads((latest / "state.json").read_text())
    del state["data"]["identity"]
    (latest / "state.json").write_text(json.dumps(state))
    write_dir_checksums(latest)
    r = resume(world, "--max-steps", 4)
    assert r.returncode == 0, r.stderr


def test_the_identity_is_the_content_whatever_the_workers(tmp_path, tiny_tokenizer_dir):
    (tmp_path / "in.jsonl").write_text("".join(records(400)))
    ids = []
    for workers in (1, 2):
        out = tmp_path / f"pre{workers}"
        prepare_dataset("pretrain", [tmp_path / "in.jsonl"], tiny_tokenizer_dir, out, val_fraction=0.1,
                        workers=workers, log=lambda *a: None, chunk_bytes=8 << 10, max_shard_tokens=3000)
        manifest = read_manifest(out)
        assert len(manifest["splits"]["train"]["shards"]) > 1
        ids.append(data_identity(manifest))
    assert ids[0] == ids[1] and ids[0]["shards"] is not None
