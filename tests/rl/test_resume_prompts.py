"""`grpo --resume` (and ppo's, the same PromptIterator) continues on the prompts the run started on: the prompts
file reordered in place (the same number of prompts) is refused in one line naming it, with the run left
byte-identical; the file as it was resumes. Real commands."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanoforge.data.prepare import prepare_dataset
from nanoforge.recipes.pretrain import pretrain

ROOT = Path(__file__).resolve().parents[2]
TINY = {"tensorboard": False, "log_every": 1, "eval_every": 0, "precision": "fp32", "device": "cpu",
        "seq_len": 32, "max_steps": 1, "save_every": 0}
PROMPTS = [json.dumps({"question": f"{a}+{a}=", "answer": f"#### {2 * a}"}) + "\n" for a in range(8)]


def nf(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoforge", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, stdin=subprocess.DEVNULL)


def snapshot(path: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_grpo_resume_refuses_reordered_prompts(tmp_path, tiny_tokenizer_dir):
    from conftest import tiny_corpus
    prepare_dataset("pretrain", [tiny_corpus(tmp_path)[0]], tiny_tokenizer_dir, tmp_path / "pre", val_fraction=0.1,
                    workers=1, log=lambda *a: None)
    pretrain([str(tmp_path / "pre")], tmp_path / "base", preset="tiny", overrides=TINY, quiet=True)
    prompts, out = tmp_path / "p.jsonl", tmp_path / "grpo"
    prompts.write_text("".join(PROMPTS))
    first = nf("grpo", "--init", tmp_path / "base", "--data", prompts, "--out", out, "--num-generations", 2,
               "--prompts-per-step", 1, "--max-new-tokens", 4, "--max-steps", 2, "--save-every", 2, "--device", "cpu",
               "--tensorboard", "false")
    assert first.returncode == 0, first.stderr
    prompts.write_text("".join(reversed(PROMPTS)))
    kept = snapshot(out)
    r = nf("grpo", "--out", out, "--resume")
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"cannot resume: {prompts} does not hold the prompts this run trained on: other records, or the same " \
           "in another order (8 now, 8 at the start)" in r.stderr
    assert snapshot(out) == kept, "a refused resume changed the run"
    prompts.write_text("".join(PROMPTS))
    again = nf("grpo", "--out", out, "--resume", "--max-steps", 3)
    assert again.returncode == 0, again.stderr
