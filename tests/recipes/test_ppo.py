"""`nanoforge ppo`: the stage on the one loop (what it logs, exact resume mid-rollout, early stopping on approximate
KL, muon refused), a PPO run read back as its policy by the loader and the CLI, and that it learns (arithmetic)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import arithmetic_reward_curve, metrics_of, save_random_run
from nanoforge.core.errors import NanoforgeError
from nanoforge.weights.load import CRITIC_PREFIX, init_weights, load_model
from nanoforge.model.gpt import GPT
from nanoforge.rl import critic
from nanoforge.rl.options import PPOOptions
from nanoforge.rl.ppo_update import forward_ppo
from nanoforge.recipes.ppo import PPOOptions, ppo
from nanoforge.rl.ppo_batches import ppo_rollout
from nanoforge.rl.prompts import read_prompts
from nanoforge.rl.rewards import combine, parse_rewards
from nanoforge.rl.grpo_batches import decode_batch, encode_batch
from nanoforge.weights import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
FAST = {"precision": "fp32", "tensorboard": False, "save_every": 0, "device": "cpu"}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, tiny_tokenizer):
    """A random tiny model saved as a run (its config, tokenizer and one checkpoint): an --init."""
    return save_random_run(tmp_path_factory.mktemp("ppo_base") / "base", tiny_tokenizer, max_seq_len=256)


def _options(prompts_file, **kw):
    return PPOOptions(**{"num_generations": 2, "prompts_per_step": 2, "max_new_tokens": 6,
                         "reward": f"math,{prompts_file.parent / 'myreward.py'}:tenth_chars", **kw})


def test_rollout_batch_aligns_masks_and_gives_ratio_one(base_run, prompts_file):
    """The rollout's per-token mask covers each reply (stop token included), the old log-probs and values equal
    a fresh forward of the combined model, the reference's equal the policy's at the start (KL 0), and the
    batch survives the checkpoint's encoding bit for bit."""
    policy, tok, _ = load_model(base_run)
    model = critic.PolicyWithValue.from_policy(policy)
    ref = load_model(base_run)[0]
    options = PPOOptions(num_generations=2, temperature=0.9, max_new_tokens=6, beta=0.1)
    batch = ppo_rollout(model, tok, read_prompts(prompts_file)[:2], options, combine(parse_rewards("math,length")),
                        seed=1, reference=ref)
    ids, mask = batch["input_ids"], batch["mask"]
    assert ids.shape == mask.shape == batch["old_logp"].shape == batch["returns"].shape and ids.shape[0] == 4
    for row, m in zip(ids, mask):
        written = row[m].tolist()
        assert 1 <= len(written) <= 7 and (written[-1] == tok.im_end_id or len(written) == 6)
        assert not m[0] and m.int().diff().abs().sum() <= 2  # one contiguous run of reply tokens
    model.train()
    logp, values = forward_ppo(model, ids, 0.9)
    assert torch.equal(logp.detach()[mask], batch["old_logp"][mask])
    assert torch.equal(values.detach()[mask], batch["old_values"][mask])
    assert batch["stat_kl_ref"].item() == 0.0  # the reference is the initial policy
    again = decode_batch(json.loads(json.dumps(encode_batch(batch))))
    assert all(torch.equal(again[k], v) for k, v in batch.items())


def test_the_stage_runs_logs_and_writes_a_run_the_loader_reads_as_its_policy(base_run, prompts_file, tmp_path):
    run = tmp_path / "run"
    ppo(str(base_run), str(prompts_file), run, _options(prompts_file, ppo_epochs=2),
        overrides={**FAST, "max_steps": 4, "lr": 1e-3, "sample_every": 4}, quiet=True)
    recs = [r for r in metrics_of(run) if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for key in ("reward_mean", "reward_std", "kl_ref", "clip_fraction", "value_clip_fraction",
                "explained_variance", "approx_kl", "policy_loss", "value_loss", "reply_len", "truncated"):
        assert all(key in r for r in recs), key
    assert [r["ppo_epoch"] for r in recs] == [0, 1, 0, 1]
    assert recs[0]["approx_kl"] == 0.0 and recs[0]["clip_fraction"] == 0.0  # first epoch: ratio exactly 1
    assert recs[1]["approx_kl"] > 0.0  # second epoch on the same rollout: the policy moved
    assert recs[2]["kl_ref"] != 0.0  # the second rollout's policy is not the reference any more
    assert "ppo" in (run / "report.md").read_text()
    assert (run / "samples.jsonl").is_file()
    # the checkpoint holds the policy's keys unchanged and the critic's under critic.; the loader reads the policy
    saved = ckpt.load_weights_file(ckpt.latest_checkpoint(run))
    assert any(k.startswith(CRITIC_PREFIX) for k in saved) and CRITIC_PREFIX == critic.CRITIC_PREFIX
    model, tok, _ = load_model(run)
    assert isinstance(model, GPT)
    assert not any(k.startswith(CRITIC_PREFIX) for k in init_weights(ckpt.latest_checkpoint(run)))  # a later --init
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict_for_save().items())
    assert not torch.equal(model.state_dict_for_save()["model.embed_tokens.weight"],
                           ckpt.load_weights_file(ckpt.latest_checkpoint(base_run))["model.embed_tokens.weight"])


