"""The round trip with Hugging Face TRL: `nanoforge export` -> TRL's SFTTrainer with assistant_only_loss=True on
our chat template -> TRL saves -> nanoforge loads TRL's directory (generate, eval, the same logits as
transformers) and exports it again unchanged.

TRL is not one of our dependencies: it runs in its own venv (see benchmarks/vs_trl.py), whose interpreter
NANOFORGE_TRL_PYTHON names; without it the test skips. The TRL side is benchmarks/trl_worker.py, the worker
benchmarks/vs_trl.py runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nanoforge.weights.load import load_model

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "benchmarks" / "trl_worker.py"
CHATS = [[{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"It is {a + b}."}]
         for a in range(6) for b in range(4)]
PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "春天来了吗？"}]


def trl_python() -> str:
    python = os.environ.get("NANOFORGE_TRL_PYTHON")
    if not python:
        pytest.skip("NANOFORGE_TRL_PYTHON is unset: name the python of a venv with trl installed "
                    "(benchmarks/vs_trl.py's docstring shows how to make one)")
    if not Path(python).is_file():
        pytest.skip(f"NANOFORGE_TRL_PYTHON={python}: no such file")
    return python


def run(*args: str, env=None) -> str:
    proc = subprocess.run([*args], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", **(env or {})})
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def nanoforge(*args: str) -> str:
    return run(sys.executable, "-m", "nanoforge", *args)


def trl_job(python: str, tmp: Path, **job) -> dict:
    job = {"out": str(tmp / f"{job['task']}.json"), "work": str(tmp / f"{job['task']}-out"), **job}
    (tmp / "job.json").write_text(json.dumps(job))
    run(python, str(WORKER), str(tmp / "job.json"), env={"HF_HUB_OFFLINE": "1"})
    return json.loads((tmp / f"{job['task']}.json").read_text())


@pytest.mark.slow
def test_export_trl_sft_and_back(tmp_path, tiny_tokenizer_dir):
    python = trl_python()
    from conftest import tiny_corpus
    base = tmp_path / "base"
    nanoforge("pretrain", "--preset", "tiny", "--data", str(tiny_corpus(tmp_path)[0]), "--tokenizer",
              str(tiny_tokenizer_dir), "--out", str(base), "--max-steps", "4", "--precision", "fp32",
              "--tensorboard", "false", "--eval-every", "0", "--quiet")
    nanoforge("export", str(base), "--out", str(tmp_path / "hf"))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in CHATS))

    saved = tmp_path / "trl"
    got = trl_job(python, tmp_path, task="sft", hf_dir=str(tmp_path / "hf"), data=str(data), steps=2, batch=4,
                  seq_len=128, lr=1e-3, warmup=0, save=str(saved))
    assert all(n > 0 for n in got["supervised_tokens"]), got  # our template's {% generation %} markers gave a mask
    before, after = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(saved / "model.safetensors"))
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)

    model, tok, _ = load_model(saved)  # TRL's directory, its tokenizer and chat_template.jinja
    ids = tok.render_chat(PROBE, add_generation_prompt=True)[0]
    hf = trl_job(python, tmp_path, task="logits", hf_dir=str(saved), texts=["Once upon a time"], chats=[PROBE],
                 ids=[ids])
    assert hf["chat_ids"] == [ids] and hf["text_ids"] == [tok.encode("Once upon a time")]
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0]
    assert torch.allclose(ours, torch.tensor(hf["logits"][0]), atol=1e-4)

    assert nanoforge("generate", str(saved), "--prompt", "Once upon", "--max-new-tokens", "4").startswith("Once upon")
    assert "loss (nats/token)" in nanoforge("eval", str(saved), "--data", str(data))
    nanoforge("export", str(saved), "--out", str(tmp_path / "again"))
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert again.keys() == after.keys() and all(torch.equal(again[k], after[k]) for k in after)
