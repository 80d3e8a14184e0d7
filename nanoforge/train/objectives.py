"""Losses as small functions the loop calls: (model, batch) -> (sum of token losses, supervised tokens, extras).

Returning the SUM lets the loop normalise by the supervised tokens of the whole accumulated batch."""
import torch
import torch.nn.functional as F
from torch import nn

from nanoforge.data.batches import IGNORE
from nanoforge.model.prefix import prefix_token_logps


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]):
    """Next-token cross-entropy over the positions whose label is not IGNORE (pretraining and SFT); the LM head
    runs at those positions only (an SFT row supervises its replies, not its prompts)."""
    keep = batch["labels"] != IGNORE  # (B, T)
    logits = model(batch["input_ids"], segment_ids=batch.get("segment_ids"), keep=keep)  # (N, V)
    # float32 for the softmax: bf16 logits lose the small differences the loss is made of
    loss_sum = F.cross_entropy(logits.float(), batch["labels"][keep], reduction="sum")
    return with_aux_loss(model, loss_sum, keep.sum())


def with_aux_loss(model: nn.Module, loss_sum: torch.Tensor, n: torch.Tensor):
    """Add an MoE model's load-balancing loss, weighted per supervised token so that the loop's normalisation
    turns it into moe_aux_weight * aux; it is also returned on its own for the logs."""
    aux = model.aux_loss() if hasattr(model, "aux_loss") and model.training else None
    if aux is None:  # dense model, or evaluation: validation loss stays the pure language-model loss
        return loss_sum, n, {}
    return loss_sum + model.cfg.moe_aux_weight * aux * n, n, {"moe_aux": aux.detach()}


def dpo_loss(model: nn.Module, batch: dict[str, torch.Tensor], beta: float = 0.1):
    """Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290, eq. 7), summed over pairs.

    The batch (nanoforge.data.dpo.DPOBatches) holds 2B rows, B chosen then B rejected, with `labels` on the
    final reply only and `ref_logps` (2B,) precomputed by the frozen reference model. With pc, pr the
    policy's and rc, rr the reference's summed log-probabilities of the chosen and rejected replies:
        margin = beta * ((pc - rc) - (pr - rr)),  loss = -log sigmoid(margin)  per pair.
    Returns (sum of pair losses, number of pairs, extras); the dpo stage normalises by pairs
    (Stage.count_fn = nanoforge.data.dpo.count_pairs). At the start policy == reference, so every pair's
    loss is log 2 = 0.6931: a loss stuck there means the policy is not moving (lr far too small)."""
    logps = pair_logps(model, batch["input_ids"], batch["labels"])  # (2B,) float32
    loss_sum, n, extras = dpo_objective(logps, batch["ref_logps"], beta)
    loss_sum, n, aux = with_aux_loss(model, loss_sum, n)
    return loss_sum, n, {**extras, **aux}


def dpo_objective(logps: torch.Tensor, ref_logps: torch.Tensor, beta: float):
    """dpo_loss's arithmetic on the policy's and the reference's (2B,) summed log-probs."""
    ratios = logps - ref_logps.float()  # (2B,) log pi/pi_ref of each reply
    n_pairs = ratios.shape[0] // 2
    chosen, rejected = beta * ratios[:n_pairs], beta * ratios[n_pairs:]  # (B,) implicit rewards
    margin = chosen - rejected  # (B,)
    loss_sum = -F.logsigmoid(margin).sum()
    n = torch.tensor(n_pairs, device=logps.device)
    extras = {"reward_margin": margin.detach().mean(), "reward_accuracy": (margin.detach() > 0).float().mean(),
              "chosen_reward": chosen.detach().mean(), "rejected_reward": rejected.detach().mean()}
    return loss_sum, n, extras


def pair_logps(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(2B,) each row's summed log-probs of its labelled tokens (data/dpo.py's rows, B chosen then B rejected),
    a pair's two rows sharing the pass over their prompt (model/prefix.py: rows interleaved c0, r0, c1, r1, ...)."""
    n = len(input_ids) // 2
    order = torch.arange(2 * n, device=input_ids.device).view(2, n).T.flatten()
    ids, labels = input_ids[order], labels[order]
    tokens = torch.cat([ids, ids[:, -1:]], dim=1)  # (2B, T + 1): each row's tokens, its last one from the labels
    tokens[:, 1:] = torch.where(labels != IGNORE, labels, tokens[:, 1:])
    mask = (labels != IGNORE).float()
    logps = torch.empty(2 * n, dtype=torch.float32, device=input_ids.device)
    logps[order] = (prefix_token_logps(model, tokens, mask, 1.0) * mask).sum(dim=1)
    return logps


def make_distill_loss(teacher: nn.Module, temperature: float = 1.5, alpha: float = 0.5):
    """White-box distillation (Hinton et al., arXiv 1503.02531): on every supervised position,
    alpha * cross-entropy with the data + (1 - alpha) * T^2 * KL(teacher_T || student_T), where _T are the
    distributions softened by temperature T. T^2 keeps the soft term's gradient scale independent of T.
    The teacher runs without gradients; it must share the student's tokenizer (checked by the stage)."""
    if temperature <= 0 or not 0.0 <= alpha <= 1.0:
        raise ValueError("temperature must be > 0 and alpha in [0, 1]")

    def distill_loss(model: nn.Module, batch: dict[str, torch.Tensor]):
        seg, keep = batch.get("segment_ids"), batch["labels"] != IGNORE  # keep: (B, T)
        s = model(batch["input_ids"], segment_ids=seg, keep=keep).float()  # (N, V)
        with torch.no_grad():
            t = teacher(batch["input_ids"], segment_ids=seg, keep=keep).float()  # (N, V)
        ce = F.cross_entropy(s, batch["labels"][keep], reduction="sum")
        kl = F.kl_div(F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1), log_target=True,
                      reduction="sum")
        denom = keep.sum().clamp(min=1)
        loss_sum, n, extras = with_aux_loss(model, alpha * ce + (1 - alpha) * temperature**2 * kl, keep.sum())
        return loss_sum, n, {**extras, "kl": kl.detach() / denom, "ce": ce.detach() / denom}

    return distill_loss
