"""Policy-gradient losses of the RL stages (GRPO, CISPO, REINFORCE, PPO), as pure tensor functions.

Shapes: B sequences (a rollout's rows) of T positions. `logp`, `old_logp`, `ref_logp` are (B, T) log-probabilities of
the sampled tokens under the policy being trained, the policy that sampled them, and the frozen reference.
`mask` (B, T) is 1 on the tokens the policy wrote and is trained on (the reply, its stop token when it
stopped) and 0 elsewhere (prompt, tool results, padding). Positions with mask 0 never get a gradient, whatever
values they hold (they are replaced by 0 before any arithmetic, so an inf there cannot turn into a NaN).

Like every loss of the one loop (train/stage.py) the losses return (sum, count, extras), the objective being
sum / count, so the loop can add micro-batches' sums and divide by the whole step's count."""
import torch

LOSSES = ("grpo", "cispo", "reinforce")
NORMS = ("sequence", "token")
ADVANTAGES = ("zscore", "mean")


def group_advantages(rewards: torch.Tensor, mode: str = "zscore", eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages of N replies sampled for each of G prompts; rewards (G, N) -> (G, N) float32.

        mean:   A = r - mean(r)                          (nanochat; Dr. GRPO, arXiv 2503.20783)
        zscore: A = (r - mean(r)) / (std(r) + eps)       (GRPO, arXiv 2402.03300; MiniMind, eps 1e-4)

    std is the unbiased one (divides by N - 1), torch.std's default, as MiniMind uses. A group whose rewards are
    all equal (including N = 1) gets exactly 0: it says nothing about which reply was better."""
    if mode not in ADVANTAGES:
        raise ValueError(f"advantage mode {mode!r} is not one of {', '.join(ADVANTAGES)}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (groups, replies per group), got shape {tuple(rewards.shape)}")
    r = rewards.float()  # (G, N)
    centred = r - r.mean(dim=1, keepdim=True)
    if mode == "zscore" and r.shape[1] > 1:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)  # (G, 1)
    return torch.where(constant, torch.zeros_like(centred), centred)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate on tokens sampled from the policy, Schulman's k3
    (http://joschu.net/blog/kl-approx.html): with d = ref_logp - logp,  k3 = exp(d) - d - 1.
    Unbiased, >= 0 for every token, and exactly 0 where the two log-probabilities are equal."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over the positions where mask is set (0 when none is); values elsewhere are ignored."""
    m = mask.bool()
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1)


