"""The training loop: exact resume, gradient accumulation, the non-finite guard, checkpoints, signals."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nanoforge.core.config import build_config
from nanoforge.data.prepare import prepare_dataset
from nanoforge.core.device import resolve_precision
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.gpt import GPT
from nanoforge.weights import checkpoint as ckpt
from nanoforge.train.faults import INJECT_ENV
from nanoforge.train.loop import Stage, train
from nanoforge.train.objectives import causal_lm_loss
from nanoforge.recipes.pretrain import pretrain

ROOT = Path(__file__).resolve().parents[2]
FAST = {"tensorboard": False, "log_every": 1, "eval_every": 0, "precision": "fp32", "warmup_steps": 2,
        "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 32, "max_seq_len": 64}


@pytest.fixture(scope="module")
def pretrain_dir(tmp_path_factory, tiny_tokenizer, corpus_files):
    out = tmp_path_factory.mktemp("prep") / "pre"
    prepare_dataset("pretrain", corpus_files, tiny_tokenizer, out, val_fraction=0.1, workers=1, log=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    """Real text from ../shared/data when it is there; otherwise a small corpus written here, so the loop's
    tests still run on a fresh clone."""
    from conftest import tiny_corpus
    return tiny_corpus(tmp_path_factory.mktemp("corpus"))[:1]


def weights(run_dir):
    return load_file(str(ckpt.latest_checkpoint(run_dir) / "model.safetensors"))


def losses(run_dir):
    recs = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r]


def test_resume_continues_exactly(pretrain_dir, tmp_path):
    """N steps straight == N/2 steps, then a fresh resume from the N/2 checkpoint for the other N/2:
    same logged losses, bit-identical weights. Dropout is on, so the restored RNG state matters too."""
    common = {**FAST, "max_steps": 8, "save_every": 4, "keep_last": 5, "dropout": 0.1}
    pretrain([str(pretrain_dir)], tmp_path / "straight", preset="tiny", overrides=common, quiet=True)
    shutil.copytree(tmp_path / "straight", tmp_path / "split")
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "step_000008")  # as if killed right after step 4's save
    pretrain([], tmp_path / "split", resume=True, quiet=True)
    assert losses(tmp_path / "straight") == losses(tmp_path / "split")
    assert [s for s, _ in losses(tmp_path / "split")] == list(range(1, 9))
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "split")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_can_extend_a_finished_run(pretrain_dir, tmp_path):
    pretrain([str(pretrain_dir)], tmp_path / "r", preset="tiny", overrides={**FAST, "max_steps": 3}, quiet=True)
    s = pretrain([], tmp_path / "r", overrides={"max_steps": 5}, resume=True, quiet=True)
    assert s["step"] == 5 and [st for st, _ in losses(tmp_path / "r")] == [1, 2, 3, 4, 5]
    with pytest.raises(NanoforgeError, match=r"another model shape .*d_model saved 32, requested 64 \(by --d-model\)"):
        pretrain([], tmp_path / "r", overrides={"d_model": 64}, resume=True, quiet=True)


def test_fresh_runs_with_same_seed_are_identical(pretrain_dir, tmp_path):
    for name in ("a", "b"):
        pretrain([str(pretrain_dir)], tmp_path / name, preset="tiny", overrides={**FAST, "max_steps": 2}, quiet=True)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_accumulation_matches_one_big_batch(pretrain_dir, tmp_path):
    pretrain([str(pretrain_dir)], tmp_path / "big", preset="tiny",
             overrides={**FAST, "max_steps": 2, "batch_size": 8, "grad_accum": 1}, quiet=True)
    pretrain([str(pretrain_dir)], tmp_path / "acc", preset="tiny",
             overrides={**FAST, "max_steps": 2, "batch_size": 2, "grad_accum": 4}, quiet=True)
    la, lb = losses(tmp_path / "big"), losses(tmp_path / "acc")
    assert [s for s, _ in la] == [s for s, _ in lb]
    for (_, x), (_, y) in zip(la, lb):
        assert x == pytest.approx(y, rel=1e-5)
    a, b = weights(tmp_path / "big"), weights(tmp_path / "acc")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)  # Adam normalises: summation-order noise


def test_accumulation_normalises_over_whole_batch_with_uneven_masks(tmp_path, monkeypatch):
    """Micro-batches with different numbers of supervised tokens: the accumulated gradient equals the
    gradient of the mean loss over all supervised tokens of the step (not the mean of micro-batch means)."""
    mcfg, tcfg = build_config("tiny", None, {**FAST, "max_steps": 1, "grad_accum": 2, "batch_size": 1})
    mcfg.vocab_size = 50
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (2, 16), generator=g)
    labels = torch.randint(0, 50, (2, 16), generator=g)
    labels[0, :12] = -100  # 4 supervised tokens in the first micro-batch, 16 in the second

    class TwoRows:
        def __init__(self):
            self.i = 0

        def next_batch(self):
            row = self.i % 2
            self.i += 1
            return {"input_ids": x[row:row + 1], "labels": labels[row:row + 1]}

        def state_dict(self):
            return {"i": self.i}

        def load_state_dict(self, s):
            self.i = s["i"]

    torch.manual_seed(0)
    model, reference = GPT(mcfg), GPT(mcfg)
    reference.load_state_dict(model.state_dict())
    loss = torch.nn.functional.cross_entropy(reference(x).flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    grads = {}
    real_clip = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm):  # the gradients as the loop hands them to the optimizer
        grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
        return real_clip(params, max_norm)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    train(Stage("t", TwoRows(), causal_lm_loss), model, mcfg, tcfg, tmp_path, quiet=True)
    for n, p in reference.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-7)


def test_injected_inf_loss_skips_the_step_and_leaves_weights_intact(pretrain_dir, tmp_path, monkeypatch):
    # step index 2 gets an inf loss: its update is skipped, so the weights equal a clean 2-step run's
    monkeypatch.setenv(INJECT_ENV, "loss@2")
    s = pretrain([str(pretrain_dir)], tmp_path / "inj", preset="tiny",
                 overrides={**FAST, "max_steps": 3}, quiet=True)
    monkeypatch.delenv(INJECT_ENV)
    pretrain([str(pretrain_dir)], tmp_path / "clean", preset="tiny", overrides={**FAST, "max_steps": 2}, quiet=True)
    assert s["skipped_steps"] == 1
    a, b = weights(tmp_path / "inj"), weights(tmp_path / "clean")
    for k in a:
        assert torch.isfinite(a[k]).all()
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_nonfinite_gradients_skip_the_step(pretrain_dir, tmp_path, precision, monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "grad@1,grad@2")
    s = pretrain([str(pretrain_dir)], tmp_path / "g", preset="tiny",
                 overrides={**FAST, "precision": precision, "max_steps": 4},
                 quiet=True)
    assert s["skipped_steps"] == 2 and s["rollbacks"] == 0
    for v in weights(tmp_path / "g").values():
        assert torch.isfinite(v).all()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_repeated_nonfinite_rolls_back_with_lower_lr(pretrain_dir, tmp_path, precision, monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "loss@5,loss@6,loss@7")
    s = pretrain([str(pretrain_dir)], tmp_path / "rb", preset="tiny",
                 overrides={**FAST, "precision": precision, "max_steps": 10, "save_every": 4}, quiet=True)
    assert s["skipped_steps"] == 3 and s["rollbacks"] == 1
    events = [json.loads(l) for l in (tmp_path / "rb" / "metrics.jsonl").read_text().splitlines()]
    rb = [e for e in events if e.get("event") == "rollback"]
    assert rb and rb[0]["to_step"] == 4 and rb[0]["lr_scale"] == 0.5
    # fp16 falls back to bf16 where this CPU computes it natively, else to fp32 (what --precision auto picks)
    assert rb[0]["precision"] == (resolve_precision("auto", torch.device("cpu")) if precision == "fp16" else precision)
    assert s["step"] == 10
    for v in weights(tmp_path / "rb").values():
        assert torch.isfinite(v).all()


def test_nonfinite_before_any_checkpoint_is_a_clear_error(pretrain_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "loss@0,loss@1,loss@2")
    with pytest.raises(NanoforgeError, match="no checkpoint to roll back to"):
        pretrain([str(pretrain_dir)], tmp_path / "x", preset="tiny",
                 overrides={**FAST, "max_steps": 5}, quiet=True)


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, pretrain_dir):
    with pytest.raises(NanoforgeError, match="not a run directory"):
        pretrain([], tmp_path / "nothing", resume=True, quiet=True)


def test_run_directory_layout_and_metrics(pretrain_dir, tmp_path):
    out = tmp_path / "run"
    s = pretrain([str(pretrain_dir)], out, preset="tiny",
                 overrides={**FAST, "max_steps": 6, "eval_every": 3, "save_every": 2, "keep_last": 2,
                            "tensorboard": True, "log_every": 2}, quiet=True)
    assert (out / "config.toml").is_file() and (out / "tokenizer" / "tokenizer.json").is_file()
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000004", "step_000006"]
    assert list((out / "tb").glob("events.out.tfevents.*"))
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train_recs] == [2, 4, 6]
    assert all({"loss", "lr", "tokens_per_s", "grad_norm"} <= r.keys() for r in train_recs)
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in val] == [3, 6]
    assert all(r["val_bpb"] > 0 and r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) for r in val)
    # the optimizer state loads without unpickling arbitrary objects
    torch.load(ckpt.latest_checkpoint(out) / "trainer.pt", weights_only=True)
    assert s["val_loss"] == val[-1]["val_loss"]


def test_loss_falls_on_real_text(pretrain_dir, tmp_path):
    pretrain([str(pretrain_dir)], tmp_path / "learn", preset="tiny",
             overrides={**FAST, "max_steps": 60, "lr": 3e-3, "log_every": 10}, quiet=True)
    ls = [l for _, l in losses(tmp_path / "learn")]
    assert ls[-1] < ls[0] - 0.7, ls  # from chance level (ln 512 = 6.24) to well below it


def test_kill_during_checkpoint_write_keeps_previous_checkpoint(tmp_path):
    """A real process writing big checkpoints in a loop is SIGKILLed while a temporary directory exists;
    the latest complete checkpoint must still load."""
    script = f"""
