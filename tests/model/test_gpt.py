"""The transformer: parameter names and counts, RoPE/YaRN against independent formulas, KV-cache and
left-padding parity with a plain forward, causality, checkpoint round trips, dropout, and that it learns."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from nanoforge.core.config import PRESETS, ModelConfig, build_config
from nanoforge.core.errors import NanoforgeError
from nanoforge.model import GPT, KVCache
from nanoforge.model.gpt import RotaryEmbedding, apply_rope, rope_inv_freq

VOCAB = 97


def tiny_cfg(**overrides) -> ModelConfig:
    # init_std 0.1 rather than 0.02 so attention is far from uniform and a wrong position or mask shows
    # up well above the 1e-5 tolerance.
    base = dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, init_std=0.1)
    return ModelConfig(**{**base, **overrides})


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_cfg(**overrides)).eval()


def hf_llama_names(n_layers: int, qk_norm: bool = False) -> set[str]:
    """The parameter names of HF LlamaForCausalLM (Qwen3ForCausalLM with qk_norm), written out by hand."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        if qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


# ----------------------------------------------------------------------------------------------------------
# names, counts, init


def test_mini_param_count_and_hf_names():
    with torch.device("meta"):  # shapes only: no 26M-parameter init
        model = GPT(ModelConfig())
    # By hand: d=512, 8 layers, 8 heads of 64, 2 kv heads (k/v width 128), ffn ceil(512*8/3 / 64)*64 = 1408.
    attn = 512 * 512 + 512 * 128 + 512 * 128 + 512 * 512  # q, k, v, o
    mlp = 3 * 512 * 1408  # gate, up, down
    norms = 2 * 512
    embed = 6400 * 512  # tied with lm_head: counted once
    expected = embed + 8 * (attn + mlp + norms) + 512
    assert expected == 25_829_888
    assert model.num_params() == expected
    assert model.num_params(exclude_embeddings=True) == expected - embed
    # 6N with the tied output projection counted as a matmul, plus attention at full length.
    assert model.flops_per_token(512) == 6 * expected + 12 * 8 * 512 * 512

    assert set(model.state_dict()) == hf_llama_names(8)
    assert set(dict(model.named_parameters())) == hf_llama_names(8) - {"lm_head.weight"}  # tied: one tensor
    assert not [n for n, _ in model.named_buffers() if n in model.state_dict()]  # RoPE tables not saved
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (128, 512)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (512, 1408)


def test_qk_norm_adds_qwen3_names_and_untied_head_counts():
    model = tiny_model(qk_norm=True, tie_embeddings=False)
    assert set(model.state_dict()) == hf_llama_names(2, qk_norm=True)
    assert tuple(model.model.layers[1].self_attn.k_norm.weight.shape) == (16,)  # head_dim
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    # untied: the head is its own 97 x 64 matrix; exclude_embeddings removes only the input table
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params() == total
    assert model.num_params(exclude_embeddings=True) == total - VOCAB * 64
    assert not any(".bias" in n for n in model.state_dict())


def test_init_weights():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=8, vocab_size=1000)
    model = GPT(cfg)
    std = lambda p: p.float().std().item()  # noqa: E731
    assert std(model.model.embed_tokens.weight) == pytest.approx(0.02, rel=0.05)
    assert std(model.model.layers[3].self_attn.q_proj.weight) == pytest.approx(0.02, rel=0.05)
    assert std(model.model.layers[3].self_attn.o_proj.weight) == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(16)
    assert std(model.model.layers[3].mlp.down_proj.weight) == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.all(model.model.layers[3].input_layernorm.weight == 1)
    assert torch.all(model.model.norm.weight == 1)


# ----------------------------------------------------------------------------------------------------------
# RoPE and YaRN against independent implementations


