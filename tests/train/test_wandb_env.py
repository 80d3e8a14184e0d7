"""wandb's own environment decides where and how a run logs to it: `--wandb-project` turns it on, and WANDB_DIR,
WANDB_NAME, WANDB_MODE and the rest are the user's (our run directory and its name are only the defaults). Real
wandb, offline (no network, no login), through the real command."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import prepare_tiny
from test_report import wandb_records

pytest.importorskip("wandb", reason="wandb is the optional `wandb` extra (and in `test`): pip install wandb")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_tokenizer) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("wandb_data") / "pre", tiny_tokenizer)


def pretrain(data: Path, out: Path, tmp: Path, **wandb_env: str) -> subprocess.CompletedProcess:
    """Two steps with --wandb-project set, wandb's config and cache kept under `tmp`, and `wandb_env` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_SILENT="true", WANDB_CONSOLE="off", WANDB_CONFIG_DIR=str(tmp / "wandb_config"),
               WANDB_CACHE_DIR=str(tmp / "wandb_cache"), WANDB_DATA_DIR=str(tmp / "wandb_data"), WANDB_API_KEY="",
               OMP_NUM_THREADS="1", **wandb_env)
    cmd = [sys.executable, "-m", "nanoforge", "pretrain", "--data", str(data), "--out", str(out), "--preset", "tiny",
           "--max-steps", "2", "--log-every", "1", "--eval-every", "0", "--sample-every", "0", "--save-every", "0",
           "--precision", "fp32", "--device", "cpu", "--tensorboard", "false", "--quiet",
           "--wandb-project", "nanoforge-test"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def offline_runs(root: Path) -> list[Path]:
    return sorted((root / "wandb").glob("offline-run-*"))


def run_record(offline_run: Path):
    """The run record (name, project, ...) of an offline run's .wandb file."""
    [log] = offline_run.glob("*.wandb")
    return next(r.run for r in wandb_records(log) if r.WhichOneof("record_type") == "run")


@pytest.mark.slow
def test_wandb_dir_and_name_are_the_users(data, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pretrain(data, tmp_path / "run", tmp_path, WANDB_MODE="offline", WANDB_DIR=str(elsewhere),
             WANDB_NAME="my-own-name")
    assert not (tmp_path / "run" / "wandb").exists()
    [run] = offline_runs(elsewhere)
    record = run_record(run)
    assert (record.display_name, record.project) == ("my-own-name", "nanoforge-test")


@pytest.mark.slow
def test_without_wandb_dir_the_run_directory_holds_it(data, tmp_path):
    pretrain(data, tmp_path / "run-b", tmp_path, WANDB_MODE="offline")
    [run] = offline_runs(tmp_path / "run-b")
    assert run_record(run).display_name == "run-b"


@pytest.mark.slow
def test_wandb_mode_disabled_writes_nothing(data, tmp_path):
    pretrain(data, tmp_path / "run", tmp_path, WANDB_MODE="disabled", WANDB_DIR=str(tmp_path))
    assert not offline_runs(tmp_path) and not (tmp_path / "run" / "wandb").exists()