import torch, sys
sys.path.insert(0, {str(ROOT)!r})
from nanoforge.weights import checkpoint as ckpt
w = {{"w": torch.randn(4_000_000)}}
step = 0
while True:
    step += 1
    ckpt.save_checkpoint({str(tmp_path)!r}, step, w, {{"optimizer": {{"x": torch.randn(4_000_000)}}}},
                         {{"data": {{}}}}, keep_last=2)
"""
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # wait for one complete checkpoint and a write in progress
            tmps = list((tmp_path / "checkpoints").glob(".tmp-*")) if (tmp_path / "checkpoints").exists() else []
            if tmps and ckpt.latest_checkpoint(tmp_path) is not None:
                break
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    last = ckpt.latest_checkpoint(tmp_path)
    assert last is not None
    assert ckpt.load_weights_file(last)["w"].shape == (4_000_000,)
    assert ckpt.load_state(last)["step"] >= 1
    ckpt.load_trainer_file(last)


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 2 MiB filesystem (tmpfs), so a checkpoint write really runs out of space."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {res.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])  # lazy: a traceback may still hold a file open


def test_full_disk_keeps_last_good_checkpoint(tiny_disk):
    ckpt.save_checkpoint(tiny_disk, 1, {"w": torch.ones(1000)}, {}, {"data": {}})
    with pytest.raises(NanoforgeError, match="could not write checkpoint .*step_000002.*(No space left|I/O error).*"
                                             "last good checkpoint is .*step_000001"):
        ckpt.save_checkpoint(tiny_disk, 2, {"w": torch.ones(1_000_000)}, {}, {"data": {}})
    assert [p.name for p in (tiny_disk / "checkpoints").iterdir()] == ["step_000001"]
    assert ckpt.load_weights_file(ckpt.latest_checkpoint(tiny_disk))["w"].shape == (1000,)


def test_training_stops_when_a_checkpoint_cannot_be_written(pretrain_dir, tiny_disk):
    """The run must not go on as if it had saved."""
    with pytest.raises(NanoforgeError, match="could not write checkpoint"):
        pretrain([str(pretrain_dir)], tiny_disk / "run", preset="tiny",
                 overrides={**FAST, "d_model": 128, "max_steps": 6, "save_every": 2, "tensorboard": False},
                 quiet=True)


def test_full_disk_during_checkpoint_write_is_reported(tmp_path, monkeypatch):
    """Simulated ENOSPC in the middle of writing: no partial checkpoint, the previous one remains."""
    w = {"w": torch.ones(3)}
    ckpt.save_checkpoint(tmp_path, 1, w, {}, {"data": {}})

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(NanoforgeError, match="No space left on device.*step_000001"):
        ckpt.save_checkpoint(tmp_path, 2, w, {}, {"data": {}})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]


@pytest.mark.slow
def test_sigterm_writes_checkpoint_and_resume_finishes(pretrain_dir, tmp_path):
    out = tmp_path / "sig"
    args = [sys.executable, "-m", "nanoforge", "pretrain", "--data", str(pretrain_dir), "--out", str(out),
            "--preset", "tiny", "--max-steps", "100000", "--save-every", "0", "--log-every", "1",
            "--tensorboard", "false", "--eval-every", "0", "--precision", "fp32"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    for line in proc.stderr:  # wait until training is really running
        if line.startswith("step") and "loss" in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM received: checkpoint written" in err
    last = ckpt.latest_checkpoint(out)
    assert last is not None
    stopped = ckpt.load_state(last)["step"]
    done = subprocess.run([sys.executable, "-m", "nanoforge", "pretrain", "--out", str(out), "--resume",
                           "--max-steps", str(stopped + 3), "--quiet"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert ckpt.load_state(ckpt.latest_checkpoint(out))["step"] == stopped + 3


def test_early_stopping_when_validation_stops_improving(pretrain_dir, tmp_path):
    # an lr far below fp32 resolution leaves the weights bit-identical, so validation cannot improve
    s = pretrain([str(pretrain_dir)], tmp_path / "es", preset="tiny",
                 overrides={**FAST, "max_steps": 50, "lr": 1e-15, "eval_every": 1, "eval_batches": 1,
                            "early_stop_patience": 2}, quiet=True)
    assert s["stop_reason"] == "early_stop" and s["step"] == 3
    assert ckpt.latest_checkpoint(tmp_path / "es").name == "step_000003"


@pytest.mark.slow
def test_time_budget_ends_the_run_on_time_with_its_schedule_done_and_resume_continues_it(pretrain_dir, tmp_path):
    """--time-budget S: the run stops once S seconds of training are spent, however many steps that took, with
    its wsd decay finished (the lr follows seconds, not steps), and writes its final checkpoint as usual. The
    seconds spent are in the checkpoint, so --resume continues the same clock: a larger budget adds only the
    difference, and a spent one trains no further."""
    out = tmp_path / "tb"
    line = [sys.executable, "-m", "nanoforge", "pretrain", "--data", str(pretrain_dir), "--out", str(out),
            "--preset", "tiny", "--max-steps", "100000", "--save-every", "0", "--log-every", "1", "--quiet",
            "--d-model", "32", "--n-layers", "1", "--seq-len", "32", "--batch-size", "2", "--tensorboard", "false", "--eval-every", "0", "--precision", "fp32", "--schedule", "wsd",
            "--decay-fraction", "0.5", "--min-lr-ratio", "0", "--warmup-steps", "2"]
    seen, env = [], {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 threads on a loaded machine: seconds per step
    for budget, resume in (("3", []), ("5", ["--resume"]), ("5", ["--resume"])):
        done = subprocess.run(line + ["--time-budget", budget] + resume, capture_output=True, text=True, cwd=ROOT,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr
        state = ckpt.load_state(ckpt.latest_checkpoint(out))
        seen.append((state["step"], state["run_state"]["train_seconds"]))
    (first, t1), (second, t2), (third, t3) = seen
    assert 3.0 <= t1 < 5.0 and 5.0 <= t2 < 7.0 and 2 < first < second == third and t3 == pytest.approx(t2, abs=0.5)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in recs if "lr" in r and r["step"] <= first]
    assert lrs[-1] < 0.1 * max(lrs) and lrs[len(lrs) // 4] == max(lrs)  # stable, then decayed to ~0 by the end
