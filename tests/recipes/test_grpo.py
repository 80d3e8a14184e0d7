"""`nanoforge grpo`: rollouts (ids, masks, old and reference log-probs), the stage on the one loop (exact resume,
the reference skipped at beta 0, torchrun), bad inputs, GSM8K, and that it learns (arithmetic)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import arithmetic_reward_curve, metrics_of
from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.generate import Completion
from nanoforge.recipes.grpo import RLOptions, grpo
from nanoforge.rl.losses import policy_loss
from nanoforge.rl.rewards import combine, parse_rewards
from nanoforge.rl.prompts import PromptIterator, read_prompts
from nanoforge.model.prefix import prefix_token_logps
from nanoforge.rl.rollout import frozen_logps, pack, rollout
from nanoforge.rl.grpo_batches import RolloutBatches, decode_batch, encode_batch, policy_objective
from nanoforge.weights import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
FAST = {"precision": "fp32", "tensorboard": False, "save_every": 0, "device": "cpu"}


def _options(prompts_file, **kw):
    return RLOptions(**{"num_generations": 3, "prompts_per_step": 2, "max_new_tokens": 6,
                        "reward": f"math,{prompts_file.parent / 'myreward.py'}:chars", **kw})


def test_pack_trains_the_stop_token_of_a_stopped_reply_and_none_of_a_cut_one():
    prompts = [[5, 6, 7], [5, 6]]
    replies = [Completion("", [10, 11], "stop", stop_id=99), Completion("", [12, 13, 14], "length")]
    ids, mask = pack(prompts, replies, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 10, 11, 99], [5, 6, 12, 13, 14, 0]]
    # mask[t] is for target ids[t + 1]: the reply's tokens and, when it stopped, its stop token
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 1, 0]]


def _rollout(base_run, prompts_file, tiny_tokenizer, G=3, reference=True):
    from nanoforge.weights.load import load_model
    model, tok, _ = load_model(base_run)
    ref = load_model(base_run)[0] if reference else None
    records = read_prompts(prompts_file)[:2]
    cfg = RLOptions(num_generations=G, temperature=0.9, max_new_tokens=6)
    batch = rollout(model, tok, records, cfg, combine(parse_rewards("math,length")), seed=1, reference=ref)
    return model, tok, batch


def test_rollout_layout_masks_and_old_logps_equal_a_fresh_forward(base_run, prompts_file, tiny_tokenizer):
    model, tok, batch = _rollout(base_run, prompts_file, tiny_tokenizer)
    ids, mask = batch["input_ids"], batch["loss_mask"]
    B, L = ids.shape
    assert B == 6 and mask.shape == batch["ref_logp"].shape == (B, L - 1) and "old_logp" not in batch
    assert batch["advantages"].shape == batch["rewards"].shape == (B,)
    for row, m in zip(ids, mask):  # a reply whose last trained token is <|im_end|> stopped; else it ran to 6 tokens
        trained = row[1:][m.bool()].tolist()
        assert 1 <= len(trained) <= 7
        assert trained[-1] == tok.im_end_id or len(trained) == 6
        assert tok.im_end_id not in trained[:-1]
    # the policy's forward (train mode, with grad) gives exactly the reference's (the initial policy's) log-probs
    model.train()
    logp = prefix_token_logps(model, ids, mask, 0.9)
    m = mask.bool()
    assert torch.equal(logp.detach()[m], batch["ref_logp"][m])
    _, _, extras = policy_loss(logp, logp.detach(), batch["advantages"], mask, ref_logp=batch["ref_logp"])
    assert extras["ratio"].item() == 1.0 and extras["clip_fraction"].item() == 0.0 and extras["kl"].item() == 0.0
    # sampled at temperature 0.9: the log-probs at temperature 1 differ
    assert not torch.equal(prefix_token_logps(model, ids, mask, 1.0).detach()[m], batch["ref_logp"][m])
    # groups: advantages sum to ~0 per group, and are 0 in a group of equal rewards
    for g in range(2):
        adv, r = batch["advantages"][3 * g:3 * g + 3], batch["rewards"][3 * g:3 * g + 3]
        assert abs(adv.sum().item()) < 1e-4
        if r.max() == r.min():
            assert adv.abs().max().item() == 0.0
    # a checkpointed rollout comes back bit for bit
    again = decode_batch(json.loads(json.dumps(encode_batch(batch))))
    assert all(torch.equal(again[k], v) for k, v in batch.items())


def test_the_first_updates_log_probs_are_the_old_ones_a_separate_forward_gives(base_run, prompts_file):
    """--ppo-epochs 2, --grad-accum 2: the first update's micro-batches carry no old log-probs; the loss keeps
    its own, which equal a no-grad eval-mode forward of the sampling policy (the separate pass they replace),
    and the second update trains against them."""
    from nanoforge.weights.load import load_model
    model, tok, _ = load_model(base_run)
    cfg = RLOptions(num_generations=3, temperature=0.9, max_new_tokens=6)
    batches = RolloutBatches(model, tok, PromptIterator(read_prompts(prompts_file), 2, seed=0), cfg,
                             combine(parse_rewards("math,length")), seed=1, ppo_epochs=2, grad_accum=2)
    loss = policy_objective("grpo", 0.2, None, 0.0, "sequence", 0.9, batches)
    model.train()
    for _ in range(2):
        micro = batches.next_batch()
        assert "old_logp" not in micro
        assert loss(model, micro)[2]["ratio"].item() == 1.0
    separate = frozen_logps(model, batches.current["input_ids"], batches.current["loss_mask"], 0.9, "fp32", chunk=3)
    assert torch.equal(batches.current["old_logp"], separate)
    assert torch.equal(batches.next_batch()["old_logp"], separate[:3])
    assert "current" in batches.state_dict()  # and the checkpoint between the two updates holds them


def test_beta_zero_skips_the_reference_and_beta_logs_kl(base_run, prompts_file, tmp_path):
    grpo(str(base_run), str(prompts_file), tmp_path / "nokl", _options(prompts_file, beta=0.0), overrides={**FAST, "max_steps": 2,
                                                                                            "lr": 1e-3}, quiet=True)
    grpo(str(base_run), str(prompts_file), tmp_path / "kl", _options(prompts_file, beta=0.1, ppo_epochs=2),
         overrides={**FAST, "max_steps": 2, "lr": 1e-3, "sample_every": 2}, quiet=True)
    # samples through the chat template and the report, as every stage writes them
    assert [json.loads(line)["step"] for line in (tmp_path / "kl" / "samples.jsonl").read_text().splitlines()][0] == 2
    assert "grpo" in (tmp_path / "kl" / "report.md").read_text()
    nokl, kl = metrics_of(tmp_path / "nokl"), metrics_of(tmp_path / "kl")
    assert all("kl" not in r for r in nokl) and all("reward_mean" in r and "truncated" in r for r in nokl)
    assert kl[0]["kl"] == 0.0 and kl[0]["ratio"] == 1.0  # first step: policy == reference == sampler
    assert kl[1]["kl"] > 0.0 and kl[1]["ratio"] != 1.0  # second epoch on the same rollout: the policy moved
    # with micro-batches too: old log-probs are computed in the loss's chunks, so the first ratio is exactly 1
    grpo(str(base_run), str(prompts_file), tmp_path / "accum", _options(prompts_file, beta=0.1),
         overrides={**FAST, "max_steps": 1, "lr": 1e-3, "grad_accum": 2}, quiet=True)
    first = metrics_of(tmp_path / "accum")[0]
    assert first["ratio"] == 1.0 and first["kl"] == 0.0 and first["clip_fraction"] == 0.0


def test_resume_is_bit_exact_also_in_the_middle_of_a_rollouts_epochs(base_run, prompts_file, tmp_path):
    """fp32 CPU: 3 steps, then 3 more from the checkpoint, equal 6 uninterrupted; with --ppo-epochs 2 the
    checkpoint at step 3 falls between a rollout's two steps, so it must carry that rollout."""
    options = _options(prompts_file, beta=0.1, ppo_epochs=2, loss="cispo")
    common = {**FAST, "lr": 1e-3, "save_every": 3, "keep_last": 5}
    grpo(str(base_run), str(prompts_file), tmp_path / "whole", options, overrides={**common, "max_steps": 6},
         quiet=True)
    grpo(str(base_run), str(prompts_file), tmp_path / "half", options, overrides={**common, "max_steps": 3},
         quiet=True)
    state = json.loads((tmp_path / "half" / "checkpoints" / "step_000003" / "state.json").read_text())
    assert "current" in state["data"]  # mid-rollout: the rollout is in the checkpoint
    grpo(None, None, tmp_path / "half", overrides={"max_steps": 6}, resume=True, quiet=True)
    a = ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / "whole"))
    b = ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / "half"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    whole = [r["reward_mean"] for r in metrics_of(tmp_path / "whole")]
    half = [r["reward_mean"] for r in metrics_of(tmp_path / "half")]
    assert whole == half


