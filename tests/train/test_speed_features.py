"""Speed features of the loop: device-side non-finite bookkeeping, the phase-time split, activation
checkpointing and torch.compile. Each must leave training's results unchanged."""
import json
from pathlib import Path

import pytest
import torch

from nanoforge.core.config import ModelConfig
from nanoforge.model.gpt import GPT
from nanoforge.train.faults import INJECT_ENV
from nanoforge.recipes.pretrain import pretrain

from test_loop import FAST, corpus_files, pretrain_dir, weights  # noqa: F401  (fixtures)


def records(run_dir):
    return [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_rare_reports_still_roll_back_before_the_next_checkpoint(pretrain_dir, tmp_path, monkeypatch):
    """With logging only at the end, non-finite steps are counted on the device and read when a checkpoint is
    due: three bad steps (5-7) roll back to step 4 before step 8 is saved, exactly as with per-step reads."""
    monkeypatch.setenv(INJECT_ENV, "loss@5,loss@6,loss@7")
    s = pretrain([str(pretrain_dir)], tmp_path / "rb", preset="tiny",
                 overrides={**FAST, "log_every": 100, "max_steps": 10, "save_every": 4}, quiet=True)
    assert s["skipped_steps"] == 3 and s["rollbacks"] == 1
    rb = [r for r in records(tmp_path / "rb") if r.get("event") == "rollback"]
    assert len(rb) == 1 and rb[0]["to_step"] == 4 and rb[0]["lr_scale"] == 0.5
    for v in weights(tmp_path / "rb").values():
        assert torch.isfinite(v).all()


def test_skips_counted_between_reports_leave_weights_as_a_clean_run(pretrain_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "grad@2")
    s = pretrain([str(pretrain_dir)], tmp_path / "inj", preset="tiny",
                 overrides={**FAST, "log_every": 50, "max_steps": 3}, quiet=True)
    monkeypatch.delenv(INJECT_ENV)
    pretrain([str(pretrain_dir)], tmp_path / "clean", preset="tiny",
             overrides={**FAST, "log_every": 50, "max_steps": 2}, quiet=True)
    assert s["skipped_steps"] == 1
    a, b = weights(tmp_path / "inj"), weights(tmp_path / "clean")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_time_split_is_logged_and_adds_up(pretrain_dir, tmp_path):
    pretrain([str(pretrain_dir)], tmp_path / "t", preset="tiny", overrides={**FAST, "max_steps": 4, "log_every": 2},
             quiet=True)
    logged = [r for r in records(tmp_path / "t") if "loss" in r]
    assert len(logged) == 2
    for r in logged:
        parts = [r["data_ms"], r["fwd_bwd_ms"], r["optim_ms"]]
        assert all(p > 0 for p in parts)
        step_ms = 1e3 * (4 * 32) / r["tokens_per_s"]  # tiny's batch 4 x seq_len 32 tokens per step / tokens per s
        assert sum(parts) <= step_ms * 1.01


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32)
    model = GPT(cfg)
    ids = torch.randint(0, 300, (2, 16))

    def grads(recompute):
        model.zero_grad()
        model.activation_checkpointing = recompute
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, recomputed = grads(False), grads(True)
    for n in plain:
        torch.testing.assert_close(recomputed[n], plain[n], rtol=1e-5, atol=1e-7)


def test_activation_checkpointing_run_matches_a_plain_run(pretrain_dir, tmp_path):
    for name, ac in (("plain", False), ("ac", True)):
        pretrain([str(pretrain_dir)], tmp_path / name, preset="tiny",
                 overrides={**FAST, "max_steps": 3, "activation_checkpointing": ac}, quiet=True)
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "ac")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compiled_training_matches_eager(pretrain_dir, tmp_path):
    """--compile trains the compiled model (same losses within fp32 tolerance); validation runs on the
    uncompiled twin and the checkpoint has the plain parameter names."""
    for name, comp in (("eager", False), ("compiled", True)):
        pretrain([str(pretrain_dir)], tmp_path / name, preset="tiny",
                 overrides={**FAST, "max_steps": 3, "compile": comp, "eval_every": 3}, quiet=True)
    la = [r["loss"] for r in records(tmp_path / "eager") if "loss" in r]
    lb = [r["loss"] for r in records(tmp_path / "compiled") if "loss" in r]
    assert len(la) == len(lb) == 3
    assert la == pytest.approx(lb, rel=1e-4)
    va = [r["val_loss"] for r in records(tmp_path / "eager") if "val_loss" in r]
    vb = [r["val_loss"] for r in records(tmp_path / "compiled") if "val_loss" in r]
    assert va == pytest.approx(vb, rel=1e-4)
    a, b = weights(tmp_path / "eager"), weights(tmp_path / "compiled")
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5)

