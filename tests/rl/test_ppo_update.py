"""PPO's pieces: the critic beside the policy, reward shaping, GAE through the PPO path,
whitening, the loss, early stopping, and PPO updates that really move a tiny GPT and its critic."""
from __future__ import annotations

import pytest
import torch

from nanoforge.core.config import ModelConfig, build_config
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.gpt import GPT
from nanoforge.model.interface import TrainableModel
from nanoforge.rl.critic import CRITIC_PREFIX, PolicyWithValue, ValueModel, policy_weights
from nanoforge.rl.options import PPOOptions
from nanoforge.rl.ppo_update import (forward_ppo, place_scores, ppo_batch, ppo_count, ppo_loss, shaped_rewards,
                              should_stop_early, token_logprobs, whiten)
from nanoforge.weights import checkpoint as ckpt
from nanoforge.train.loop import train
from nanoforge.train.stage import Stage

TINY = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def tiny_gpt(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(**{**TINY, **kw}))


# ------------------------------------------------------------------------------------------------- the critic


@pytest.mark.parametrize("tie", [True, False])
def test_critic_starts_as_a_separate_copy_of_the_policy_trunk(tie):
    policy = tiny_gpt(tie_embeddings=tie)
    critic = ValueModel.from_policy(policy)
    trunk = critic.trunk.state_dict()
    expected = {k: v for k, v in policy.state_dict().items() if k != "lm_head.weight"}
    assert set(trunk) == set(expected)
    for k, v in expected.items():
        assert torch.equal(trunk[k], v), k
        assert trunk[k].data_ptr() != v.data_ptr(), f"{k} is shared with the policy"
    # its hidden states are the policy's: the policy's logits are exactly lm_head of the critic's trunk output
    ids = torch.randint(0, 32, (2, 7))
    torch.testing.assert_close(policy(ids), policy.lm_head(critic.trunk(ids)), rtol=0, atol=0)
    values = critic(ids)
    assert values.shape == (2, 7) and values.dtype == torch.float32
    assert values.abs().max() < 0.2  # the small head: values start near 0
    before = critic.trunk.model.layers[0].mlp.up_proj.weight.detach().clone()
    with torch.no_grad():  # moving the policy leaves the critic alone
        policy.model.layers[0].mlp.up_proj.weight.add_(1.0)
    assert torch.equal(critic.trunk.model.layers[0].mlp.up_proj.weight, before)


def test_gradients_reach_the_value_head_and_the_trunk_and_not_the_policy():
    model = PolicyWithValue.from_policy(tiny_gpt())
    ids = torch.randint(0, 32, (2, 6))
    _, values = model(ids)
    values.square().sum().backward()
    assert model.critic.head.weight.grad.abs().sum() > 0 and model.critic.head.bias.grad.abs().sum() > 0
    for name, p in model.critic.trunk.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in model.policy.parameters())


