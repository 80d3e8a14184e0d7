"""LoRA: adapters start as a no-op, merge exactly, train alone, save under PEFT-like names, refuse a wrong
base, and run through the one training loop with adapter-only checkpoints and exact resume."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoforge.core.config import ModelConfig, TrainConfig
from nanoforge.core.errors import NanoforgeError
from nanoforge.weights.load import adapter_metadata, check_base, load_adapter_checkpoint
from nanoforge.model.gpt import GPT
from nanoforge.core.config import LoraConfig, parse_targets
from nanoforge.model.lora import (LoraLinear, LoraModel, attach_lora, load_lora_state_dict, lora_state_dict,
                                  merge_lora, num_trainable)
from nanoforge.weights import checkpoint as ckpt
from nanoforge.train.loop import Stage, train
from nanoforge.train.objectives import causal_lm_loss

TINY = dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def base_model(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(ModelConfig(**{**TINY, **kw})).eval()


def tokens(seed=1, B=2, T=16):
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def perturb_adapters(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_fresh_adapters_are_a_no_op_and_merge_is_exact():
    model = base_model()
    x = tokens()
    base_logits = model(x)
    base_sd = {k: v.clone() for k, v in model.state_dict_for_save().items()}

    replaced = attach_lora(model, LoraConfig(rank=4, alpha=8.0, dropout=0.1))
    assert replaced == [f"model.layers.{i}.{p}" for i in range(2) for p in PROJ]
    assert torch.equal(model(x), base_logits)  # B = 0: exactly the base model
    # base weights keep their HF names; only adapter keys are added
    sd = model.state_dict_for_save()
    assert set(sd) - set(base_sd) == {f"{m}.lora_{ab}.weight" for m in replaced for ab in "AB"}
    assert set(base_sd) <= set(sd)

    perturb_adapters(model)
    adapted = model(x)  # eval mode: no adapter dropout
    assert not torch.allclose(adapted, base_logits, atol=1e-3)
    merged = merge_lora(model)
    assert not any(isinstance(m, LoraLinear) for m in merged.modules())
    assert all(type(m) is torch.nn.Linear for n, m in merged.named_modules() if n.endswith("_proj"))
    merged_sd = merged.state_dict_for_save()
    assert set(merged_sd) == set(base_sd)
    assert all(merged_sd[k].shape == base_sd[k].shape for k in base_sd)
    torch.testing.assert_close(merged(x), adapted, atol=1e-5, rtol=0)
    # the merged weights load strictly into a plain GPT
    fresh = base_model(seed=9)
    fresh.load_weights(merged_sd)
    torch.testing.assert_close(fresh(x), adapted, atol=1e-5, rtol=0)
    assert all(p.requires_grad for p in merged.parameters())


def test_only_adapters_train_and_base_stays_bit_identical():
    model = base_model()
    attach_lora(model, LoraConfig(rank=4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not model.model.embed_tokens.weight.requires_grad and model.lm_head.weight is model.model.embed_tokens.weight
    assert num_trainable(model) == 4 * sum(_io(model, p) for p in PROJ)

    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    model.train()
    x = tokens(B=4)
    for _ in range(3):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
            assert p.grad is None, n
        else:
            assert not torch.equal(p, adapters[n]), f"{n} did not change"


def _io(model, proj):
    """in + out features of one projection, summed over layers (a rank-r adapter has r * (in + out))."""
    total = 0
    for block in model.model.layers:
        parent, child = proj.split(".")
        m = getattr(getattr(block, parent), child)
        total += m.in_features + m.out_features
    return total


def test_adapter_weights_round_trip_and_strict_load(tmp_path):
    model = base_model()
    cfg = LoraConfig(rank=4, targets="q,v,down")
    attach_lora(model, cfg)
    perturb_adapters(model)
    sd = lora_state_dict(model)
    assert sorted(sd) == sorted(f"model.layers.{i}.{p}.lora_{ab}.weight" for i in range(2)
                                for p in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj") for ab in "AB")
    assert sd["model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 32)
    assert sd["model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (32, 4)
    assert sd["model.layers.1.mlp.down_proj.lora_A.weight"].shape == (4, model.cfg.ffn_dim)
    save_file(sd, str(tmp_path / "adapter.safetensors"))
    x = tokens()
    expected = model(x)

    fresh = base_model()  # same base, new adapters
    attach_lora(fresh, cfg)
    assert not torch.allclose(fresh(x), expected, atol=1e-3)
    load_lora_state_dict(fresh, load_file(str(tmp_path / "adapter.safetensors")))
    assert torch.equal(fresh(x), expected)

    wrong_rank = base_model()
    attach_lora(wrong_rank, LoraConfig(rank=8, targets="q,v,down"))
    key = r"model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight"
    with pytest.raises(NanoforgeError, match=key + r" has shape \(4, 32\) in the adapter weights, \(8, 32\)"):
        load_lora_state_dict(wrong_rank, sd)
    wider = base_model(d_model=64)
    attach_lora(wider, cfg)
    with pytest.raises(NanoforgeError, match=r"lora_B\.weight has shape \(32, 4\) in the adapter weights, \(64, 4\)"):
        load_lora_state_dict(wider, sd)
    fewer = base_model()
    attach_lora(fewer, LoraConfig(rank=4, targets="q"))
    with pytest.raises(NanoforgeError, match=r"v_proj\.lora_A\.weight is in the adapter weights but not in the model"):
        load_lora_state_dict(fewer, sd)
    more = base_model()
    attach_lora(more, LoraConfig(rank=4, targets="q,k,v,down"))
    with pytest.raises(NanoforgeError, match=r"k_proj\.lora_A\.weight is missing"):
        load_lora_state_dict(more, sd)


def test_check_base_refuses_another_base(tmp_path):
    base, other = base_model(seed=0), base_model(seed=1)
    save_file(base.state_dict_for_save(), str(tmp_path / "base.safetensors"))
    save_file(other.state_dict_for_save(), str(tmp_path / "other.safetensors"))
    # the same tensors saved again with different file metadata: another sha256, same fingerprint
    save_file(base.state_dict_for_save(), str(tmp_path / "copy.safetensors"), metadata={"note": "re-saved"})
    attach_lora(base, LoraConfig(rank=2))  # the fingerprint ignores adapters
    meta = adapter_metadata(tmp_path / "base.safetensors", base)
    assert meta["base_checkpoint"] == str((tmp_path / "base.safetensors").resolve())
    assert len(meta["base_sha256"]) == 64 and len(meta["base_fingerprint"]) == 64
    assert adapter_metadata(tmp_path / "base.safetensors", load_file(str(tmp_path / "base.safetensors"))) == meta
    check_base(meta, tmp_path / "base.safetensors")
    check_base(meta, tmp_path / "copy.safetensors")
    with pytest.raises(NanoforgeError, match=r"adapter was trained on base .*base\.safetensors "
                                             r"\(sha256 [0-9a-f]{12}\), not .*other\.safetensors"):
        check_base(meta, tmp_path / "other.safetensors")


def test_targets():
    assert parse_targets("v, q") == ("q", "v")
    assert parse_targets("q_proj,down_proj") == ("q", "down")
    assert parse_targets("all") == ("q", "k", "v", "o", "gate", "up", "down")
    model = base_model()
    replaced = attach_lora(model, LoraConfig(rank=2, targets="q,v"))
    assert replaced == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qv"]
    wrapped = {n for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    assert wrapped == set(replaced)
    with pytest.raises(NanoforgeError, match="unknown LoRA target 'qq'; valid targets: q, k, v, o, gate, up, down"):
        LoraConfig(targets="q,qq")
    with pytest.raises(NanoforgeError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(NanoforgeError, match="already has LoRA adapters"):
        attach_lora(model, LoraConfig(rank=2))
    cfg = LoraConfig(rank=8, alpha=4.0, dropout=0.0, targets=("up", "q"))
    assert LoraConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["lora_targets"] == "q,up"


class ToyBatches:
    """Deterministic, resumable next-token batches: the batch at position i depends only on i."""

    def __init__(self, vocab, batch_size=2, seq_len=16):
        self.vocab, self.batch_size, self.seq_len, self.pos = vocab, batch_size, seq_len, 0

    def next_batch(self):
        g = torch.Generator().manual_seed(1000 + self.pos)
        self.pos += 1
        ids = torch.randint(0, self.vocab, (self.batch_size, self.seq_len + 1), generator=g)
        return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def run_lora(run_dir, base_file, resume=False, max_steps=4):
    mcfg = ModelConfig(**TINY)
    tcfg = TrainConfig(max_steps=max_steps, seq_len=16, batch_size=2, lr=1e-2, warmup_steps=1, precision="fp32",
                       device="cpu", eval_every=0, log_every=1, save_every=2, keep_last=5, tensorboard=False)
    gpt = GPT(mcfg)
    gpt.load_weights(load_file(str(base_file)))  # the base is always loaded; a resume restores adapters only
    lcfg = LoraConfig(rank=4, dropout=0.1)  # dropout on: resume must restore the RNG too
    model = LoraModel(gpt, lcfg)
    run_info = {"stage": "lora", **lcfg.to_dict(), **adapter_metadata(base_file, gpt)}
    stage = Stage("lora", ToyBatches(mcfg.vocab_size), causal_lm_loss, run_info=run_info)
    return train(stage, model, mcfg, tcfg, run_dir, resume=resume, quiet=True), model


def test_lora_runs_through_the_training_loop_with_adapter_only_checkpoints(tmp_path):
    base = base_model()
    base_file = tmp_path / "base.safetensors"
    save_file(base.state_dict_for_save(), str(base_file))
    summary, model = run_lora(tmp_path / "straight", base_file)
    assert summary["step"] == 4
    last = ckpt.latest_checkpoint(tmp_path / "straight")
    saved = load_file(str(last / "model.safetensors"))
    assert set(saved) == set(lora_state_dict(model)) and all(".lora_" in k for k in saved)
    assert not torch.equal(saved["model.layers.0.self_attn.q_proj.lora_B.weight"], torch.zeros(32, 4))
    base_sd = base.state_dict_for_save()
    for k, v in model.gpt.state_dict_for_save().items():  # the base never moved
        if ".lora_" not in k:
            assert torch.equal(v, base_sd[k]), k

    # resume from step 2 == the uninterrupted run, bit for bit
    shutil.copytree(tmp_path / "straight", tmp_path / "split")
    for step in ("step_000003", "step_000004"):
        shutil.rmtree(tmp_path / "split" / "checkpoints" / step, ignore_errors=True)
    run_lora(tmp_path / "split", base_file, resume=True)
    resumed = load_file(str(ckpt.latest_checkpoint(tmp_path / "split") / "model.safetensors"))
    assert resumed.keys() == saved.keys()
    for k in saved:
        assert torch.equal(resumed[k], saved[k]), k

    # the adapter checkpoint loads onto its recorded base, merged into a plain GPT
    x = tokens()
    merged = load_adapter_checkpoint(tmp_path / "straight")
    assert not any(isinstance(m, LoraLinear) for m in merged.modules())
    torch.testing.assert_close(merged(x), model.eval()(x), atol=1e-5, rtol=0)
    other = tmp_path / "other.safetensors"
    save_file(base_model(seed=5).state_dict_for_save(), str(other))
    with pytest.raises(NanoforgeError, match="adapter was trained on base"):
        load_adapter_checkpoint(tmp_path / "straight", base=other)


def test_lora_run_recomputes_blocks_under_activation_checkpointing(tmp_path):
    """The loop's --activation-checkpointing reaches the GPT inside the LoRA wrapper: every block runs twice per
    step (forward, then the recompute in backward), and the adapters end equal to a run without it."""
    base = base_model()
    base_file = tmp_path / "base.safetensors"
    save_file(base.state_dict_for_save(), str(base_file))
    calls, adapters = {}, {}
    for on in (False, True):
        mcfg = ModelConfig(**TINY)
        tcfg = TrainConfig(max_steps=2, seq_len=16, batch_size=2, lr=1e-2, warmup_steps=1, precision="fp32",
                           device="cpu", eval_every=0, log_every=1, save_every=0, tensorboard=False,
                           activation_checkpointing=on)
        torch.manual_seed(0)  # the same adapter initialisation both times
        gpt = GPT(mcfg)
        gpt.load_weights(load_file(str(base_file)))
        model = LoraModel(gpt, LoraConfig(rank=4, dropout=0.1))
        count = []
        gpt.model.layers[0].register_forward_pre_hook(lambda *a, count=count: count.append(1))  # recompute re-enters it
        train(Stage("lora", ToyBatches(mcfg.vocab_size), causal_lm_loss), model, mcfg, tcfg, tmp_path / str(on),
              quiet=True)
        calls[on], adapters[on] = len(count), lora_state_dict(model)
    assert calls == {False: 2, True: 4}
    for k, v in adapters[False].items():
        torch.testing.assert_close(adapters[True][k], v, rtol=0, atol=1e-6)


def test_a_model_without_the_training_interface_is_refused(tmp_path):
    mcfg = ModelConfig(**TINY)
    tcfg = TrainConfig(max_steps=1, seq_len=16, batch_size=2, device="cpu", tensorboard=False)
    with pytest.raises(NanoforgeError, match="Linear cannot be trained by this loop: a model must offer "
                                             "activation_checkpointing, flops_per_token"):
        train(Stage("x", ToyBatches(mcfg.vocab_size), causal_lm_loss), torch.nn.Linear(2, 2), mcfg, tcfg, tmp_path)