def test_epochs_count_every_prompt_once_per_epoch(base_run, prompts_file, tmp_path):
    """--epochs 1 with 12 prompts, 2 per step, 2 updates per rollout: 6 rollouts, 12 steps."""
    summary = grpo(str(base_run), str(prompts_file), tmp_path / "run", _options(prompts_file, ppo_epochs=2),
                   overrides={**FAST, "epochs": 1.0, "lr": 1e-4}, quiet=True)
    assert summary["step"] == 12
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000012" / "state.json").read_text())
    assert state["data"]["prompts"] == {**state["data"]["prompts"], "epoch": 1, "cursor": 0}


def test_a_local_reward_model_scores_the_replies(base_run, prompts_file, tiny_tokenizer, tmp_path):
    """--reward-model alone: a tiny local HF sequence-classification model's score is the reward."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "rm"
    tiny_tokenizer.save(directory)
    config = transformers.LlamaConfig(vocab_size=tiny_tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, num_labels=1)
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(config).save_pretrained(directory)
    options = RLOptions(num_generations=3, prompts_per_step=2, max_new_tokens=6, reward_model=str(directory))
    grpo(str(base_run), str(prompts_file), tmp_path / "run", options, overrides={**FAST, "max_steps": 2, "lr": 1e-4},
         quiet=True)
    recs = metrics_of(tmp_path / "run")
    assert all(r["reward_model"] == pytest.approx(r["reward_mean"], abs=1e-6) and r["reward_std"] > 0 for r in recs)
    assert "reward_math" not in recs[0]


def test_bad_inputs_are_clear_errors(base_run, prompts_file, tmp_path):
    with pytest.raises(NanoforgeError, match="--init is required"):
        grpo(None, str(prompts_file), tmp_path / "a", _options(prompts_file, ))
    with pytest.raises(NanoforgeError, match="unknown reward 'nope'"):
        grpo(str(base_run), str(prompts_file), tmp_path / "b", _options(prompts_file, reward="math,nope"), overrides=FAST)
    with pytest.raises(NanoforgeError, match="must divide the 6 replies"):
        grpo(str(base_run), str(prompts_file), tmp_path / "c", _options(prompts_file, ), overrides={**FAST, "grad_accum": 4})
    with pytest.raises(NanoforgeError, match="a group needs at least 2"):
        grpo(str(base_run), str(prompts_file), tmp_path / "d", _options(prompts_file, num_generations=1), overrides=FAST)
    with pytest.raises(NanoforgeError, match="13 prompts|12 prompts, but one step takes 13"):
        grpo(str(base_run), str(prompts_file), tmp_path / "e", _options(prompts_file, prompts_per_step=13), overrides=FAST)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"question": " ".join(map(str, range(1500))), "answer": "1"}) + "\n" +
                    json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(NanoforgeError, match=r"long.jsonl:1: renders to \d+ tokens, but the model sees at most"):
        grpo(str(base_run), str(long), tmp_path / "g", _options(long.parent / "x.jsonl", prompts_per_step=2,
                                                                 reward="math"), overrides=FAST)
    assert not any((tmp_path / n).exists() for n in "abcdeg")  # nothing half-written


def test_the_command_line_reports_a_bad_input_in_one_line(prompts_file, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "nanoforge", "grpo", "--data", str(prompts_file), "--out",
                           str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().startswith("error: --init is required"), proc.stderr


@pytest.mark.slow
def test_a_reward_that_raises_mid_run_is_named_and_resume_continues(base_run, prompts_file, tmp_path):
    """The run stops with the reward, the prompt record and the exception; --resume then carries on."""
    reward = tmp_path / "flaky.py"
    reward.write_text("import os\ndef f(completion, record):\n    if os.environ.get('FLAKY_REWARD_FAILS'):\n"
                      "        raise KeyError('no luck')\n    return len(completion)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    common = ["--out", tmp_path / "run", "--save-every", "1", "--device", "cpu", "--tensorboard", "false", "--quiet"]

    def nf(*args, fails=False):
        return subprocess.run([sys.executable, "-m", "nanoforge", "grpo", *map(str, args), *map(str, common)],
                              cwd=ROOT, env={**env, **({"FLAKY_REWARD_FAILS": "1"} if fails else {})},
                              capture_output=True, text=True, timeout=300)
    r = nf("--init", base_run, "--data", prompts_file, "--reward", f"{reward}:f", "--num-generations", 2,
           "--max-new-tokens", 4, "--max-steps", 2)
    assert r.returncode == 0, r.stderr
    r = nf("--resume", "--max-steps", 4, fails=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"error: reward '{reward}:f' failed on the prompt at {prompts_file}:" in r.stderr
    assert "KeyError: 'no luck'" in r.stderr
    r = nf("--resume", "--max-steps", 4)
    assert r.returncode == 0, r.stderr
    assert [m["step"] for m in metrics_of(tmp_path / "run") if "reward_mean" in m] == [1, 2, 3, 4]


def test_gsm8k_run_starts_logs_rewards_and_resumes_bit_exactly(base_run, shared_data, tmp_path):
    data = shared_data / "gsm8k" / "test.jsonl"
    if not data.is_file():
        pytest.skip(f"{data} is absent")
    options = RLOptions(num_generations=3, prompts_per_step=2, max_new_tokens=6, reward="math,format,repetition",
                        ppo_epochs=2)
    common = {**FAST, "lr": 1e-4, "save_every": 3, "keep_last": 5}
    grpo(str(base_run), str(data), tmp_path / "whole", options, overrides={**common, "max_steps": 6}, quiet=True)
    recs = metrics_of(tmp_path / "whole")
    assert [r["step"] for r in recs if "reward_mean" in r] == [1, 2, 3, 4, 5, 6]
    assert all("reward_math" in r and "reward_format" in r and "rollout_tokens_per_s" in r for r in recs)
    grpo(str(base_run), str(data), tmp_path / "half", options, overrides={**common, "max_steps": 3}, quiet=True)
    grpo(None, None, tmp_path / "half", overrides={"max_steps": 6}, resume=True, quiet=True)
    a = ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / "whole"))
    b = ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / "half"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_grpo_raises_the_reward_of_a_model_that_is_wrong_half_the_time(tmp_path):
    """benchmarks/grpo_arithmetic.py made small (sums of digits below 8), run as a user runs it: each prompt SFT'd
    both right and with a systematic slip; 40 GRPO steps must raise the rollouts' mean reward clearly (the last
    ten steps' over the first five; a sign error or a misaligned mask makes it fall instead)."""
    curve = arithmetic_reward_curve(tmp_path, "grpo", "--lr", "1e-4")
    first, last = sum(curve[:5]) / 5, sum(curve[-10:]) / 10
    assert len(curve) == 40 and last > first + 0.15, curve


