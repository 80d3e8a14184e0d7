"""Log-probs of rows that repeat a prompt (RL's replies to it, DPO's pair) with the prompt computed once:
consecutive rows with the same tokens before their first trained one become one row, the prompt then each reply,
every reply at its own positions and attending to the prompt and its own earlier tokens only (GPT.forward's
`layout`). The numbers and gradients are each row's own, up to float rounding."""
import torch
import torch.nn.functional as F

PAD_SEGMENT = -1  # padding at a packed row's end: it sees the prompt and itself; no real token sees it
# A packed row's attention is dense over the whole row: sharing a prompt saves (G - 1) x prompt tokens of the
# linear layers (about 24 d^2 FLOPs a token) but computes T^2 - sum of the rows' own squares more attention
# pairs (about 4 d a pair). Long replies to a short prompt lose; such a group stays as separate rows. d = 512.
ATTENTION_PAIRS_PER_SAVED_TOKEN = 6 * 512


def group_rows(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> list[tuple[list[int], int, list[int]]]:
    """[(rows, prefix length, each row's end)]: runs of consecutive rows with the same tokens before their first
    trained target; a row's end is one past its last trained target. Rows with nothing trained are left out."""
    groups: list[tuple[list[int], int, list[int]]] = []
    for r, trained in enumerate(loss_mask.bool()):
        hits = trained.nonzero().flatten()
        if not len(hits):
            continue
        prefix, end = int(hits[0]) + 1, int(hits[-1]) + 2
        last = groups[-1] if groups else None
        if last and last[1] == prefix and torch.equal(input_ids[last[0][0], :prefix], input_ids[r, :prefix]):
            last[0].append(r)
            last[2].append(end)
        else:
            groups.append(([r], prefix, [end]))
    return [kept for group in groups for kept in _worth_sharing(*group)]


def _worth_sharing(rows: list[int], prefix: int, ends: list[int]) -> list[tuple[list[int], int, list[int]]]:
    """The group as it is, or one group per row where packing it would cost more attention than it saves."""
    packed = prefix + sum(end - prefix for end in ends)
    extra_pairs = packed ** 2 - sum(end ** 2 for end in ends)
    if extra_pairs <= ATTENTION_PAIRS_PER_SAVED_TOKEN * (len(rows) - 1) * prefix:
        return [(rows, prefix, ends)]
    return [([r], prefix, [end]) for r, end in zip(rows, ends)]


def prefix_layout(input_ids: torch.Tensor, groups: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """(ids (R, T), positions (R, T), allowed (R, T, T), picks): one row per group, right-padded; picks are
    (packed row, index of the logit there, row, target column) for every target of every row."""
    rows, picks = [], []
    for g, (members, prefix, ends) in enumerate(groups):
        ids, seg, pos = input_ids[members[0], :prefix].tolist(), [0] * prefix, list(range(prefix))
        for k, (r, end) in enumerate(zip(members, ends)):
            # target column t is predicted at the prompt's last token (t = prefix - 1) or at the reply's token t
            picks.append((g, prefix - 1, r, prefix - 1))
            picks += [(g, len(ids) + t - prefix, r, t) for t in range(prefix, end - 1)]
            ids += input_ids[r, prefix:end].tolist()
            seg += [k + 1] * (end - prefix)
            pos += range(prefix, end)
        rows.append((ids, seg, pos))
    T = max(len(ids) for ids, _, _ in rows)
    ids, seg, pos = (torch.tensor([row[i] + [fill] * (T - len(row[i])) for row in rows])
                     for i, fill in ((0, 0), (1, PAD_SEGMENT), (2, 0)))
    idx = torch.arange(T)
    allowed = (idx[None, :] <= idx[:, None]) & ((seg[:, :, None] == seg[:, None, :]) | (seg[:, None, :] == 0))
    return ids, pos, allowed, picks


def prefix_token_logps(model, input_ids: torch.Tensor, loss_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, L) ids -> (B, L-1) log-prob of each next token at `temperature`, float32, at least from each row's first
    to its last trained target (0 or the real value outside: the losses mask it), shared prompts computed once."""
    out = torch.zeros(loss_mask.shape, dtype=torch.float32, device=input_ids.device)
    groups = group_rows(input_ids, loss_mask)
    if not groups:  # nothing trained: a forward all the same, so the loss has a graph (and DDP its gradients)
        return out + 0 * model(input_ids[:, :1]).float().sum()
    if all(len(rows) == 1 for rows, _, _ in groups):  # nothing to share: the plain causal pass (SDPA's fused path)
        trained = loss_mask.bool()  # (B, L-1); the LM head runs at these positions only
        logits = model(input_ids, keep=F.pad(trained, (0, 1))).float() / temperature  # (N, V)
        out[trained] = -F.cross_entropy(logits, input_ids[:, 1:][trained], reduction="none")
        return out
    ids, pos, allowed, picks = prefix_layout(input_ids.cpu(), groups)
    device = input_ids.device
    g, at, r, t = torch.tensor(picks, device=device).T
    keep = torch.zeros(ids.shape, dtype=torch.bool, device=device)  # (R, T): the picked logits only
    keep[g, at] = True
    logits = model(ids.to(device), layout=(pos.to(device), allowed.to(device)), keep=keep)  # (N, V)
    at_kept = keep.flatten().cumsum(0)[g * ids.shape[1] + at] - 1  # each pick's row of `logits`
    out[r, t] = -F.cross_entropy(logits[at_kept].float() / temperature, input_ids[r, t + 1], reduction="none")
    return out