@pytest.mark.parametrize("tie", [True, False])
def test_policy_with_value_saves_and_loads_both_halves_strictly(tie):
    model = PolicyWithValue.from_policy(tiny_gpt(0, tie_embeddings=tie))
    with torch.no_grad():
        model.critic.head.bias.fill_(0.5)  # the critic differs from a fresh copy
    assert isinstance(model, TrainableModel)
    saved = model.state_dict_for_save()
    gpt_keys = set(model.policy.state_dict_for_save())
    assert set(policy_weights(saved)) == gpt_keys  # the policy's keys are a GPT checkpoint's, unprefixed
    assert {k for k in saved if k.startswith(CRITIC_PREFIX)} == {CRITIC_PREFIX + k for k in model.critic.state_dict()}

    other = PolicyWithValue.from_config(ModelConfig(**{**TINY, "tie_embeddings": tie}))
    ids = torch.randint(0, 32, (2, 5))
    assert not torch.equal(other(ids)[1], model(ids)[1])
    other.load_weights({k: v.clone() for k, v in saved.items()})
    for a, b in zip(model(ids), other(ids)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    plain = GPT(ModelConfig(**{**TINY, "tie_embeddings": tie}))
    plain.load_weights(policy_weights(saved))  # a PPO checkpoint's policy loads into a plain GPT
    torch.testing.assert_close(plain(ids), model.policy(ids), rtol=0, atol=0)
    with pytest.raises(NanoforgeError, match="no critic"):
        other.load_weights(policy_weights(saved))
    broken = dict(saved)
    del broken[CRITIC_PREFIX + "head.bias"]
    with pytest.raises(NanoforgeError, match="head.bias is missing"):
        other.load_weights(broken)


def test_policy_with_value_trains_saves_and_resumes_through_the_one_loop(tmp_path):
    """The real train() on a fixed PPO batch: the loop accepts the model, both halves move, and a resumed run
    equals an uninterrupted one bit for bit (the checkpoint round-trips policy and critic)."""
    batch = _toy_batch(PolicyWithValue.from_policy(tiny_gpt()), PPOOptions())[0]

    class Fixed:
        def next_batch(self):
            return dict(batch)

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    cfg = PPOOptions()

    def run(out, steps, resume=False):
        model = PolicyWithValue.from_policy(tiny_gpt())
        # a constant lr: a 2-step run's cosine would end where a 4-step run's is still at its peak
        mcfg, tcfg = build_config(None, None, {**TINY, "seq_len": 8, "batch_size": 2, "max_steps": steps,
                                               "lr": 1e-3, "warmup_steps": 0, "schedule": "constant",
                                               "precision": "fp32", "device": "cpu", "tensorboard": False,
                                               "save_every": 2, "log_every": 1, "eval_every": 0})
        stage = Stage("ppo", Fixed(), lambda m, b: ppo_loss(m, b, cfg), count_fn=ppo_count)
        train(stage, model, mcfg, tcfg, out, resume=resume, quiet=True)
        return model

    start = PolicyWithValue.from_policy(tiny_gpt()).state_dict_for_save()
    full = run(tmp_path / "full", 4).state_dict_for_save()
    run(tmp_path / "half", 2)
    resumed = run(tmp_path / "half", 4, resume=True).state_dict_for_save()
    assert not torch.equal(full["critic.head.weight"], start["critic.head.weight"])
    assert not torch.equal(full["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    on_disk = ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / "full"))
    assert set(on_disk) == set(full)


# --------------------------------------------------------------------------------------------- reward shaping


def test_the_score_sits_on_each_rows_last_masked_token():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0],   # a reply then padding
                         [0, 1, 1, 0, 1, 0],   # two replies with a tool result between: the last one's end
                         [0, 0, 0, 0, 0, 1],   # the reply's token is the row's last position
                         [0, 0, 0, 0, 0, 0]])  # nothing sampled: no reward anywhere
    scores = torch.tensor([2.0, -1.0, 0.5, 3.0])
    expected = torch.tensor([[0, 0, 0, 0, 2.0, 0], [0, 0, 0, 0, -1.0, 0], [0, 0, 0, 0, 0, 0.5], [0] * 6])
    assert torch.equal(place_scores(scores, mask), expected)


def test_the_kl_penalty_is_zero_when_old_equals_ref_and_minus_beta_log_ratio_otherwise():
    mask = torch.tensor([[0, 1, 1, 1]])
    scores = torch.tensor([1.0])
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    placed = place_scores(scores, mask)
    assert torch.equal(shaped_rewards(scores, mask, old, old.clone(), beta=0.1), placed)
    assert torch.equal(shaped_rewards(scores, mask, old, None, beta=0.1), placed)
    ref = torch.tensor([[-9.0, -1.5, -1.0, -0.5]])  # position 0 is prompt: its log-ratio must not count
    expected = torch.tensor([[0.0, -0.1 * 0.5, -0.1 * -1.0, 1.0]])
    torch.testing.assert_close(shaped_rewards(scores, mask, old, ref, beta=0.1), expected)


