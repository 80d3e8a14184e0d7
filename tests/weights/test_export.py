"""Export: an HF directory that real `transformers` loads strictly and that computes our logits, greedy tokens
and chat prompts; the import back; and a GGUF file whose tensors, metadata and vocabulary read back right."""
import json

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from conftest import prepare_tiny
from nanoforge.chat.template import without_generation_markers
from nanoforge.core.config import ModelConfig
from nanoforge.core.errors import NanoforgeError
from nanoforge.weights.export import export_gguf, export_hf, gguf_pre_tokenizer, permute_for_llama_cpp, write_gguf, write_hf_dir
from nanoforge.weights.hf import is_hf_dir
from nanoforge.weights.load import load_hf_model
from nanoforge.model.gpt import GPT
from nanoforge.chat.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "春天来了吗？"}]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_tokenizer):
    """A real tiny run: prepared data and a few fp32 pretraining steps."""
    from nanoforge.recipes.pretrain import pretrain

    root = tmp_path_factory.mktemp("export_run")
    prepare_tiny(root / "data", tiny_tokenizer)
    pretrain([str(root / "data")], root / "run", preset="tiny", quiet=True,
             overrides={"max_steps": 12, "tensorboard": False, "eval_every": 0, "seq_len": 32,
                        "precision": "fp32", "warmup_steps": 2})
    return root / "run"


@pytest.fixture(scope="module")
def ours(run_dir):
    from nanoforge.weights.load import load_model
    model, tokenizer, _ = load_model(run_dir)
    return model, tokenizer


@pytest.fixture(scope="module")
def hf_dir(run_dir, tmp_path_factory):
    return export_hf(run_dir, tmp_path_factory.mktemp("hf") / "export")