@pytest.mark.slow
def test_two_processes_roll_out_their_own_prompts(base_run, prompts_file, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    args = ["grpo", "--init", str(base_run), "--data", str(prompts_file), "--num-generations", "3",
            "--prompts-per-step", "2", "--max-new-tokens", "6", "--ppo-epochs", "2",
            "--reward", f"math,{prompts_file.parent / 'myreward.py'}:chars",
            "--precision", "fp32", "--device", "cpu", "--tensorboard", "false", "--lr", "1e-3", "--quiet"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m",
                "nanoforge"]
    proc = subprocess.run(launcher + args + ["--out", str(tmp_path / "ddp"), "--max-steps", "3", "--save-every", "3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads((tmp_path / "ddp" / "checkpoints" / "step_000003" / "state.json").read_text())
    assert len(state["data"]["current"]) == 2  # each rank's rollout, gathered into the checkpoint
    assert all("old_logp" in rollout for rollout in state["data"]["current"])  # with its first update's log-probs
    assert state["data"]["prompts"]["cursor"] == 8  # 2 rollouts x 2 prompts x 2 ranks
    proc = subprocess.run(launcher + ["grpo", "--out", str(tmp_path / "ddp"), "--resume", "--max-steps", "4",
                                      "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in metrics_of(tmp_path / "ddp") if "reward_mean" in r] == [1, 2, 3, 4]
