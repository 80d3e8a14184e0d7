import math

import pytest
import torch
from torch import nn

from nanoforge.core.config import ConfigError, ModelConfig, TrainConfig, build_config
from nanoforge.model.gpt import GPT
from nanoforge.train.optim import MuonAdamW, build_optimizer, lr_at, muon_params, orthogonalize, param_groups, set_lr


def cfg(**kw):
    return TrainConfig(**{"max_steps": 100, "warmup_steps": 10, "lr": 1.0, "min_lr_ratio": 0.1, **kw})


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "onecycle", "constant"])
def test_warmup_is_linear_and_reaches_peak(schedule):
    c = cfg(schedule=schedule)
    assert [lr_at(s, c) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert lr_at(9, c) == pytest.approx(1.0)


def test_cosine_ends_at_floor_and_passes_midpoint():
    c = cfg(schedule="cosine")
    assert lr_at(55, c) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, c) == pytest.approx(0.1)
    lrs = [lr_at(s, c) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_wsd_is_flat_then_decays_over_last_fraction():
    c = cfg(schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, c) == 1.0 and lr_at(79, c) == 1.0
    assert lr_at(80, c) < 1.0
    assert lr_at(99, c) == pytest.approx(0.1)


def test_time_budget_schedule_follows_the_seconds_spent_or_the_steps_if_further():
    c = cfg(schedule="wsd", decay_fraction=0.2, time_budget=60.0, max_steps=10**6)
    assert lr_at(500, c, seconds=30.0) == 1.0 and lr_at(500, c, seconds=47.9) == 1.0  # stable for 80% of the time
    assert lr_at(500, c, seconds=54.0) == pytest.approx(0.55) and lr_at(500, c, seconds=60.0) == pytest.approx(0.1)
    assert lr_at(4, c, seconds=54.0) == pytest.approx(0.5)  # warmup stays in steps
    assert lr_at(95, cfg(schedule="wsd", decay_fraction=0.2, time_budget=600.0), seconds=1.0) == pytest.approx(0.325)
    cos = cfg(schedule="cosine", time_budget=60.0, max_steps=10**6)
    assert lr_at(500, cos, seconds=30.0) == pytest.approx(0.55) and lr_at(500, cos, seconds=99.0) == pytest.approx(0.1)


def test_onecycle_is_linear_down():
    c = cfg(schedule="onecycle")
    assert lr_at(55, c) == pytest.approx(1.0 + (0.1 - 1.0) * 0.5)


def test_no_weight_decay_on_norms_biases_embeddings():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.lin = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight  # tied: must appear once

    m = M()
    groups = param_groups(m, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    plain = {id(p) for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decayed == {id(m.lin.weight)}
    assert plain == {id(m.emb.weight), id(m.lin.bias), id(m.norm.weight), id(m.norm.bias)}
    assert sum(len(g["params"]) for g in groups) == len(list(m.parameters()))


# ---------------------------------------------------------------------------------------------- Muon


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32)])
def test_orthogonalize_gives_a_near_orthogonal_matrix(shape):
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(shape[0], min(shape), generator=gen))
    v, _ = torch.linalg.qr(torch.randn(shape[1], min(shape), generator=gen))
    s = torch.logspace(0, math.log10(50), min(shape))  # singular values spread over 50x, as gradients have
    g = u @ torch.diag(s) @ v.T
    x = orthogonalize(g)
    assert x.shape == g.shape
    s = torch.linalg.svdvals(x)
    assert s.min() > 0.6 and s.max() < 1.25  # every direction gets a step of about the same size
    assert torch.nn.functional.cosine_similarity((u @ v.T).flatten(), x.flatten(), dim=0) > 0.95


def test_orthogonalize_of_a_stack_is_each_matrix_on_its_own():
    gen = torch.Generator().manual_seed(1)
    for shape in [(3, 48, 16), (2, 16, 48)]:
        g = torch.randn(shape, generator=gen) * torch.tensor([1.0, 30.0, 0.01][:shape[0]]).view(-1, 1, 1)
        torch.testing.assert_close(orthogonalize(g), torch.stack([orthogonalize(m) for m in g]))