def load_hf(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True,
                                                                    dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def batch(vocab, T=24, B=3, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def assert_same_logits(model, hf_model, ids):
    with torch.no_grad():
        ours_, theirs = model(ids).float(), hf_model(ids).logits.float()
    assert theirs.shape == ours_.shape
    diff = (ours_ - theirs).abs().max().item()
    assert diff < 1e-4, diff


def random_model(**overrides) -> GPT:
    """A small model with weights far from init (wide normal weights, uneven norm gains), so that a wrong
    layout, a missing norm or a wrong RoPE shows up in the logits."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{**dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                max_seq_len=64, init_std=0.15), **overrides})
    model = GPT(cfg)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


# ---------------------------------------------------------------------------------------------- HF export


def test_hf_dir_loads_strictly_and_gives_our_logits(ours, hf_dir):
    model, tokenizer = ours
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert is_hf_dir(hf_dir) and not is_hf_dir(hf_dir.parent)
    hf_model = load_hf(hf_dir)
    assert_same_logits(model, hf_model, batch(model.cfg.vocab_size))


def test_hf_greedy_generation_matches_ours(ours, hf_dir):
    from nanoforge.infer.generate import SamplingConfig, generate
    model, tokenizer = ours
    hf_model = load_hf(hf_dir)
    stops = [tokenizer.im_end_id, tokenizer.eos_id]
    for text in ("Once upon a time", "春天来了"):
        prompt = tokenizer.encode(text)
        mine = generate(model, [prompt], SamplingConfig(temperature=0, max_new_tokens=20), stop_ids=stops)[0]
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
        theirs = out.tolist()
        if theirs and theirs[-1] in stops:  # HF returns the stop token, ours does not
            theirs = theirs[:-1]
        assert theirs == mine and len(mine) >= 5, (theirs, mine)


def test_hf_tokenizer_and_chat_template_match(ours, hf_dir):
    model, tokenizer = ours
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ids, _ = tokenizer.render_chat(CHAT, add_generation_prompt=True)
    theirs = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    if hasattr(theirs, "keys"):  # transformers 5 returns a BatchEncoding
        theirs = theirs["input_ids"]
    assert list(theirs) == ids
    assert hf_tok.encode("hello 世界", add_special_tokens=False) == tokenizer.encode("hello 世界")


def test_generation_config_stops_at_im_end(ours, hf_dir):
    _, tokenizer = ours
    gen = transformers.GenerationConfig.from_pretrained(str(hf_dir))
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert tokenizer.im_end_id in eos and tokenizer.eos_id in eos
    assert gen.pad_token_id == tokenizer.pad_id


def test_generate_takes_the_tokenizers_output_and_one_end_token(ours, hf_dir):
    """What a transformers user writes first: model.generate(**tokenizer(text, return_tensors="pt")). The tokenizer
    gives no token_type_ids (generate refuses them), and config.json, the tokenizer and generation_config.json
    (first of its stops) name the same end token, <|im_end|>."""
    _, tokenizer = ours
    hf_model, hf_tok = load_hf(hf_dir), transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    inputs = hf_tok("Once upon a time", return_tensors="pt")
    assert set(inputs) == {"input_ids", "attention_mask"}
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 1 and out.shape[1] > inputs["input_ids"].shape[1]
    gen = transformers.GenerationConfig.from_pretrained(str(hf_dir))
    assert hf_model.config.eos_token_id == hf_tok.eos_token_id == tokenizer.im_end_id == gen.eos_token_id[0]


@pytest.mark.parametrize("variant", [dict(qk_norm=True), dict(rope_scaling_factor=4.0),
                                     dict(tie_embeddings=False), dict(qk_norm=True, rope_scaling_factor=2.0)],
                         ids=["qwen3", "yarn", "untied", "qwen3-yarn"])
def test_hf_variants_give_our_logits(variant, tiny_tokenizer, tmp_path):
    model = random_model(**variant)
    out = write_hf_dir(model, tiny_tokenizer, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM" if variant.get("qk_norm") else "LlamaForCausalLM"]
    hf_model = load_hf(out)
    # with YaRN, go well past the original context so the scaled frequencies matter
    T = 200 if variant.get("rope_scaling_factor", 1) >= 4 else 48
    assert_same_logits(model, hf_model, batch(model.cfg.vocab_size, T=T, B=2))
    # and the import back gives exactly our model
    back, _ = load_hf_model(out)
    assert back.cfg.qk_norm == model.cfg.qk_norm and back.cfg.tie_embeddings == model.cfg.tie_embeddings
    ids = batch(model.cfg.vocab_size, T=T, B=2, seed=1)
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))


def test_moe_export_needs_qk_norm(tiny_tokenizer, tmp_path):
    model = random_model(n_experts=4, experts_per_token=2)
    with pytest.raises(NanoforgeError, match="MoE export not supported yet"):
        write_hf_dir(model, tiny_tokenizer, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_qwen3_moe_export_gives_our_logits(tiny_tokenizer, tmp_path):
    model = random_model(n_experts=4, experts_per_token=2, qk_norm=True)
    out = write_hf_dir(model, tiny_tokenizer, tmp_path / "hf")
    assert_same_logits(model, load_hf(out), batch(model.cfg.vocab_size, T=32, B=2))
    back, _ = load_hf_model(out)
    ids = batch(model.cfg.vocab_size, T=16, B=2)
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))


def test_existing_output_is_refused_unless_forced(run_dir, hf_dir):
    with pytest.raises(NanoforgeError, match="not empty"):
        export_hf(run_dir, hf_dir)
    before = (hf_dir / "model.safetensors").stat().st_mtime_ns
    export_hf(run_dir, hf_dir, force=True)
    assert (hf_dir / "model.safetensors").stat().st_mtime_ns >= before
    assert not [p for p in hf_dir.parent.iterdir() if p.name.startswith(".tmp-")]


# ---------------------------------------------------------------------------------------------- HF import


def test_import_roundtrip_gives_identical_logits(ours, hf_dir):
    model, tokenizer = ours
    back, back_tok = load_hf_model(hf_dir)
    ids = batch(model.cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
    assert back_tok.sha256 == tokenizer.sha256 and back_tok.chat_template == tokenizer.chat_template


@pytest.mark.parametrize("field, value, message", [
    ("attention_bias", True, "attention_bias"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}, "rope type 'llama3'"),
    ("head_dim", 32, "head_dim"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("model_type", "gpt2", "model_type"),
])
def test_import_refuses_unsupported_config(hf_dir, tmp_path, field, value, message):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config[field] = value
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(NanoforgeError, match=message):
        load_hf_model(bad)


def test_import_names_mismatched_weights(hf_dir, tmp_path):
    import shutil
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    weights = load_file(str(bad / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(weights, str(bad / "model.safetensors"))
    (bad / "checksums.sha256").unlink()  # weights rewritten on purpose (else: "the file is corrupted or was replaced")
    with pytest.raises(NanoforgeError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing.*q_proj\.bias"):
        load_hf_model(bad)


# ---------------------------------------------------------------------------------------------- GGUF


def test_permutation_matches_llama_cpp_rope_layout():
    """Rotating HF-permuted q by adjacent pairs (llama.cpp) equals rotating the original by halves (HF)."""
    from nanoforge.model.gpt import apply_rope
    n_heads, hd, d = 2, 8, 16
    w = torch.randn(n_heads * hd, d)
    x = torch.randn(5, d)
    angles = torch.randn(5, hd // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    hf = apply_rope((x @ w.T).view(5, n_heads, hd).transpose(0, 1), cos, sin)  # (H, T, hd), halves layout
    q = (x @ permute_for_llama_cpp(w, n_heads).T).view(5, n_heads, hd).transpose(0, 1)
    even, odd = q[..., 0::2], q[..., 1::2]
    rot = torch.stack((even * angles.cos() - odd * angles.sin(), even * angles.sin() + odd * angles.cos()), -1)
    rot = rot.flatten(-2)  # adjacent-pairs layout
    # same vectors up to the fixed channel order: compare their dot products (what attention sees)
    assert torch.allclose(hf @ hf.transpose(-1, -2), rot @ rot.transpose(-1, -2), atol=1e-4)


def gguf_logits(path, ids: list[int]) -> torch.Tensor:
    """A llama forward written from llama.cpp's conventions alone: GGUF tensor names and metadata, RoPE on
    adjacent channel pairs (its LLAMA_ROPE_TYPE_NORM), query head h reading key/value head h // group.
    It stands in for llama.cpp (not installable here); it computes our logits only if the export is right."""
    import gguf
    reader = gguf.GGUFReader(str(path))

    def field(key):
        return reader.fields[key].contents()

    W = {t.name: torch.from_numpy(t.data.astype("float32").copy()) for t in reader.tensors}
    H, Hkv = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    eps, base, hd = field("llama.attention.layer_norm_rms_epsilon"), field("llama.rope.freq_base"), \
        field("llama.rope.dimension_count")
    T = len(ids)
    x = W["token_embd.weight"][torch.tensor(ids)]  # (T, C)
    inv = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = (torch.arange(T, dtype=torch.float64)[:, None] * inv[None]).float()[:, None, :]  # (T, 1, hd/2)

    def rope(v):  # (T, n, hd), pairs (2i, 2i+1)
        a, b = v[..., 0::2], v[..., 1::2]
        return torch.stack((a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()), -1).flatten(-2)

    def norm(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(field("llama.block_count")):
        b = f"blk.{i}."
        h = norm(x, W[b + "attn_norm.weight"])
        q = rope((h @ W[b + "attn_q.weight"].T).view(T, H, hd))
        k = rope((h @ W[b + "attn_k.weight"].T).view(T, Hkv, hd)).repeat_interleave(H // Hkv, dim=1)
        v = (h @ W[b + "attn_v.weight"].T).view(T, Hkv, hd).repeat_interleave(H // Hkv, dim=1)
        att = torch.einsum("thd,shd->hts", q, k) / hd ** 0.5
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + torch.einsum("hts,shd->thd", att, v).reshape(T, H * hd) @ W[b + "attn_output.weight"].T
        h = norm(x, W[b + "ffn_norm.weight"])
        x = x + (torch.nn.functional.silu(h @ W[b + "ffn_gate.weight"].T) * (h @ W[b + "ffn_up.weight"].T)) \
            @ W[b + "ffn_down.weight"].T
    x = norm(x, W["output_norm.weight"])
    return x @ W.get("output.weight", W["token_embd.weight"]).T  # (T, V)


def test_gguf_reads_back(run_dir, ours, tmp_path):
    import gguf
    model, tokenizer = ours
    cfg = model.cfg
    out = export_gguf(run_dir, tmp_path / "model.gguf")
    reader = gguf.GGUFReader(str(out))

    def field(key):
        return reader.fields[key].contents()

    assert field("general.architecture") == "llama"
    assert field("llama.context_length") == cfg.max_seq_len
    assert field("llama.embedding_length") == cfg.d_model
    assert field("llama.block_count") == cfg.n_layers
    assert field("llama.feed_forward_length") == cfg.ffn_dim
    assert field("llama.attention.head_count") == cfg.n_heads
    assert field("llama.attention.head_count_kv") == cfg.n_kv_heads
    assert field("llama.rope.dimension_count") == cfg.head_dim
    assert field("llama.rope.freq_base") == pytest.approx(cfg.rope_theta)
    assert field("llama.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.norm_eps)
    assert field("tokenizer.ggml.model") == "gpt2"
    # what llama.cpp needs to tokenize and prompt as we do (benchmarks/gguf_llamacpp.py checks it in llama.cpp):
    # the split pattern of our pre-tokenizer (Qwen2's, "qwen2" in llama.cpp), and no BOS inserted before a prompt
    assert field("tokenizer.ggml.pre") == "qwen2"
    assert field("tokenizer.ggml.add_bos_token") is False
    assert field("tokenizer.ggml.add_eos_token") is False
    tokens = field("tokenizer.ggml.tokens")
    assert tokens == [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)]
    types = field("tokenizer.ggml.token_type")
    assert types[tokenizer.im_end_id] == gguf.TokenType.CONTROL and types[300] == gguf.TokenType.NORMAL
    merges = json.loads(tokenizer.backend.to_str())["model"]["merges"]
    assert len(field("tokenizer.ggml.merges")) == len(merges)
    assert field("tokenizer.ggml.eos_token_id") == tokenizer.eos_id
    assert field("tokenizer.ggml.eot_token_id") == tokenizer.im_end_id
    assert field("tokenizer.chat_template") == without_generation_markers(tokenizer.chat_template)

    tensors = {t.name: t for t in reader.tensors}
    sd = model.state_dict()
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(cfg.n_layers)
        for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                  "ffn_down")}
    assert set(tensors) == expected  # tied: no output.weight
    for name, hf_name in (("token_embd.weight", "model.embed_tokens.weight"),
                          ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
                          ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight")):
        assert torch.equal(torch.from_numpy(tensors[name].data.copy()), sd[hf_name])
    q = torch.from_numpy(tensors["blk.0.attn_q.weight"].data.copy())
    assert torch.equal(q, permute_for_llama_cpp(sd["model.layers.0.self_attn.q_proj.weight"], cfg.n_heads))
    k = torch.from_numpy(tensors["blk.0.attn_k.weight"].data.copy())
    assert torch.equal(k, permute_for_llama_cpp(sd["model.layers.0.self_attn.k_proj.weight"], cfg.n_kv_heads))
    with pytest.raises(NanoforgeError, match="already exists"):
        export_gguf(run_dir, tmp_path)  # a directory means model.gguf inside it
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]

    # the file computes our logits under llama.cpp's conventions
    ids = tokenizer.encode("Once upon a time there was a little robot")
    with torch.no_grad():
        mine = model(torch.tensor([ids]))[0]
    assert (gguf_logits(out, ids) - mine).abs().max().item() < 1e-4


def test_gguf_untied_f16_has_output(tiny_tokenizer, tmp_path):
    import gguf
    model = random_model(tie_embeddings=False)
    out = write_gguf(model, tiny_tokenizer, tmp_path / "m.gguf", dtype="f16")
    tensors = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    assert "output.weight" in tensors
    assert tensors["output.weight"].data.dtype == "float16"
    assert torch.allclose(torch.from_numpy(tensors["output.weight"].data.astype("float32")),
                          model.state_dict()["lm_head.weight"], atol=1e-3)
    ids = list(range(40, 80))
    with torch.no_grad():
        mine = model(torch.tensor([ids]))[0]
    assert (gguf_logits(out, ids) - mine).abs().max().item() < 0.05 * mine.abs().max().item()  # f16 rounding


def test_gguf_pre_tokenizer_names_what_llama_cpp_must_split_with(tiny_tokenizer):
    assert gguf_pre_tokenizer(tiny_tokenizer) == "qwen2"  # what `tokenizer train` writes now
    backend = json.loads(tiny_tokenizer.backend.to_str())
    backend["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                "use_regex": True}  # older nanoforge tokenizers and MiniMind's
    assert gguf_pre_tokenizer(Tokenizer(HFTokenizer.from_str(json.dumps(backend)))) == "gpt-2"
    backend["pre_tokenizer"] = {"type": "Whitespace"}
    with pytest.raises(NanoforgeError, match="no pre-tokenizer matching"):
        gguf_pre_tokenizer(Tokenizer(HFTokenizer.from_str(json.dumps(backend))))