def test_eval_and_chat_commands_load_a_ppo_run(base_run, prompts_file, tmp_path):
    ppo(str(base_run), str(prompts_file), tmp_path / "run", _options(prompts_file, beta=0.0),
        overrides={**FAST, "max_steps": 1, "lr": 1e-3}, quiet=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "nanoforge", "chat", str(tmp_path / "run"), "--max-new-tokens",
                           "4", "--device", "cpu"], input="1+2=\n", cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": f"{a}+1="},
                                                          {"role": "assistant", "content": str(a + 1)}]}) + "\n"
                            for a in range(4)))
    proc = subprocess.run([sys.executable, "-m", "nanoforge", "eval", str(tmp_path / "run"), "--data", str(held),
                           "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "loss" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_command_line_starts_and_continues_a_run_with_resume_auto(base_run, prompts_file, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "nanoforge", "ppo", "--init", str(base_run), "--data", str(prompts_file),
            "--out", str(tmp_path / "run"), "--resume", "auto", "--prompts-per-step", "2", "--max-new-tokens", "4",
            "--precision", "fp32", "--device", "cpu", "--tensorboard", "false", "--quiet"]
    for steps in (1, 2):
        proc = subprocess.run(args + ["--max-steps", str(steps)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"ppo finished at step {steps}" in proc.stdout
    assert [r["step"] for r in metrics_of(tmp_path / "run")] == [1, 2]


@pytest.mark.slow
def test_same_seed_same_weights_and_a_killed_run_resumes_bit_exactly(base_run, prompts_file, tmp_path):
    """Through the CLI, each run its own process, fp32 CPU: two runs of one command line are equal at step 3,
    policy and critic (the critic's head is drawn from --seed, not from the process's own RNG), and the second,
    killed right after saving step 3 and continued with --resume, ends equal to the first at step 6; with
    --ppo-epochs 2 the checkpoint at step 3 falls between a rollout's two epochs, so it carries the rollout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    line = [sys.executable, "-m", "nanoforge", "ppo", "--init", str(base_run), "--data", str(prompts_file),
            "--num-generations", "2", "--prompts-per-step", "2", "--max-new-tokens", "6", "--beta", "0.1",
            "--reward", f"math,{prompts_file.parent / 'myreward.py'}:tenth_chars", "--ppo-epochs", "2", "--lr", "1e-3",
            "--precision", "fp32", "--device", "cpu", "--tensorboard", "false", "--save-every", "3",
            "--keep-last", "5", "--max-steps", "6", "--quiet"]
    nf = lambda out, *more, **kw: subprocess.run(line + ["--out", str(tmp_path / out), *more], cwd=ROOT,
                                                 capture_output=True, text=True, timeout=300, **kw)
    assert nf("whole", env=env).returncode == 0
    killed = nf("half", env={**env, "NANOFORGE_INJECT_KILL": "0@3"})
    assert killed.returncode == -9 and ckpt.latest_checkpoint(tmp_path / "half").name == "step_000003"
    state = json.loads((tmp_path / "half" / "checkpoints" / "step_000003" / "state.json").read_text())
    assert "current" in state["data"]
    weights = lambda run, step: ckpt.load_weights_file(tmp_path / run / "checkpoints" / f"step_{step:06d}")
    a, b = weights("whole", 3), weights("half", 3)
    assert any(k.startswith("critic.head") for k in a) and all(torch.equal(a[k], b[k]) for k in a)
    resumed = nf("half", "--resume", env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = weights("whole", 6), weights("half", 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = ("reward_mean", "approx_kl", "explained_variance", "value_loss")
    assert [[r[k] for k in keys] for r in metrics_of(tmp_path / "whole")] == \
           [[r[k] for k in keys] for r in metrics_of(tmp_path / "half")]


def test_a_tiny_target_kl_stops_every_rollout_after_its_first_epoch(base_run, prompts_file, tmp_path):
    """--ppo-epochs 3 --target-kl 1e-12: after the first update the policy is further than that from the one
    that sampled, so every step samples a new rollout; without --target-kl the epochs go 0, 1, 2."""
    ppo(str(base_run), str(prompts_file), tmp_path / "stop", _options(prompts_file, ppo_epochs=3, target_kl=1e-12),
        overrides={**FAST, "max_steps": 4, "lr": 1e-3, "save_every": 2}, quiet=True)
    stop = metrics_of(tmp_path / "stop")
    assert [r["ppo_epoch"] for r in stop] == [0, 0, 0, 0]
    assert [r["early_stops"] for r in stop] == [0, 1, 2, 3]
    state = json.loads((tmp_path / "stop" / "checkpoints" / "step_000004" / "state.json").read_text())
    assert state["data"]["rollouts"] == 4 and state["data"]["prompts"]["cursor"] == 8
    ppo(str(base_run), str(prompts_file), tmp_path / "go", _options(prompts_file, ppo_epochs=3),
        overrides={**FAST, "max_steps": 4, "lr": 1e-3}, quiet=True)
    assert [r["ppo_epoch"] for r in metrics_of(tmp_path / "go")] == [0, 1, 2, 0]
    # a large target never stops
    ppo(str(base_run), str(prompts_file), tmp_path / "far", _options(prompts_file, ppo_epochs=3, target_kl=10.0),
        overrides={**FAST, "max_steps": 3, "lr": 1e-3}, quiet=True)
    assert [r["ppo_epoch"] for r in metrics_of(tmp_path / "far")] == [0, 1, 2]


def test_bad_inputs_are_clear_errors(base_run, prompts_file, tmp_path):
    with pytest.raises(NanoforgeError, match="--optimizer muon: not for ppo"):
        ppo(str(base_run), str(prompts_file), tmp_path / "a", _options(prompts_file),
            overrides={**FAST, "optimizer": "muon"})
    with pytest.raises(NanoforgeError, match="--init is required"):
        ppo(None, str(prompts_file), tmp_path / "b", _options(prompts_file))
    with pytest.raises(NanoforgeError, match="must divide the 4 replies"):
        ppo(str(base_run), str(prompts_file), tmp_path / "c", _options(prompts_file),
            overrides={**FAST, "grad_accum": 3})
    with pytest.raises(NanoforgeError, match="target_kl"):
        ppo(str(base_run), str(prompts_file), tmp_path / "d", _options(prompts_file, target_kl=-1.0), overrides=FAST)
    with pytest.raises(NanoforgeError, match="--ppo-epochs 0 must be >= 1"):
        ppo(str(base_run), str(prompts_file), tmp_path / "e", _options(prompts_file, ppo_epochs=0), overrides=FAST)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "nanoforge", "ppo", "--data", str(prompts_file), "--out",
                           str(tmp_path / "f")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().startswith("error: --init is required"), proc.stderr
    assert not any((tmp_path / n).exists() for n in "abcdef")  # nothing half-written


@pytest.mark.slow
def test_ppo_raises_the_reward_of_a_model_that_is_wrong_half_the_time(tmp_path):
    """benchmarks/grpo_arithmetic.py --algo ppo made small (sums of digits below 8), run as a user runs it
    (conftest.py arithmetic_reward_curve): each prompt SFT'd both
    right and with a systematic slip; PPO must raise the rollouts' mean reward clearly (a sign error in the
    advantages or a misaligned mask makes it fall instead). Each rollout is trained twice (--ppo-epochs 2), so
    the curve holds each mean twice: the first five rollouts (steps 1-10, 160 replies) against the last ten
    (steps 21-40, 320 replies)."""
    curve = arithmetic_reward_curve(tmp_path, "ppo", "--prompts-per-step", "32", "--lr", "1e-4")
    first, last = sum(curve[:10]) / 10, sum(curve[-20:]) / 20
    assert len(curve) == 40 and last > first + 0.15, curve


@pytest.mark.slow
def test_two_processes_roll_out_their_own_prompts_and_stop_early_together(base_run, prompts_file, tmp_path):
    """torchrun, 2 processes: each rank samples its own prompts; --target-kl's decision is the ranks' mean KL,
    so both skip the same epochs (a rank that went on alone would hang the next all-reduce)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    args = ["ppo", "--init", str(base_run), "--data", str(prompts_file), "--num-generations", "2",
            "--prompts-per-step", "2", "--max-new-tokens", "6", "--ppo-epochs", "3", "--target-kl", "1e-12",
            "--reward", f"math,{prompts_file.parent / 'myreward.py'}:tenth_chars", "--precision", "fp32", "--device",
            "cpu", "--tensorboard", "false", "--lr", "1e-3", "--quiet", "--out", str(tmp_path / "ddp"),
            "--max-steps", "2", "--save-every", "2"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m",
                "nanoforge"]
    proc = subprocess.run(launcher + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["ppo_epoch"] for r in metrics_of(tmp_path / "ddp")] == [0, 0]
    state = json.loads((tmp_path / "ddp" / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["data"]["prompts"]["cursor"] == 8 and state["data"]["rollouts"] == 2  # 2 x 2 prompts x 2 ranks
