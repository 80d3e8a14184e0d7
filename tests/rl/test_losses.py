"""The mathematics of the RL losses, unit by unit, on small hand-made tensors."""
from __future__ import annotations

import math

import pytest
import torch

from nanoforge.rl.losses import (approx_kl, gae, group_advantages, kl_k3, loss_count, normalise, policy_loss,
                                 value_loss)


def _grad(loss: str, logp: torch.Tensor, old_logp: torch.Tensor, adv, mask, **kw) -> torch.Tensor:
    """d(sum / count)/d logp of one policy loss."""
    logp = logp.clone().requires_grad_(True)
    loss_sum, count, _ = policy_loss(logp, old_logp, adv, mask, loss=loss, **kw)
    (loss_sum / count).backward()
    return logp.grad


# ------------------------------------------------------------------------------------------- advantages


def test_constant_group_has_exactly_zero_advantage():
    rewards = torch.tensor([[0.1] * 6, [1.0, 0.0, 1.0, 0.0, 1.0, 1.0], [7.3] * 6])
    for mode in ("zscore", "mean"):
        adv = group_advantages(rewards, mode=mode)
        assert torch.equal(adv[0], torch.zeros(6)) and torch.equal(adv[2], torch.zeros(6))
        assert adv[1].abs().min() > 0  # a group with different rewards does get advantages
    assert torch.equal(group_advantages(torch.tensor([[3.0]])), torch.zeros(1, 1))  # one reply: nothing to compare


def test_zscore_uses_the_unbiased_std_and_mean_mode_only_centres():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    mean, std = 0.25, math.sqrt((0.75**2 + 3 * 0.25**2) / 3)  # unbiased: divide by N - 1 = 3
    expected = torch.tensor([[0.75, -0.25, -0.25, -0.25]]) / (std + 1e-4)
    assert torch.allclose(group_advantages(rewards, "zscore"), expected, atol=1e-6)
    assert torch.allclose(group_advantages(rewards, "mean"), rewards - mean)


# ------------------------------------------------------------------------------------------- KL


def test_k3_kl_is_zero_when_policy_equals_reference_and_positive_otherwise():
    logp = torch.tensor([[-0.5, -2.0, -0.1]])
    assert torch.equal(kl_k3(logp, logp.clone()), torch.zeros(1, 3))
    other = logp + torch.tensor([[0.3, -0.7, 0.01]])
    assert (kl_k3(logp, other) > 0).all()
    mask = torch.ones(1, 3)
    _, _, extras = policy_loss(logp, logp, torch.ones(1), mask, ref_logp=logp.clone(), beta=0.1)
    assert extras["kl"] == 0
    _, _, extras = policy_loss(logp, logp, torch.ones(1), mask, ref_logp=other, beta=0.1)
    assert extras["kl"] > 0


def test_beta_adds_the_kl_gradient_and_beta_zero_does_not():
    logp, ref = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -0.5]])
    mask, adv = torch.ones(1, 2), torch.zeros(1)  # zero advantage: only the KL term can move logp
    assert torch.equal(_grad("grpo", logp, logp, adv, mask, ref_logp=ref, beta=0.0), torch.zeros(1, 2))
    grad = _grad("grpo", logp, logp, adv, mask, ref_logp=ref, beta=0.5)
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp); the sequence mean halves it
    expected = 0.5 * (1 - torch.exp(ref - logp)) / 2
    assert torch.allclose(grad, expected)


# ------------------------------------------------------------------------------------------- policy losses


def test_at_ratio_one_grpo_cispo_and_reinforce_gradients_agree():
    torch.manual_seed(0)
    logp = -torch.rand(3, 5) * 3
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    adv = torch.tensor([1.5, -0.7, 0.3])
    grads = {loss: _grad(loss, logp, logp.detach(), adv, mask) for loss in ("grpo", "cispo", "reinforce")}
    assert torch.allclose(grads["grpo"], grads["cispo"]) and torch.allclose(grads["grpo"], grads["reinforce"])
    # and it is -A / (tokens of the sequence) / sequences on every masked token
    lengths = mask.sum(1, keepdim=True)
    assert torch.allclose(grads["grpo"], -adv[:, None] * mask / lengths / 3)