def test_rope_matches_complex_rotation():
    cfg = ModelConfig(d_model=512, n_heads=8, max_seq_len=512, rope_theta=1e4)
    hd, half, T = 64, 32, 512
    rope = RotaryEmbedding(cfg)
    assert rope.cos.shape == (T, hd) and rope.cos.dtype == torch.float32
    torch.manual_seed(0)
    x = torch.randn(2, 3, T, hd)
    out = apply_rope(x, rope.cos, rope.sin).double()

    # Channel pair (i, i + hd/2) is the complex number x_i + j x_{i+hd/2}, turned by pos * theta^(-2i/hd).
    freqs = 1e4 ** (-np.arange(half) * 2.0 / hd)
    angle = np.outer(np.arange(T), freqs)  # (T, hd/2) float64
    z = (x[..., :half].double().numpy() + 1j * x[..., half:].double().numpy()) * np.exp(1j * angle)
    expected = torch.from_numpy(np.concatenate([z.real, z.imag], axis=-1))
    # float32 angles at position 511 are off by ~3e-5 rad (HF computes them the same way); a wrong layout,
    # sign or frequency is off by O(1).
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=0)
    torch.testing.assert_close(out[:, :, 0], x[:, :, 0].double())  # position 0 is not rotated


def yarn_reference(hd: int, base: float, factor: float, original_max: int) -> np.ndarray:
    """YaRN's NTK-by-parts frequencies as HF defines them (beta_fast 32, beta_slow 1, truncated bounds),
    written as a plain loop in float64."""
    def dim_for_rotations(r):  # the pair index whose wavelength fits r times into the original context
        return hd * math.log(original_max / (2 * math.pi * r)) / (2 * math.log(base))
    low = max(math.floor(dim_for_rotations(32)), 0)
    high = min(math.ceil(dim_for_rotations(1)), hd - 1)
    out = []
    for i in range(hd // 2):
        theta = base ** (-2 * i / hd)
        interp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep theta, 1: theta / factor
        out.append(theta * (1 - interp) + theta / factor * interp)
    return np.array(out)


@pytest.mark.parametrize("factor, original, max_seq", [(4.0, 512, 512), (2.0, 0, 64), (8.0, 256, 1024)])
def test_yarn_inv_freq_matches_formula(factor, original, max_seq):
    cfg = ModelConfig(d_model=512, n_heads=8, max_seq_len=max_seq, rope_scaling_factor=factor,
                      rope_original_max_seq_len=original)
    inv_freq, attention_factor = rope_inv_freq(cfg)
    expected = yarn_reference(64, 1e4, factor, original or max_seq)
    np.testing.assert_allclose(inv_freq.double().numpy(), expected, rtol=1e-6)
    # the fastest pairs are untouched and the slowest fully interpolated
    assert expected[0] == 1.0 and expected[-1] == pytest.approx(1e4 ** (-62 / 64) / factor)
    assert attention_factor == pytest.approx(0.1 * math.log(factor) + 1)

    rope = RotaryEmbedding(cfg)
    assert rope.cos.shape[0] == int(max_seq * factor)
    p = rope.cos.shape[0] - 1
    angle = p * torch.from_numpy(expected)
    torch.testing.assert_close(rope.cos[p].double(), torch.cat([angle.cos(), angle.cos()]) * attention_factor,
                               atol=1e-3, rtol=0)
    torch.testing.assert_close(rope.sin[0], torch.zeros(64))


def test_rope_tables_survive_dtype_casts_and_meta_init():
    reference = tiny_model()
    cos = reference.model.rotary_emb.cos.clone()
    half = tiny_model().to(torch.bfloat16)
    assert half.model.rotary_emb.cos.dtype == torch.float32  # a bf16 table would be degrees off
    torch.testing.assert_close(half.model.rotary_emb.cos, cos, atol=0, rtol=0)

    with torch.device("meta"):
        model = GPT(tiny_cfg())
    model.to_empty(device="cpu")
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # to_empty unties them...
    model.load_weights(reference.state_dict_for_save())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # ...and loading re-ties
    model.init_weights()
    torch.testing.assert_close(model.model.rotary_emb.cos, cos, atol=0, rtol=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # so does init_weights
    assert model.model.norm.weight.eq(1).all() and model.model.embed_tokens.weight.std() > 0.05
    model.load_weights(reference.state_dict_for_save())
    ids = torch.randint(0, VOCAB, (1, 8))
    torch.testing.assert_close(model.eval()(ids), reference(ids), atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------------
# the whole forward against a plain float64 re-implementation


def reference_logits(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """HF Llama/Qwen3's forward written out naively in float64 from the model's weights: explicit softmax,
    k/v heads repeated as HF's repeat_kv does (query head h reads kv head h // group), RoPE as complex
    rotation of pairs (i, i + hd/2), YaRN frequencies from `yarn_reference`."""
    cfg = model.cfg
    W = {k: v.double() for k, v in model.state_dict().items()}
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    B, T = ids.shape

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    if cfg.rope_scaling_factor > 1:
        freqs = torch.from_numpy(yarn_reference(hd, cfg.rope_theta, cfg.rope_scaling_factor,
                                                cfg.rope_original_max_seq_len or cfg.max_seq_len))
        scale = 0.1 * math.log(cfg.rope_scaling_factor) + 1
    else:
        freqs, scale = cfg.rope_theta ** (-torch.arange(hd // 2, dtype=torch.float64) * 2 / hd), 1.0
    turn = torch.polar(torch.full((T, hd // 2), scale, dtype=torch.float64),
                       torch.arange(T, dtype=torch.float64)[:, None] * freqs)  # (T, hd/2) complex

    def rope(x):  # (B, heads, T, hd)
        z = torch.complex(x[..., :hd // 2], x[..., hd // 2:]) * turn
        return torch.cat([z.real, z.imag], dim=-1)

    x = W["model.embed_tokens.weight"][ids]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).view(B, T, H, hd)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).view(B, T, Hkv, hd)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).view(B, T, Hkv, hd)
        if cfg.qk_norm:
            q, k = rms(q, W[p + "self_attn.q_norm.weight"]), rms(k, W[p + "self_attn.k_norm.weight"])
        q, k, v = rope(q.transpose(1, 2)), rope(k.transpose(1, 2)), v.transpose(1, 2)
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(future, float("-inf"))
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * hd)
        x = x + att @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        gate, up = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ W[p + "mlp.down_proj.weight"].T
    x = rms(x, W["model.norm.weight"])
    return x @ W["lm_head.weight"].T


@pytest.mark.parametrize("extra", [{}, {"qk_norm": True, "tie_embeddings": False},
                                   {"rope_scaling_factor": 4.0, "rope_original_max_seq_len": 16},
                                   {"n_kv_heads": 1, "norm_eps": 0.1}],
                         ids=["plain", "qk_norm+untied", "yarn", "mqa+eps"])
def test_forward_matches_float64_reference(extra):
    model = tiny_model(**extra)
    with torch.no_grad():  # non-trivial norm gains, so a skipped or misplaced norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = model(ids)
    torch.testing.assert_close(logits.double(), reference_logits(model, ids), atol=1e-4, rtol=0)


def test_rmsnorm_float32_then_gain_in_input_dtype():
    from nanoforge.model.gpt import RMSNorm
    norm = RMSNorm(8, eps=0.5)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x = torch.randn(3, 8) * 0.3  # small enough that eps matters
    expected = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 0.5) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), expected, atol=1e-6, rtol=0)
    # HF's order in bf16: normalise in float32, cast to bf16, then scale (so a float32 gain gives float32)
    xb = x.bfloat16()
    hf = norm.weight * (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 0.5)).bfloat16()
    torch.testing.assert_close(norm(xb), hf, atol=1e-6, rtol=0)


def test_rmsnorm_under_autocast_casts_once_to_the_same_values():
    # The residual stream's norm hands bf16 to its matmuls (which would each cast it); QK-norm's bf16 input
    # gives float32, as before. Forward values are those of the float32 norm cast by autocast.
    from nanoforge.model.gpt import RMSNorm
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_b = norm(x), norm(x.bfloat16())
    assert out.dtype == torch.bfloat16 and out_b.dtype == torch.float32
    assert torch.equal(out, norm(x).bfloat16())
    assert torch.equal(out_b, norm(x.bfloat16()))


def test_left_padding_positions_count_real_tokens():
    # RoPE is relative, so a constant shift per row hardly moves the logits: check the positions themselves.
    model = tiny_model()
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    cos, _, allowed, _ = model._positions_and_mask(3, 2, 3, mask, torch.device("cpu"))  # tokens 3..4 of 5
    table = model.model.rotary_emb.cos
    for row, positions in enumerate([[1, 2], [3, 4], [0, 0]]):
        torch.testing.assert_close(cos[row, 0], table[positions], atol=0, rtol=0)
    assert allowed.shape == (3, 1, 2, 5)
    assert allowed[0, 0].tolist() == [[False, False, True, True, False], [False, False, True, True, True]]
    assert allowed[2, 0, 0].tolist() == [False, False, False, True, False]  # padding sees itself: no NaN row


# ----------------------------------------------------------------------------------------------------------
# KV cache, left padding, causality


@pytest.mark.parametrize("extra", [{}, {"qk_norm": True}, {"qk_norm": True, "rope_scaling_factor": 4.0}],
                         ids=["plain", "qk_norm", "qk_norm+yarn"])
@pytest.mark.parametrize("chunks", [[10] + [1] * 30, [7, 5, 1, 13, 1, 1, 12]], ids=["decode", "chunked"])
def test_kv_cache_matches_full_forward(extra, chunks):
    model = tiny_model(**extra)
    T = sum(chunks)
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)  # (2, T, V)
        cache = model.new_cache(2, max_len=T)
        pieces, pos = [], 0
        for n in chunks:
            pieces.append(model(ids[:, pos:pos + n], cache=cache))
            pos += n
    assert cache.length == T
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)


