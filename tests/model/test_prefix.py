"""model/prefix.py: the rows of a rollout with each group's prompt computed once give every row's own log-probs and
gradients, on a real (tiny, random) model."""
import torch
import torch.nn.functional as F

from nanoforge.core.config import ModelConfig
from nanoforge.model.gpt import GPT
from nanoforge.model.prefix import group_rows, prefix_token_logps


def tiny_model() -> GPT:
    torch.manual_seed(0)  # init_std 0.1: attention far from uniform, so a wrong position or mask shows
    return GPT(ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                           init_std=0.1))


def row_by_row(model, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """The plain computation: each row alone, every position's next-token log-prob."""
    logits = model(ids)[:, :-1].float() / temperature
    return -F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")


def rollout_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows as a rollout lays them out: 3 replies to one prompt, 2 to another of the same length
    (not to be merged with the first), a reply with an untrained gap (a tool result), and a row with nothing
    trained; loss_mask 1 where the next token is a reply token."""
    g = torch.Generator().manual_seed(1)
    p1, p2 = torch.randint(1, 97, (6,), generator=g), torch.randint(1, 97, (6,), generator=g)
    p3 = torch.randint(1, 97, (9,), generator=g)
    specs = [(p1, 4, ()), (p1, 1, ()), (p1, 7, ()), (p2, 3, ()), (p2, 5, ()), (p3, 8, (3, 4, 5)), (p3, 0, ())]
    ids, mask = torch.zeros(len(specs), 18, dtype=torch.long), torch.zeros(len(specs), 17)
    for i, (prompt, n, gap) in enumerate(specs):
        row = torch.cat([prompt, torch.randint(1, 97, (n,), generator=g)])
        ids[i, :len(row)] = row
        mask[i, len(prompt) - 1:len(row) - 1] = 1.0
        mask[i, [len(prompt) - 1 + k for k in gap]] = 0.0
    return ids, mask


def test_groups_are_runs_of_rows_with_the_same_prompt():
    ids, mask = rollout_rows()
    assert [(rows, prefix) for rows, prefix, _ in group_rows(ids, mask)] == [([0, 1, 2], 6), ([3, 4], 6), ([5], 9)]
    # long replies to a short prompt: one packed row's dense attention would cost more than the prompt saves
    ids, mask = torch.ones(2, 401, dtype=torch.long), torch.zeros(2, 400)
    mask[:, 1:] = 1.0
    assert [(rows, prefix) for rows, prefix, _ in group_rows(ids, mask)] == [([0], 2), ([1], 2)]
    model = tiny_model()  # nothing shared: the plain pass, its LM head at the trained targets only
    ids, mask = ids[:, :60], mask[:, :59]
    plain, alone, m = prefix_token_logps(model, ids, mask, 1.0), row_by_row(model, ids, 1.0), mask.bool()
    assert torch.allclose(plain[m], alone[m], atol=1e-6) and torch.equal(plain[~m], torch.zeros(2))


def test_log_probs_and_gradients_equal_each_row_computed_alone():
    model, (ids, mask) = tiny_model(), rollout_rows()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    m = mask.bool()

    alone = row_by_row(model, ids, 0.8)
    (alone * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    shared = prefix_token_logps(model, ids, mask, 0.8)
    (shared * weights).sum().backward()

    assert shared.shape == mask.shape and torch.allclose(shared[m], alone[m], atol=1e-5)
    assert torch.equal(shared[6], torch.zeros(17))  # nothing trained: nothing computed
    assert torch.equal(shared[0, :5], torch.zeros(5))  # before the first trained target
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name], atol=1e-5), name
    # the shared prompt is computed once: fewer tokens through the model than the rows hold
    calls = []
    model.register_forward_pre_hook(lambda mod, args: calls.append(args[0].numel()))
    prefix_token_logps(model, ids, mask, 0.8)
    assert calls[0] < int((ids != 0).sum())