def test_muon_step_follows_its_formula_matrix_by_matrix():
    """Two steps of MuonAdamW (same-shape matrices batched) against the docstring's update written per matrix:
    M <- mu M + G; W <- W (1 - lr wd) - lr sqrt(max(1, rows/cols)) orthogonalize(G + mu M)."""
    model = tiny_gpt()
    matrices, _ = muon_params(model)
    lr, mu, wd = 0.02, 0.95, 0.1
    opt = MuonAdamW(model, TrainConfig(optimizer="muon", lr=lr, muon_lr=lr, muon_momentum=mu, weight_decay=wd))
    expected = [p.detach().clone() for p in matrices]
    bufs = [torch.zeros_like(p) for p in matrices]
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        for i, p in enumerate(matrices):
            bufs[i] = mu * bufs[i] + p.grad
            update = orthogonalize(p.grad + mu * bufs[i])
            expected[i] = expected[i] * (1 - lr * wd) - lr * max(1.0, p.size(0) / p.size(1)) ** 0.5 * update
        opt.step()
    for p, want in zip(matrices, expected):
        torch.testing.assert_close(p.detach(), want)


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32))


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = tiny_gpt()
    matrices, rest = muon_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(".layers." in names[id(p)] and p.ndim == 2 for p in matrices)
    assert len(matrices) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert "model.embed_tokens.weight" in {names[id(p)] for p in rest}  # tied with lm_head: listed once
    opt = MuonAdamW(model, TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02))
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    set_lr(opt, 5e-4)  # the schedule moves both; the matrices keep their ratio muon_lr / lr
    lrs = {g["kind"]: g["lr"] for g in opt.param_groups}
    assert lrs == {"muon": pytest.approx(0.01), "adamw": pytest.approx(5e-4)}


def test_muon_config_is_validated():
    with pytest.raises(ConfigError, match="optimizer"):
        build_config(None, None, {"optimizer": "sgd"})
    with pytest.raises(ConfigError, match="muon_lr"):
        build_config(None, None, {"optimizer": "muon", "muon_momentum": 1.0})


def test_tiny_model_learns_with_muon():
    model = tiny_gpt()
    opt = build_optimizer(model, TrainConfig(optimizer="muon", lr=3e-3, muon_lr=0.02), torch.device("cpu"))
    x = torch.arange(33).remainder(16).repeat(4, 1)  # a periodic sequence: learnable in a few steps
    losses = []
    for _ in range(30):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_muon_resume_is_bit_identical(tmp_path, tiny_tokenizer, shared_data):
    """8 steps straight == 4 steps, a checkpoint, then a fresh process-like resume for 4 more: the same
    losses and bit-identical weights (the momentum buffers and AdamW moments are in the checkpoint)."""
    import shutil
    from test_loop import FAST, losses, weights
    from nanoforge.data.prepare import prepare_dataset
    from nanoforge.recipes.pretrain import pretrain
    data = tmp_path / "data"
    prepare_dataset("pretrain", [shared_data / "tiny" / "pretrain_tiny.jsonl"], tiny_tokenizer, data,
                    val_fraction=0.1, workers=1, log=lambda *a: None)
    common = {**FAST, "max_steps": 8, "save_every": 4, "keep_last": 5, "optimizer": "muon", "muon_lr": 0.02}
    pretrain([str(data)], tmp_path / "straight", preset="tiny", overrides=common, quiet=True)
    shutil.copytree(tmp_path / "straight", tmp_path / "split")
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "step_000008")
    pretrain([], tmp_path / "split", resume=True, quiet=True)
    assert losses(tmp_path / "straight") == losses(tmp_path / "split")
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "split")
    for k in a:
        assert torch.equal(a[k], b[k]), k