def test_grpo_clips_a_token_past_one_plus_epsilon_and_cispo_does_not():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    logp = old + torch.tensor([[0.0, math.log(1.5), math.log(0.5)]])  # ratios 1, 1.5, 0.5
    mask, adv = torch.ones(1, 3), torch.tensor([2.0])
    grpo = _grad("grpo", logp, old, adv, mask, epsilon=0.2)
    cispo = _grad("cispo", logp, old, adv, mask)
    assert grpo[0, 1] == 0 and cispo[0, 1] != 0  # ratio 1.5 > 1.2 with A > 0
    assert grpo[0, 0] != 0  # inside the trust region
    assert grpo[0, 2] != 0  # ratio 0.5 < 0.8 with A > 0: pushing up is allowed
    assert torch.allclose(cispo[0, 1], torch.tensor(-1.5 * 2.0 / 3))  # the weight, not the gradient, is kept
    _, _, extras = policy_loss(logp, old, adv, mask, loss="grpo", epsilon=0.2)
    assert torch.allclose(extras["clip_fraction"], torch.tensor(1 / 3))
    assert torch.allclose(extras["ratio"], torch.tensor(1.0))
    # epsilon_high widens only the top: ratio 1.5 is inside [0.8, 1.6]
    assert _grad("grpo", logp, old, adv, mask, epsilon=0.2, epsilon_high=0.6)[0, 1] != 0
    # with A < 0 it is the low side that clips
    neg = _grad("grpo", logp, old, -adv, mask, epsilon=0.2)
    assert neg[0, 2] == 0 and neg[0, 1] != 0


def test_cispo_caps_the_importance_weight():
    old = torch.zeros(1, 2) - 2.0
    logp = old + torch.tensor([[math.log(10.0), 0.0]])  # ratio 10 > cispo_max 5
    grad = _grad("cispo", logp, old, torch.ones(1), torch.ones(1, 2), cispo_max=5.0, norm="token")
    assert torch.allclose(grad, torch.tensor([[-5.0 / 2, -1.0 / 2]]))
    _, _, extras = policy_loss(logp, old, torch.ones(1), torch.ones(1, 2), loss="cispo")
    assert extras["clip_fraction"] == 0.5


def test_token_and_sequence_normalisation_differ_on_unequal_lengths():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    s, n = normalise(per_token, mask, "token")
    assert (s.item(), n.item()) == (7.0, 5)  # 7/5: the long sequence weighs 4 of 5
    s, n = normalise(per_token, mask, "sequence")
    assert (s.item(), n.item()) == (4.0, 2)  # (1 + 3) / 2: each sequence weighs alike
    assert loss_count(mask, "token") == 5 and loss_count(mask, "sequence") == 2  # a stage's count_fn agrees
    with pytest.raises(ValueError, match="not one of"):
        normalise(per_token, mask, "tokens")
    # an empty sequence neither adds nor dilutes
    s, n = normalise(torch.ones(3, 2), torch.tensor([[1, 1], [0, 0], [1, 0]]), "sequence")
    assert (s.item(), n.item()) == (2.0, 2)
    # through policy_loss: a token of the short sequence gets 4x the gradient of one of the long one
    logp = torch.full((2, 4), -1.0)
    grad = _grad("reinforce", logp, logp, torch.ones(2), mask, norm="sequence")
    assert torch.allclose(grad[1, 0] / grad[0, 0], torch.tensor(4.0))
    grad = _grad("reinforce", logp, logp, torch.ones(2), mask, norm="token")
    assert torch.allclose(grad[1, 0] / grad[0, 0], torch.tensor(1.0))


@pytest.mark.parametrize("loss", ["grpo", "cispo", "reinforce"])
def test_masked_tokens_never_get_gradient(loss):
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    old = torch.full((2, 4), -1.0)
    old[mask == 0] = -1e4  # an absurd ratio exp(1e4) = inf on the masked positions
    logp = torch.full((2, 4), -0.5)
    logp[0, 3] = float("inf")
    ref = torch.full((2, 4), -0.7)
    grad = _grad(loss, logp, old, torch.tensor([1.0, -1.0]), mask, ref_logp=ref, beta=0.1)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert (grad[mask == 1] != 0).all()
    # per-token advantages (PPO) work the same way
    grad = _grad(loss, logp, old, torch.ones(2, 4), mask, norm="token")
    assert torch.equal(grad[mask == 0], torch.zeros(int((mask == 0).sum())))