def test_kv_cache_overflow_and_batch_check():
    model = tiny_model()
    cache = model.new_cache(1, max_len=8)
    assert isinstance(cache, KVCache) and cache.k[0].shape == (1, 2, 8, 16)
    with torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
        with pytest.raises(NanoforgeError, match="overflow"):
            model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
        assert cache.length == 6  # the failed call changed nothing
        with pytest.raises(NanoforgeError, match="batch size"):
            model(torch.zeros(2, 1, dtype=torch.long), cache=cache)
        cache = model.new_cache(1, max_len=8)
        ids = torch.randint(0, VOCAB, (1, 8))
        torch.testing.assert_close(model(ids, cache=cache), model(ids), atol=1e-5, rtol=0)
    with pytest.raises(NanoforgeError, match="longer than"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_left_padded_batch_matches_prompts_alone():
    model = tiny_model()
    g = torch.Generator().manual_seed(2)
    lengths, steps = [3, 9, 6, 1], 4
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    L, B = max(lengths), len(lengths)
    # padding slots hold random tokens, not a pad id: the mask alone must hide them
    ids = torch.randint(0, VOCAB, (B, L), generator=g)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = p
        mask[b, L - len(p):] = 1
    continuation = torch.randint(0, VOCAB, (B, steps), generator=g)

    with torch.no_grad():
        cache = model.new_cache(B, max_len=L + steps)
        logits = model(ids, cache=cache, attention_mask=mask)
        assert torch.isfinite(logits).all()  # padded positions too: no all-masked NaN rows
        last = [logits[:, -1]]
        for s in range(steps):
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
            last.append(model(continuation[:, s:s + 1], cache=cache, attention_mask=mask)[:, -1])
        # the same batch without a cache, mask over the whole sequence
        no_cache = model(torch.cat([ids, continuation], dim=1), attention_mask=mask)

        for b, p in enumerate(prompts):
            alone = model(torch.cat([p, continuation[b]])[None])[0]  # (len + steps, V)
            for s in range(steps + 1):
                torch.testing.assert_close(last[s][b], alone[len(p) - 1 + s], atol=1e-5, rtol=0)
            torch.testing.assert_close(no_cache[b, L - len(p):], alone, atol=1e-5, rtol=0)


def test_a_prefill_computes_each_distinct_prompt_once():
    """RL samples G replies to each prompt: the prefill runs the blocks on the distinct rows only (a row that
    differs only by its padding counts as distinct) and caches every row's keys and values, so decoding then
    gives each row what it alone would."""
    model = tiny_model()
    g = torch.Generator().manual_seed(3)
    p, q = torch.randint(1, VOCAB, (5,), generator=g), torch.randint(1, VOCAB, (5,), generator=g)
    ids = torch.stack([p, p, q, p, q, torch.cat([torch.tensor([0]), q[1:]])])
    mask = torch.ones_like(ids)
    mask[5, 0] = 0  # the same tokens as a left-padded q[1:], which is another prompt
    seen = []
    model.model.embed_tokens.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[0]))
    nxt = torch.randint(1, VOCAB, (6, 1), generator=g)
    with torch.no_grad():
        cache = model.new_cache(6, max_len=8)
        first = model(ids, cache=cache, attention_mask=mask)
        second = model(nxt, cache=cache, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1))
        assert seen == [3, 6] and cache.length == 6
        for b in range(6):
            real = ids[b][mask[b].bool()]
            alone = model(torch.cat([real, nxt[b]])[None])[0]
            torch.testing.assert_close(first[b, -1], alone[-2], atol=1e-5, rtol=0)
            torch.testing.assert_close(second[b, -1], alone[-1], atol=1e-5, rtol=0)