def normalise(per_token: torch.Tensor, mask: torch.Tensor, norm: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of per-token losses x (B, T) whose quotient is the objective:

        token:    sum_{b,t} m x / sum_{b,t} m             -> (sum of m x, masked tokens)       (nanochat)
        sequence: 1/S sum_b (sum_t m x / sum_t m)         -> (sum of per-sequence means, S)    (GRPO, MiniMind)

    S counts the sequences with at least one masked token (an empty one neither adds nor dilutes). Token
    normalisation weighs long replies more; sequence normalisation weighs every reply alike."""
    m = mask.bool()
    count = loss_count(m, norm)
    x = torch.where(m, per_token, torch.zeros_like(per_token))
    if norm == "token":
        return x.sum(), count
    return (x.sum(dim=1) / m.sum(dim=1).clamp(min=1)).sum(), count  # the sum of (B,) per-sequence means


def loss_count(mask: torch.Tensor, norm: str) -> torch.Tensor:
    """What a step's loss is divided by (a stage's count_fn): masked tokens ("token"), or sequences with at
    least one masked token ("sequence"). mask (B, T) -> int64 scalar."""
    if norm not in NORMS:
        raise ValueError(f"loss normalisation {norm!r} is not one of {', '.join(NORMS)}")
    m = mask.bool()
    return m.sum() if norm == "token" else (m.sum(dim=1) > 0).sum()


def _surrogate(loss: str, ratio, logp, adv, epsilon: float, epsilon_high: float | None, cispo_max: float):
    """Per-token policy loss (B, T) and where clipping acted (B, T) bool; ratio = exp(logp - old_logp).

        grpo:      -min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A)    PPO's clipped surrogate; no gradient
                   where A > 0 and ratio > 1 + eps_high, or A < 0 and ratio < 1 - eps
        cispo:     -sg(min(ratio, cispo_max)) A logp                    CISPO (MiniMax-M1, arXiv 2506.13585):
                   the importance weight is clipped, never the token's gradient. No low-side clip: the paper
                   sets its lower bound so loose that it never acts, and MiniMind clips only the top.
        reinforce: -A logp                                               plain policy gradient, no ratio
    At ratio 1 all three have the gradient -A with respect to logp."""
    if loss == "grpo":
        high = epsilon if epsilon_high is None else epsilon_high
        clipped_ratio = ratio.clamp(1 - epsilon, 1 + high)
        per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
        clipped = ((adv > 0) & (ratio > 1 + high)) | ((adv < 0) & (ratio < 1 - epsilon))
    elif loss == "cispo":
        per_token = -(ratio.clamp(max=cispo_max).detach() * adv * logp)
        clipped = ratio > cispo_max
    elif loss == "reinforce":
        per_token = -(adv * logp)
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
    else:
        raise ValueError(f"policy loss {loss!r} is not one of {', '.join(LOSSES)}")
    return per_token, clipped.expand_as(per_token)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                loss: str = "grpo", epsilon: float = 0.2, epsilon_high: float | None = None,
                ref_logp: torch.Tensor | None = None, beta: float = 0.0, norm: str = "sequence",
                cispo_max: float = 5.0):
    """The RL policy loss over the masked tokens: per token the `loss` surrogate (see _surrogate) with
    ratio = exp(logp - old_logp), plus beta * kl_k3(logp, ref_logp) when ref_logp is given and beta > 0;
    normalised per `norm` (see normalise).

    advantages: (B,) one per sequence (GRPO's group advantages) or (B, T) per token (PPO's GAE: PPO's policy
    loss is loss="grpo", the clipped surrogate, with those).
    old_logp, ref_logp and the advantages are constants (detached). Returns (sum, count, extras) with extras
    clip_fraction (share of masked tokens where clipping acted), ratio (mean) and, with ref_logp, kl (mean k3)."""
    if not epsilon > 0 or (epsilon_high is not None and not epsilon_high > 0):
        raise ValueError(f"epsilon and epsilon_high must be > 0, got {epsilon}, {epsilon_high}")
    m = mask.bool()  # (B, T)
    zero = torch.zeros_like(logp, dtype=torch.float32)
    lp = torch.where(m, logp.float(), zero)  # masked positions: 0, so no inf ever reaches exp or a product
    old = torch.where(m, old_logp.detach().float(), zero)
    adv = advantages.detach().float()
    adv = adv[:, None] if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    ratio = torch.exp(lp - old)  # (B, T)
    per_token, clipped = _surrogate(loss, ratio, lp, adv, epsilon, epsilon_high, cispo_max)
    extras = {"clip_fraction": masked_mean(clipped.float(), m), "ratio": masked_mean(ratio.detach(), m)}
    if ref_logp is not None:
        kl = kl_k3(lp, torch.where(m, ref_logp.detach().float(), zero))  # (B, T)
        extras["kl"] = masked_mean(kl.detach(), m)
        if beta > 0:
            per_token = per_token + beta * kl
    return (*normalise(per_token, m, norm), extras)


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95):
    """Generalised advantage estimation (Schulman et al. 2015, arXiv 1506.02438) over each row's masked tokens,
    taken in order as the steps of one episode:

        delta_t = r_t + gamma V_next - V_t,   A_t = delta_t + gamma lam A_next,   R_t = A_t + V_t

    where "next" is the row's next masked position, and after its last masked token V_next = A_next = 0 (the
    episode ends). Positions with mask 0 (prompt, tool results, padding) are not steps: skipped, their rewards
    ignored, so put the reward on a masked token (usually the reply's last). rewards, values, mask: (B, T).
    Returns (advantages, returns), (B, T) float32 each, 0 where mask is 0."""
    r, v, m = rewards.float(), values.float(), mask.bool()
    adv = torch.zeros_like(v)  # (B, T)
    next_value = next_adv = torch.zeros_like(v[:, 0])  # (B,) each; never written in place
    for t in reversed(range(v.shape[1])):
        a = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv  # (B,)
        step = m[:, t]
        adv[:, t] = torch.where(step, a, torch.zeros_like(a))
        next_value = torch.where(step, v[:, t], next_value)
        next_adv = torch.where(step, a, next_adv)
    return adv, torch.where(m, adv + v, torch.zeros_like(v))  # advantages, returns


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.2, norm: str = "token"):
    """PPO's clipped value loss (as OpenAI baselines' ppo2): with V_clip = V_old + clamp(V - V_old, -clip, clip),

        l_t = 0.5 max((V - R)^2, (V_clip - R)^2)

    so a value already moved more than `clip` from V_old is not pushed further. values (B, T) carries the
    gradient; old_values and returns are constants. Returns (sum, count, extras) normalised per `norm`;
    extras value_clip_fraction: share of masked tokens where the clipped error was the larger (no gradient)."""
    m = mask.bool()
    zero = torch.zeros_like(values, dtype=torch.float32)
    v = torch.where(m, values.float(), zero)
    old = torch.where(m, old_values.detach().float(), zero)
    ret = torch.where(m, returns.detach().float(), zero)
    v_clipped = old + (v - old).clamp(-clip, clip)
    unclipped_err, clipped_err = (v - ret) ** 2, (v_clipped - ret) ** 2
    per_token = 0.5 * torch.maximum(unclipped_err, clipped_err)
    loss_sum, count = normalise(per_token, m, norm)
    return loss_sum, count, {"value_clip_fraction": masked_mean((clipped_err > unclipped_err).float(), m)}


@torch.no_grad()
def approx_kl(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(old policy || current policy) over the masked tokens, which the old policy sampled: the mean of
    k3 = exp(d) - d - 1 with d = logp - old_logp (kl_k3 with the roles swapped; >= 0). PPO stops its epochs
    over a rollout's rows once this passes a target."""
    m = mask.bool()
    zero = torch.zeros_like(logp, dtype=torch.float32)
    return masked_mean(kl_k3(torch.where(m, old_logp.float(), zero), torch.where(m, logp.float(), zero)), m)