def test_gae_through_ppo_batch_matches_a_hand_computed_case():
    # one row: prompt, three reply tokens, padding; score 1 on the last reply token; beta 0.5 with a reference
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    old_logp = torch.tensor([[0.0, -1.0, -1.0, -1.0, 0.0]])
    ref_logp = torch.tensor([[0.0, -1.0, -1.2, -1.0, 0.0]])  # token 2's log-ratio 0.2 -> reward -0.1
    values = torch.tensor([[9.0, 0.5, 0.4, 0.8, 9.0]])  # unmasked values never enter
    cfg = PPOOptions(beta=0.5, gamma=1.0, lam=0.95)
    batch, stats = ppo_batch(torch.zeros(1, 5, dtype=torch.long), mask, old_logp, values, torch.tensor([1.0]),
                             cfg, ref_logp=ref_logp, whitened=False)
    # r = (0, -0.1, 1); deltas: d3 = 1 - 0.8 = 0.2, d2 = -0.1 + 0.8 - 0.4 = 0.3, d1 = 0 + 0.4 - 0.5 = -0.1
    a3 = 0.2
    a2 = 0.3 + 0.95 * a3
    a1 = -0.1 + 0.95 * a2
    torch.testing.assert_close(batch["advantages"], torch.tensor([[0, a1, a2, a3, 0]]))
    torch.testing.assert_close(batch["returns"], torch.tensor([[0, a1 + 0.5, a2 + 0.4, a3 + 0.8, 0]]))
    assert stats["kl_ref"] == pytest.approx(0.2 / 3)


def test_whitened_advantages_have_zero_mean_and_unit_std_over_masked_tokens_only():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=g) * 5 + 3
    mask = torch.rand(3, 8, generator=g) > 0.4
    w = whiten(x, mask)
    assert torch.equal(w[~mask], torch.zeros(int((~mask).sum())))
    assert w[mask].mean().abs() < 1e-6
    assert w[mask].std(unbiased=False) == pytest.approx(1.0, abs=1e-5)
    # through ppo_batch: whitening is on by default, and the returns are not whitened
    vals = torch.randn(3, 8, generator=g)
    batch, _ = ppo_batch(torch.zeros(3, 8, dtype=torch.long), mask, torch.zeros(3, 8), vals,
                         torch.tensor([1.0, 5.0, -2.0]), PPOOptions())
    raw, _ = ppo_batch(torch.zeros(3, 8, dtype=torch.long), mask, torch.zeros(3, 8), vals,
                       torch.tensor([1.0, 5.0, -2.0]), PPOOptions(), whitened=False)
    torch.testing.assert_close(batch["advantages"], whiten(raw["advantages"], mask))
    torch.testing.assert_close(batch["returns"], raw["returns"])


# ----------------------------------------------------------------------------------------------------- the loss


def test_logprobs_and_values_are_aligned_with_the_tokens_they_belong_to():
    """Entry t: log p(ids[t] | ids[:t]) at the temperature, and V(ids[:t]) read at position t - 1; 0 at t = 0."""
    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(2, 4, 32, generator=g), torch.randint(0, 32, (2, 4), generator=g)
    lp = token_logprobs(logits, ids, temperature=0.7)
    assert torch.equal(lp[:, 0], torch.zeros(2))
    torch.testing.assert_close(lp[1, 3], torch.log_softmax(logits[1, 2] / 0.7, -1)[ids[1, 3]])
    model = PolicyWithValue.from_policy(tiny_gpt())
    with torch.no_grad():
        logp, values = forward_ppo(model, ids, temperature=0.7)
        torch.testing.assert_close(logp, token_logprobs(model.policy(ids), ids, 0.7), rtol=0, atol=0)
        per_position = model.critic(ids)  # (2, 4)
    assert torch.equal(values[:, 0], torch.zeros(2)) and torch.equal(values[:, 1:], per_position[:, :-1])


