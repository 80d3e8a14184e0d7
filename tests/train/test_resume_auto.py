"""`--resume auto`: the same command line for the first start and every restart. Real processes, as a
requeued job runs them: an absent or empty run directory starts fresh, one with a checkpoint continues, one
with only the config of a run killed before its first save starts fresh, one of another stage is refused."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanoforge.weights import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--preset", "tiny", "--n-layers", 1, "--vocab-size", 300, "--seq-len", 32, "--log-every", 1,
          "--eval-every", 0, "--save-every", 2, "--tensorboard", "false", "--precision", "fp32",
          "--warmup-steps", 1]


def nf(*args):
    return subprocess.run([sys.executable, "-m", "nanoforge", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def logged_steps(run):
    return [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("auto_corpus")
    words = "the cat sat on the mat while a dog ran in the park and birds sang near the old mill".split()
    with open(d / "pre.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": " ".join(words[(i * 7 + j) % len(words)] for j in range(30))}) + "\n")
    return d


@pytest.fixture(scope="module")
def auto_run(corpus, tmp_path_factory):
    """An empty run directory started with --resume auto, then the same line again with more steps."""
    run = tmp_path_factory.mktemp("auto_runs") / "pre"
    run.mkdir()
    line = ["pretrain", "--data", corpus / "pre.jsonl", "--out", run, *COMMON, "--resume", "auto"]
    first = nf(*line, "--max-steps", 2)
    assert first.returncode == 0, first.stderr
    assert "continuing" not in first.stdout and logged_steps(run) == [1, 2]
    again = nf(*line, "--max-steps", 4)
    assert again.returncode == 0, again.stderr
    return run, line, again


def test_the_same_line_twice_continues_the_run(auto_run):
    run, _, again = auto_run
    assert "--resume auto: continuing" in again.stdout and "step_000002" in again.stdout
    assert logged_steps(run) == [1, 2, 3, 4], "steps 1-2 kept, 3-4 added: a continuation, not a restart"


def test_a_config_only_directory_starts_fresh(auto_run, tmp_path):
    run, line, _ = auto_run
    killed = tmp_path / "killed"
    killed.mkdir()
    shutil.copy(run / "config.toml", killed / "config.toml")  # what a run killed before its first save leaves
    line = [killed if a == run else a for a in line]
    res = nf(*line, "--max-steps", 2)
    assert res.returncode == 0, res.stderr
    assert "no checkpoint (stopped before its first save): starting fresh" in res.stdout
    assert logged_steps(killed) == [1, 2]
    assert (killed / "checkpoints" / "step_000002").is_dir()


def test_auto_never_starts_over_another_stage(auto_run, corpus, tmp_path):
    run, _, _ = auto_run
    before = (run / "metrics.jsonl").read_bytes()
    sft = nf("sft", "--init", run, "--data", corpus / "pre.jsonl", "--out", run, "--resume", "auto")
    assert sft.returncode == 1
    assert "holds a 'pretrain' run, not sft" in sft.stderr
    assert (run / "metrics.jsonl").read_bytes() == before


def test_resume_takes_only_auto(tmp_path):
    res = nf("pretrain", "--out", tmp_path / "r", "--resume", "always")
    assert res.returncode == 2 and "the one value is auto" in res.stderr


def snapshot(run):
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.slow
def test_a_run_killed_before_its_first_save_says_how_to_start_again(corpus, tmp_path):
    """A run SIGKILLed after step 2 of 4, before its first save: --resume (of any training command) is refused,
    naming both ways on, and changes nothing; each way on then works from that very state."""
    run, env = tmp_path / "killed", {**os.environ, "NANOFORGE_INJECT_KILL": "0@2"}
    line = ["pretrain", "--data", corpus / "pre.jsonl", "--out", run, *COMMON, "--save-every", 4, "--max-steps", 4]
    killed = subprocess.run([sys.executable, "-m", "nanoforge", *map(str, line)], capture_output=True, cwd=ROOT,
                            env=env, timeout=300)
    assert killed.returncode == -9 and logged_steps(run) == [1, 2] and not (run / "checkpoints").exists()
    before = snapshot(run)
    for stage in ("pretrain", "sft", "lora", "dpo", "distill", "grpo", "ppo"):
        res = nf(stage, "--out", run, "--resume")
        assert res.returncode == 1 and res.stderr.count("\n") == 1, (stage, res.stderr)
        assert (f"--resume: {run} has no checkpoint to resume from (looked in {run}/checkpoints); nothing was "
                "saved before it stopped: start it again with the command that began it, without --resume, or "
                "with --resume auto") in res.stderr, (stage, res.stderr)
        assert snapshot(run) == before, stage
    shutil.copytree(run, tmp_path / "auto")
    again = nf(*line)
    assert again.returncode == 0, again.stderr
    assert logged_steps(run) == [1, 2, 3, 4] and ckpt.latest_checkpoint(run).name == "step_000004"
    auto = nf(*[tmp_path / "auto" if a == run else a for a in line], "--resume", "auto")
    assert auto.returncode == 0 and "starting fresh" in auto.stdout, auto.stderr
    assert logged_steps(tmp_path / "auto") == [1, 2, 3, 4]
