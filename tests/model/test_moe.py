"""Mixture of experts: top-k routing, the load-balancing loss, and an MoE model in the loop and generation."""
import json

import pytest
import torch

from nanoforge.core.config import ModelConfig, build_config
from nanoforge.model.gpt import GPT
from nanoforge.model.moe import MoE, load_balancing_loss
from nanoforge.weights import checkpoint as ckpt

CFG = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, n_experts=4,
           experts_per_token=2)


def test_tokens_go_to_their_top_k_experts():
    torch.manual_seed(0)
    moe = MoE(ModelConfig(**CFG))
    x = torch.randn(2, 5, 32)
    out = moe(x)
    flat = x.reshape(-1, 32)
    probs = torch.softmax(moe.gate(flat), -1)
    for t in range(flat.shape[0]):
        top = probs[t].topk(2)
        w = top.values / top.values.sum()
        expected = sum(w[j] * moe.experts[int(top.indices[j])](flat[t]) for j in range(2))
        torch.testing.assert_close(out.reshape(-1, 32)[t], expected, atol=1e-5, rtol=1e-4)
    # an expert outside a token's top-k does not touch it: zeroing it changes nothing for that token
    loser = int(probs[0].argmin())
    with torch.no_grad():
        for p in moe.experts[loser].parameters():
            p.zero_()
    torch.testing.assert_close(moe(x).reshape(-1, 32)[0], out.reshape(-1, 32)[0])


def test_aux_loss_is_one_for_uniform_routing_and_grows_with_imbalance():
    n, E = 64, 4
    uniform = torch.full((n, E), 1 / E)
    idx = torch.stack([torch.arange(n) % E, (torch.arange(n) + 1) % E], 1)  # slots spread evenly
    assert load_balancing_loss(uniform, idx, E).item() == pytest.approx(1.0)
    collapsed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(n, 1)
    to_first = torch.tensor([[0, 1]]).repeat(n, 1)
    assert load_balancing_loss(collapsed, to_first, E).item() > 1.5
    # sliding from uniform towards the collapsed router, the loss only grows
    losses = []
    for t in torch.linspace(0, 1, 6):
        probs = (1 - t) * uniform + t * collapsed
        losses.append(load_balancing_loss(probs, probs.topk(2).indices, E).item())
    assert losses[0] == pytest.approx(1.0) and all(a < b for a, b in zip(losses, losses[1:]))


def test_moe_generation_cache_parity_and_checkpoint_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CFG)).eval()
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(1)
        steps = [model(ids[:, :6], cache=cache)] + [model(ids[:, i:i + 1], cache=cache) for i in range(6, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-4)
    ckpt.save_checkpoint(tmp_path, 1, model.state_dict_for_save(), {}, {"config": {"model": CFG}})
    other = GPT(ModelConfig(**CFG))
    other.load_weights(ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path)))
    with torch.no_grad():
        torch.testing.assert_close(other.eval()(ids), full)
    assert "model.layers.0.mlp.gate.weight" in model.state_dict()
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in model.state_dict()


def test_active_flops_count_only_routed_experts():
    dense = GPT(ModelConfig(**{**CFG, "n_experts": 0}))
    moe = GPT(ModelConfig(**CFG))
    router = CFG["n_layers"] * CFG["d_model"] * CFG["n_experts"]
    # top-2 of 4 experts: twice the dense MLP's matmuls, plus the router
    mlp = CFG["n_layers"] * 3 * CFG["d_model"] * ModelConfig(**CFG).ffn_dim
    assert moe.flops_per_token(64) - dense.flops_per_token(64) == pytest.approx(6 * (mlp + router))


def test_moe_model_trains_and_logs_aux_loss(tmp_path, tiny_tokenizer):
    from conftest import tiny_corpus
    from nanoforge.data.prepare import prepare_dataset
    from nanoforge.recipes.pretrain import pretrain
    files = tiny_corpus(tmp_path)[:1]
    prepare_dataset("pretrain", files, tiny_tokenizer, tmp_path / "data", val_fraction=0.1, workers=1,
                    log=lambda *a: None)
    pretrain([str(tmp_path / "data")], tmp_path / "run", preset="tiny",
             overrides={"n_experts": 4, "experts_per_token": 2, "max_steps": 40, "log_every": 10, "lr": 3e-3,
                        "eval_every": 20, "tensorboard": False, "precision": "fp32", "seq_len": 64}, quiet=True)
    recs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if "loss" in r]
    assert train_recs[-1]["loss"] < train_recs[0]["loss"] - 0.5
    assert all(0.99 < r["moe_aux"] < 4.0 for r in train_recs)
    assert all("val_moe_aux" not in r for r in recs)  # validation loss is the plain LM loss


def test_moe_config_is_validated():
    from nanoforge.core.config import ConfigError
    with pytest.raises(ConfigError, match="experts_per_token=5"):
        build_config("tiny", None, {"n_experts": 4, "experts_per_token": 5})
    m, _ = build_config("mini-moe")
    assert (m.n_experts, m.experts_per_token) == (4, 2)