def test_fresh_batch_loss_has_ratio_one_no_clipping_and_counts_masked_tokens():
    model = PolicyWithValue.from_policy(tiny_gpt())
    cfg = PPOOptions()
    batch, _ = _toy_batch(model, cfg)
    loss_sum, count, extras = ppo_loss(model, batch, cfg)
    assert count == batch["mask"].sum() == ppo_count(batch)
    assert extras["approx_kl"] == pytest.approx(0.0, abs=1e-6) and extras["ratio"] == pytest.approx(1.0)
    assert extras["clip_fraction"] == 0 and extras["value_clip_fraction"] == 0
    expected = extras["policy_loss"] + cfg.vf_coef * extras["value_loss"]
    assert (loss_sum / count).item() == pytest.approx(expected.item(), rel=1e-5)


def test_early_stop_triggers_only_when_approx_kl_exceeds_the_target():
    assert should_stop_early(0.03, 0.02) and should_stop_early(torch.tensor(0.5), 0.02)
    assert not should_stop_early(0.01, 0.02) and not should_stop_early(0.02, 0.02)
    assert not should_stop_early(10.0, None)
    with pytest.raises(NanoforgeError, match="target_kl"):
        PPOOptions(target_kl=0.0).validate()


def test_ppo_updates_raise_the_rewarded_reply_and_pull_values_toward_the_returns():
    """Rollouts of one prompt, one reply scored +1 and the other -1, trained by PPO's own path (forward_ppo
    under no_grad for the old quantities, ppo_batch, two epochs of ppo_loss per batch): the rewarded reply's
    log-prob rises, the other's falls, and the critic's error against the batch's returns shrinks. A sign
    error in the advantages, the ratio or the value loss drives one of them the other way."""
    model = PolicyWithValue.from_policy(tiny_gpt(1))
    cfg = PPOOptions(beta=0.0)
    ref = tiny_gpt(1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(8):
        batch, _ = _toy_batch(model, cfg, ref=ref)
        if first is None:
            first = batch
        for _ in range(2):
            loss_sum, count, extras = ppo_loss(model, batch, cfg)
            opt.zero_grad()
            (loss_sum / count).backward()
            opt.step()
            if should_stop_early(extras["approx_kl"], 0.5):
                break
    with torch.no_grad():
        logp0, values0 = first["old_logp"], first["old_values"]
        logp1, values1 = forward_ppo(model, first["input_ids"])
    m = first["mask"]
    seq = lambda lp: (lp * m).sum(dim=1)  # noqa: E731  (B,) log-prob of each reply
    assert seq(logp1)[0] > seq(logp0)[0] + 1.0  # rewarded: more likely
    assert seq(logp1)[1] < seq(logp0)[1] - 1.0  # punished: less likely
    # The critic, on the states after each reply's first token (the first one's state is the shared prompt,
    # whose returns, +0.9 and -0.95, no value can fit both): its error against the returns shrinks (measured
    # 0.93 -> 0.01), and it reads the signs (values near +1 on the rewarded reply, -1 on the other).
    later = m.clone()
    later[:, 3] = False
    target = first["returns"]
    err0, err1 = ((values0 - target)[later] ** 2).mean(), ((values1 - target)[later] ** 2).mean()
    assert err1 < 0.25 * err0
    assert values1[0][later[0]].min() > 0.5 and values1[1][later[1]].max() < -0.5


def _toy_batch(model: PolicyWithValue, cfg: PPOOptions, ref: GPT | None = None):
    """Two rollouts of prompt [1, 2, 3]: reply [5, 6, 7] scored +1, reply [8, 9] (then padding) scored -1."""
    ids = torch.tensor([[1, 2, 3, 5, 6, 7], [1, 2, 3, 8, 9, 0]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 0]], dtype=torch.bool)
    with torch.no_grad():
        old_logp, old_values = forward_ppo(model, ids, cfg.temperature)
        ref_logp = token_logprobs(ref(ids), ids, cfg.temperature) if ref is not None else None
    return ppo_batch(ids, mask, old_logp, old_values, torch.tensor([1.0, -1.0]), cfg, ref_logp=ref_logp)