# ------------------------------------------------------------------------------------------- PPO pieces


def test_gae_against_hand_computed_values():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 0.8]])
    mask = torch.ones(1, 4)
    # gamma 1, lambda 0.95:
    #   t3: delta = 1 + 0 - 0.8 = 0.2                 A3 = 0.2
    #   t2: delta = 0 + 0.8 - 0.7 = 0.1               A2 = 0.1 + 0.95 * 0.2    = 0.29
    #   t1: delta = 0 + 0.7 - 0.6 = 0.1               A1 = 0.1 + 0.95 * 0.29   = 0.3755
    #   t0: delta = 0 + 0.6 - 0.5 = 0.1               A0 = 0.1 + 0.95 * 0.3755 = 0.456725
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    assert torch.allclose(adv, torch.tensor([[0.456725, 0.3755, 0.29, 0.2]]))
    assert torch.allclose(ret, torch.tensor([[0.956725, 0.9755, 0.99, 1.0]]))
    # gamma 0.9, lambda 0.95 (gamma * lambda = 0.855):
    #   t3: delta = 1 - 0.8 = 0.2                     A3 = 0.2
    #   t2: delta = 0.9 * 0.8 - 0.7 = 0.02            A2 = 0.02 + 0.855 * 0.2      = 0.191
    #   t1: delta = 0.9 * 0.7 - 0.6 = 0.03            A1 = 0.03 + 0.855 * 0.191    = 0.193305
    #   t0: delta = 0.9 * 0.6 - 0.5 = 0.04            A0 = 0.04 + 0.855 * 0.193305 = 0.205275775
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.95)
    assert torch.allclose(adv, torch.tensor([[0.205275775, 0.193305, 0.191, 0.2]]))


def test_gae_skips_unmasked_positions():
    # the same episode with a prompt before it, a tool result inside it and padding after it
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 9.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[3.0, 0.5, 0.6, 3.0, 3.0, 0.7, 0.8, 3.0]])
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    assert torch.allclose(adv, torch.tensor([[0, 0.456725, 0.3755, 0, 0, 0.29, 0.2, 0]]))
    assert torch.allclose(ret, torch.tensor([[0, 0.956725, 0.9755, 0, 0, 0.99, 1.0, 0]]))
    # lambda 1, gamma 1: Monte Carlo, A_t = (sum of later rewards) - V_t
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv[mask == 1], torch.tensor([0.5, 0.4, 0.3, 0.2]))


def test_value_loss_clipping_acts():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, -1.0]])
    values = torch.tensor([[0.1, 0.5, 0.5]], requires_grad=True)
    loss_sum, count, extras = value_loss(values, old, returns, torch.ones(1, 3), clip=0.2)
    # token 0: inside the clip range, 0.5 * (0.1 - 1)^2
    # token 1: moved 0.5 toward the return: clipped V 0.2 has the larger error, 0.5 * (0.2 - 1)^2, no gradient
    # token 2: moved 0.5 away from the return: the unclipped error is the larger, 0.5 * (0.5 + 1)^2
    expected = 0.5 * (0.81 + 0.64 + 2.25)
    assert torch.allclose(loss_sum, torch.tensor(expected)) and count.item() == 3
    loss_sum.backward()
    assert torch.allclose(values.grad, torch.tensor([[0.1 - 1.0, 0.0, 0.5 + 1.0]]))
    assert torch.allclose(extras["value_clip_fraction"], torch.tensor(1 / 3))
    # no clipping: plain 0.5 squared error everywhere
    unclipped, _, _ = value_loss(values, old, returns, torch.ones(1, 3), clip=10.0)
    assert torch.allclose(unclipped, torch.tensor(0.5 * (0.81 + 0.25 + 2.25)))


def test_approx_kl_is_zero_for_the_same_policy_and_ignores_masked_tokens():
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert approx_kl(old, old, mask) == 0
    new = old + torch.tensor([[0.5, -0.5, 1e4]])
    expected = ((math.exp(0.5) - 0.5 - 1) + (math.exp(-0.5) + 0.5 - 1)) / 2
    assert torch.allclose(approx_kl(new, old, mask), torch.tensor(expected))