def test_attention_mask_shape_is_checked():
    model = tiny_model()
    cache = model.new_cache(2, max_len=16)
    with pytest.raises(NanoforgeError, match="attention_mask has shape"):
        model(torch.zeros(2, 4, dtype=torch.long), cache=cache, attention_mask=torch.ones(2, 5))


def test_causal_future_tokens_do_not_change_the_past():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[:, 12] = (ids[:, 12] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=0, rtol=0)
    assert (a[:, 12:] - b[:, 12:]).abs().amax(-1).min() > 1e-4  # every later position sees the change


def test_bf16_autocast_with_float32_cache():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(ids)
        cache = model.new_cache(2)  # float32, the parameters' dtype
        steps = torch.cat([model(ids[:, :8], cache=cache)] + [model(ids[:, i:i + 1], cache=cache)
                                                              for i in range(8, 12)], dim=1)
    assert full.dtype == torch.bfloat16
    torch.testing.assert_close(steps.float(), full.float(), atol=0.1, rtol=0.05)


# ----------------------------------------------------------------------------------------------------------
# checkpoints


def test_tied_save_load_roundtrip(tmp_path):
    model = tiny_model(seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sd = model.state_dict_for_save()
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd
    save_file(sd, tmp_path / "model.safetensors")  # refuses shared tensors: this is why lm_head is dropped

    other = tiny_model(seed=1)
    ids = torch.randint(0, VOCAB, (2, 10))
    assert not torch.equal(other(ids), model(ids))
    other.load_weights(load_file(tmp_path / "model.safetensors"))
    assert other.lm_head.weight is other.model.embed_tokens.weight  # still tied after loading
    torch.testing.assert_close(other(ids), model(ids), atol=0, rtol=0)
    # a full state_dict, with the tied head stored twice, loads too
    other.load_weights(model.state_dict())


def test_untied_roundtrip_keeps_the_head():
    model = tiny_model(seed=0, tie_embeddings=False)
    sd = model.state_dict_for_save()
    assert "lm_head.weight" in sd
    other = tiny_model(seed=1, tie_embeddings=False)
    other.load_weights(sd)
    ids = torch.randint(0, VOCAB, (1, 5))
    torch.testing.assert_close(other(ids), model(ids), atol=0, rtol=0)
    with pytest.raises(NanoforgeError, match="lm_head.weight is missing"):
        other.load_weights(tiny_model().state_dict_for_save())  # a tied checkpoint has no head


def test_load_weights_rejects_mismatches():
    model = tiny_model()
    wrong_kv = tiny_model(n_kv_heads=4).state_dict_for_save()
    with pytest.raises(NanoforgeError) as e:
        model.load_weights(wrong_kv)
    assert ("model.layers.0.self_attn.k_proj.weight has shape (64, 64) in the checkpoint, (32, 64) in the model"
            in str(e.value))

    sd = model.state_dict_for_save()
    missing = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    with pytest.raises(NanoforgeError, match="model.norm.weight is missing"):
        model.load_weights(missing)
    with pytest.raises(NanoforgeError, match="model.layers.2.mlp.up_proj.weight is in the checkpoint but not"):
        model.load_weights({**sd, "model.layers.2.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(NanoforgeError, match="its own lm_head.weight"):
        model.load_weights({**sd, "lm_head.weight": torch.zeros(VOCAB, 64)})
    with pytest.raises(NanoforgeError, match="q_norm.weight is missing"):
        tiny_model(qk_norm=True).load_weights(sd)


def test_packed_rows_by_segments_equal_the_block_diagonal_mask():
    """On a CPU packed rows attend segment by segment (gpt.Segments); the logits and every gradient equal
    those of the (B, 1, T, T) block-diagonal mask the layout spells out (a 1-token segment, padding as -1)."""
    seg = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14,
                        [0] * 5 + [1] + [2] * 40 + [-1] * 18,
                        [0] * 64])
    ids = torch.randint(0, VOCAB, seg.shape, generator=torch.Generator().manual_seed(3))
    results = []
    for by_mask in (False, True):
        model = tiny_model().train()
        layout = GPT._packed_layout(seg) if by_mask else None
        logits = model(ids, segment_ids=None if by_mask else seg, layout=layout)
        logits.float().square().mean().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()]))
    (spans, span_grads), (masked, mask_grads) = results
    torch.testing.assert_close(spans, masked, atol=1e-5, rtol=1e-4)
    for a, b in zip(span_grads, mask_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------
# dropout and learning


def test_dropout_only_in_training():
    model = tiny_model(dropout=0.2)
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(ids), atol=0, rtol=0)
        model.train()
        a, b = model(ids), model(ids)
    assert not torch.allclose(a, b)


