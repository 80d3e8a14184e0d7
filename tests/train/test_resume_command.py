"""`--resume` accepts the command that started the run: the same --preset, --config, model flags and --init are
fine; only a real difference is an error naming each field with its saved and requested values. Real processes,
as a user types them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tree_state

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--seq-len", 32, "--log-every", 1, "--eval-every", 0, "--save-every", 2, "--tensorboard", "false",
          "--precision", "fp32", "--warmup-steps", 1]


def nf(*args):
    return subprocess.run([sys.executable, "-m", "nanoforge", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def last_step(run):
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A pretraining file and an SFT file this test writes itself."""
    d = tmp_path_factory.mktemp("resume_corpus")
    words = "the cat sat on the mat while a dog ran in the park and birds sang near the old mill".split()
    with open(d / "pre.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": " ".join(words[(i * 7 + j) % len(words)] for j in range(30))}) + "\n")
    with open(d / "sft.jsonl", "w") as f:
        for i in range(40):
            turns = [{"role": "user", "content": f"what sat on the mat {i}?"},
                     {"role": "assistant", "content": f"the cat sat there, {words[i % len(words)]}."}]
            f.write(json.dumps({"conversations": turns}) + "\n")
    return d


@pytest.fixture(scope="module")
def pretrained(corpus, tmp_path_factory):
    """A tiny run started with --preset, a model flag and raw JSONL, then resumed with the same line + --resume."""
    run = tmp_path_factory.mktemp("resume_runs") / "pre"
    line = ["pretrain", "--preset", "tiny", "--n-layers", 1, "--vocab-size", 300, "--data", corpus / "pre.jsonl",
            "--out", run, *COMMON]
    first = nf(*line, "--max-steps", 2)
    assert first.returncode == 0, first.stderr
    again = nf(*line, "--max-steps", 4, "--resume")
    assert again.returncode == 0, again.stderr
    assert last_step(run) == 4
    return run, line


def test_the_starting_command_plus_resume_continues(pretrained):
    run, line = pretrained
    same = nf(*line, "--max-steps", 5, "--resume")
    assert same.returncode == 0, same.stderr
    assert last_step(run) == 5
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert steps == sorted(set(steps)), "each step is logged once"


def test_a_different_shape_is_named_field_by_field(pretrained, tmp_path):
    run, line = pretrained
    before = (run / "metrics.jsonl").read_bytes()
    other = nf("pretrain", "--preset", "mini", "--out", run, "--resume", "--max-steps", 9)
    assert other.returncode == 1
    err = " ".join(other.stderr.split())
    assert "another model shape" in err
    assert "d_model saved 64, requested 512 (by --preset mini)" in err
    assert "n_layers saved 1, requested 8 (by --preset mini)" in err
    flag = nf("pretrain", "--preset", "tiny", "--n-layers", 2, "--out", run, "--resume", "--max-steps", 9)
    assert flag.returncode == 1 and "n_layers saved 1, requested 2 (by --n-layers)" in flag.stderr
    toml = tmp_path / "shape.toml"
    toml.write_text("[model]\nn_layers = 3\n[train]\nlr = 1e-3\n")
    config = nf("pretrain", "--config", toml, "--out", run, "--resume", "--max-steps", 9)
    assert config.returncode == 1 and f"n_layers saved 1, requested 3 (by --config {toml})" in config.stderr
    assert (run / "metrics.jsonl").read_bytes() == before, "a refused resume changes nothing"


def test_a_config_with_the_saved_shape_is_accepted(pretrained, tmp_path):
    run, _ = pretrained
    saved = (run / "config.toml").read_text()
    toml = tmp_path / "same.toml"
    toml.write_text(saved[saved.index("[model]"):saved.index("[train]")])  # the run's own [model] section
    ok = nf("pretrain", "--config", toml, "--out", run, "--resume", "--max-steps", last_step(run) + 1)
    assert ok.returncode == 0, ok.stderr


def test_finetuning_accepts_its_init_again_and_names_another(pretrained, corpus, tmp_path):
    pre, _ = pretrained
    line = ["sft", "--init", pre, "--data", corpus / "sft.jsonl", "--out", tmp_path / "sft", *COMMON, "--seq-len", 96]
    assert nf(*line, "--max-steps", 2).returncode == 0
    # the init run trains on meanwhile: --init RUN now resolves to a newer checkpoint, and is still the same init
    more = nf("pretrain", "--out", pre, "--resume", "--max-steps", last_step(pre) + 2)
    assert more.returncode == 0, more.stderr
    again = nf(*line, "--max-steps", 3, "--resume")
    assert again.returncode == 0, again.stderr
    assert last_step(tmp_path / "sft") == 3
    wrong = nf("sft", "--init", tmp_path / "sft", "--data", corpus / "sft.jsonl", "--out", tmp_path / "sft",
               "--resume", "--max-steps", 4)
    # the run given as its own --init: refused before anything is read or written, as every output that is
    # one of its inputs is
    assert wrong.returncode == 1
    assert "would write over its input" in wrong.stderr and "(it is that input)" in wrong.stderr, wrong.stderr


def test_stage_options_given_again_are_fine_and_a_change_is_named(pretrained, corpus, tmp_path):
    pre, _ = pretrained
    line = ["lora", "--init", pre, "--data", corpus / "sft.jsonl", "--out", tmp_path / "lora", "--rank", 4,
            "--targets", "q,v", *COMMON, "--seq-len", 96]
    assert nf(*line, "--max-steps", 2).returncode == 0
    again = nf(*line, "--max-steps", 3, "--resume")
    assert again.returncode == 0, again.stderr
    changed = nf(*line, "--rank", 8, "--targets", "q,k", "--max-steps", 4, "--resume")
    assert changed.returncode == 1
    assert "--rank saved 4, requested 8; --targets saved 'q,v', requested 'q,k'" in changed.stderr
    assert last_step(tmp_path / "lora") == 3


def test_a_refused_resume_writes_nothing(pretrained):
    """Refusals that come late (the data position, at the checkpoint's restore) leave the run as it was:
    config.toml is written only once every check has passed, or the next plain --resume would take the refused
    option as the run's own."""
    run, line = pretrained
    before = {p: s for p, s in tree_state(run).items() if p.name != ".lock"}
    for flag, saved, value in (("--seq-len", 32, 48), ("--seed", 0, 7)):
        r = nf(*line, flag, value, "--max-steps", 9, "--resume")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"it was saved with {flag[2:].replace('-', '_')}={saved} but this run has" in r.stderr, r.stderr
        assert {p: s for p, s in tree_state(run).items() if p.name != ".lock"} == before, f"{flag}: a file changed"