def test_attn_dropout_apart_from_the_residual_dropout():
    """attn_dropout -1 is dropout's value; 0 keeps the residual branches' dropout and takes it off attention
    alone (same seed, same residual masks: only attention's draw can make the two runs differ)."""
    ids = torch.randint(0, VOCAB, (2, 16))
    outs = {}
    for attn in (-1.0, 0.0, 0.2):
        model = tiny_model(dropout=0.2, attn_dropout=attn).train()
        assert model.model.layers[0].self_attn.dropout == (0.2 if attn == -1.0 else attn)
        torch.manual_seed(5)
        outs[attn] = model(ids)
    torch.testing.assert_close(outs[-1.0], outs[0.2], atol=0, rtol=0)
    assert not torch.allclose(outs[0.0], outs[0.2])
    model = tiny_model(dropout=0.0, attn_dropout=0.0).train()
    torch.testing.assert_close(model(ids), model(ids), atol=0, rtol=0)  # no dropout anywhere


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(tiny_cfg(init_std=0.02)).train()
    ids = torch.randint(0, VOCAB, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.1)  # small init: near-uniform predictions
    assert losses[-1] < 0.5, losses[::10]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("variant", [{}, {"tie_embeddings": False}, {"qk_norm": True, "n_kv_heads": 1},
                                     {"n_experts": 3, "experts_per_token": 2}, {"ffn_hidden": 96}])
def test_the_config_counts_the_parameters_its_gpt_has(preset, variant):
    """ModelConfig.num_params (what `nanoforge report` prints, without torch) equals the built GPT's count, for
    every preset tied and untied, with qk_norm, with experts, with an explicit SwiGLU width."""
    cfg = build_config(preset, overrides={**variant, "vocab_size": 300})[0]
    with torch.device("meta"):
        model = GPT(cfg)
    assert cfg.num_params() == model.num_params()
    assert cfg.num_params(exclude_embeddings=True) == model.num_params(exclude_embeddings=True)
    assert cfg.num_params() - cfg.num_params(exclude_embeddings=True) == 300 * cfg.d_model
