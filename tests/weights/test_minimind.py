"""MiniMind's weights both ways, against MiniMind's own model code (../shared/anchors/minimind, run beside ours):
its .pth state dicts (fp32 and fp16, dense and MoE) and its MiniMindForCausalLM directories load with its logits;
`export --format minimind` writes what its class loads strictly; the presets have its parameter counts."""
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoforge.core.config import build_config
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.gpt import GPT
from nanoforge.weights.load import load_model
from nanoforge.weights.minimind import pair_tokenizer, read_pth

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mm(minimind_code):
    """MiniMind's model module, loaded from its file (its package name `model` would clash on sys.path)."""
    spec = importlib.util.spec_from_file_location("minimind_model", minimind_code / "model" / "model_minimind.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mm_tokenizer(shared_data) -> Path:
    return shared_data / "minimind-tokenizer"


def minimind_model(mm, seed: int = 0, **config):
    """A small MiniMind model from its own class, with varied weights (norm gains too, so they matter)."""
    torch.manual_seed(seed)
    model = mm.MiniMindForCausalLM(mm.MiniMindConfig(hidden_size=64, num_hidden_layers=2, **config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model


def cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "nanoforge", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


IDS = torch.randint(0, 6400, (2, 29), generator=torch.Generator().manual_seed(1))


def test_presets_have_minimind_3s_parameter_counts():
    """The shape arithmetic of MiniMind-3 (embedding + 8 x (attention + SwiGLU 2432 + norms) + final norm)."""
    d, ffn, kv, layers, vocab = 768, math.ceil(768 * math.pi / 64) * 64, 4 * 96, 8, 6400
    attn = 2 * d * d + 2 * d * kv + 2 * 96
    dense = vocab * d + layers * (attn + 3 * d * ffn + 2 * d) + d
    moe = vocab * d + layers * (attn + 4 * 3 * d * ffn + 4 * d + 2 * d) + d
    assert GPT(build_config("minimind-3")[0]).num_params() == dense == 63_912_192
    assert GPT(build_config("minimind-3-moe")[0]).num_params() == moe == 198_416_640


def test_presets_match_minimind_own_model(mm):
    for preset, moe in (("minimind-3", False), ("minimind-3-moe", True)):
        theirs = mm.MiniMindForCausalLM(mm.MiniMindConfig(use_moe=moe))
        ours = GPT(build_config(preset)[0])
        assert ours.num_params() == sum(p.numel() for p in theirs.parameters())
        assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_pth_loads_with_minimind_logits(tmp_path, mm, mm_tokenizer, moe, dtype):
    theirs = minimind_model(mm, use_moe=moe)
    path = tmp_path / f"full_sft_64{'_moe' if moe else ''}.pth"
    torch.save({k: v.to(dtype) for k, v in theirs.state_dict().items()}, path)
    theirs.load_state_dict(torch.load(path), strict=True)  # as MiniMind's eval_llm.py does: fp16 into its model
    pair_tokenizer(path, mm_tokenizer)
    ours, tokenizer, _ = load_model(path)
    assert tokenizer.vocab_size == 6400 and ours.cfg.n_experts == (4 if moe else 0)
    for key, value in torch.load(path).items():  # the same values (fp16 ones exactly, in float32)
        assert torch.equal(ours.state_dict()[key], value.float()), key
    with torch.no_grad():
        diff = (theirs(IDS).logits - ours(IDS)).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.parametrize("moe", [False, True])
def test_a_minimind_transformers_directory_loads(tmp_path, mm, mm_tokenizer, moe):
    theirs = minimind_model(mm, seed=2, use_moe=moe)
    theirs.save_pretrained(tmp_path / "hf", safe_serialization=False)  # what its convert_model.py writes
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).write_bytes((mm_tokenizer / name).read_bytes())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "minimind"
    ours, _, _ = load_model(tmp_path / "hf")
    with torch.no_grad():
        assert (theirs(IDS).logits - ours(IDS)).abs().max().item() <= 1e-4


def test_export_minimind_round_trips_through_its_class(tmp_path, mm, mm_tokenizer):
    for moe in (False, True):
        theirs = minimind_model(mm, seed=3, use_moe=moe)
        src = tmp_path / f"src{int(moe)}.pth"
        torch.save(theirs.state_dict(), src)
        cli("export", src, "--tokenizer", mm_tokenizer, "--format", "minimind", "--dtype", "f32",
            "--out", tmp_path / f"out{int(moe)}")
        written = tmp_path / f"out{int(moe)}" / f"full_sft_64{'_moe' if moe else ''}.pth"
        back = mm.MiniMindForCausalLM(mm.MiniMindConfig(hidden_size=64, num_hidden_layers=2, use_moe=moe)).eval()
        back.load_state_dict(torch.load(written), strict=True)
        with torch.no_grad():
            assert torch.equal(back(IDS).logits, theirs(IDS).logits)
    fp16 = cli("export", src, "--tokenizer", mm_tokenizer, "--format", "minimind", "--out", tmp_path / "h.pth")
    assert {v.dtype for v in torch.load(tmp_path / "h.pth").values()} == {torch.float16}, fp16.stdout
    again = cli("export", src, "--tokenizer", mm_tokenizer, "--format", "minimind", "--out", tmp_path / "h.pth",
                check=False)
    assert again.returncode == 1 and "already exists" in again.stderr


def test_a_model_minimind_cannot_build_is_refused_by_name(tmp_path, tmp_path_factory, tiny_tokenizer):
    from test_generate import make_tiny_run
    run = make_tiny_run(tmp_path_factory, tiny_tokenizer)
    r = cli("export", run, "--format", "minimind", "--out", tmp_path / "x.pth", check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "n_kv_heads 2 (MiniMind: 4)" in r.stderr and "qk_norm False (MiniMind: True)" in r.stderr
    assert not (tmp_path / "x.pth").exists()


@pytest.mark.parametrize("preset, width", [("minimind-3", 128), ("minimind-3", 384), ("minimind-3", 1024),
                                           ("minimind-3-moe", 256)])
def test_a_changed_width_derives_what_minimind_derives(mm, preset, width):
    """--preset minimind-3 --d-model W is MiniMindConfig(hidden_size=W): the SwiGLU width (ceil(W pi / 64) x 64)
    and head_dim follow the width in MiniMind's code and in ours (built on the meta device: shapes only)."""
    with torch.device("meta"):
        theirs = mm.MiniMindForCausalLM(mm.MiniMindConfig(hidden_size=width, use_moe=preset.endswith("moe")))
        ours = GPT(build_config(preset, overrides={"d_model": width})[0])
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


@pytest.mark.slow
def test_a_narrower_minimind_3_trains_and_exports(tmp_path, tiny_tokenizer):
    """`pretrain --preset minimind-3 --d-model 64` derives its SwiGLU width from the width, as MiniMind does
    (ceil(64 pi / 64) x 64 = 256; the 768-wide model's 2432 was kept before), so `export --format minimind`
    takes the run; --ffn-hidden given explicitly still wins."""
    from conftest import prepare_tiny
    data = prepare_tiny(tmp_path / "data", tiny_tokenizer)
    fast = ["--n-layers", 1, "--vocab-size", 6400, "--max-steps", 1, "--seq-len", 16, "--batch-size", 2,
            "--eval-every", 0, "--sample-every", 0, "--tensorboard", "false", "--precision", "fp32", "--device",
            "cpu", "--quiet"]
    cli("pretrain", "--data", data, "--out", tmp_path / "run", "--preset", "minimind-3", "--d-model", 64, *fast)
    cli("export", tmp_path / "run", "--format", "minimind", "--out", tmp_path / "x.pth")
    weights = torch.load(tmp_path / "x.pth")
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (256, 64)
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (8,)  # 8 heads of 64 / 8
    cli("pretrain", "--data", data, "--out", tmp_path / "set", "--preset", "minimind-3", "--d-model", 64,
        "--ffn-hidden", 192, *fast)
    r = cli("export", tmp_path / "set", "--format", "minimind", "--out", tmp_path / "y.pth", check=False)
    assert r.returncode == 1 and "ffn_dim 192 (MiniMind: 256)" in r.stderr


def test_sft_eval_and_generate_take_a_pth(tmp_path, mm, mm_tokenizer, shared_data):
    theirs = minimind_model(mm, seed=4)
    pth = tmp_path / "pretrain_64.pth"
    torch.save({k: v.half() for k, v in theirs.state_dict().items()}, pth)
    sft_data = shared_data / "tiny" / "sft_tiny.jsonl"
    cli("sft", "--init", pth, "--tokenizer", mm_tokenizer, "--data", sft_data, "--out", tmp_path / "ft",
        "--max-steps", 1, "--lr", 1e-12, "--warmup-steps", 0, "--batch-size", 2, "--seq-len", 64,
        "--eval-every", 0, "--tensorboard", "false", "--precision", "fp32", "--quiet")
    start = read_pth(pth)
    trained, _, _ = load_model(tmp_path / "ft")
    for key, value in trained.state_dict().items():  # an lr of 1e-12 leaves --init's weights as they were
        torch.testing.assert_close(value, start[key], atol=1e-6, rtol=0)
    assert (tmp_path / "ft" / "tokenizer" / "tokenizer.json").read_bytes() == \
        (mm_tokenizer / "tokenizer.json").read_bytes()
    ev = cli("eval", pth, "--tokenizer", mm_tokenizer, "--data", sft_data, "--seq-len", 64, "--max-tokens", 2000)
    assert "loss" in ev.stdout
    gen = cli("generate", pth, "--tokenizer", mm_tokenizer, "--prompt", "hello", "--max-new-tokens", 4,
              "--temperature", 0)
    assert gen.stdout.startswith("hello")


def test_a_wrong_pth_gets_a_clear_error(tmp_path, mm_tokenizer):
    cases = {
        "list.pth": ([torch.zeros(2)], "not a state dict"),
        "other.pth": ({"encoder.weight": torch.zeros(2, 2)}, "model.embed_tokens.weight is missing"),
        "short.pth": ({"model.embed_tokens.weight": torch.zeros(6400, 64),
                       "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64),
                       "model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 64),
                       "model.layers.0.mlp.gate_proj.weight": torch.zeros(256, 64)}, "is missing from the checkpoint"),
    }
    for name, (obj, _) in cases.items():
        torch.save(obj, tmp_path / name)
    (tmp_path / "junk.pth").write_bytes(b"not a zip or a pickle")
    cases["junk.pth"] = (None, "not a state dict that torch.load reads")
    for name, (_, message) in cases.items():
        r = cli("eval", tmp_path / name, "--tokenizer", mm_tokenizer, "--data", tmp_path / "none.jsonl", check=False)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"{tmp_path / name}" in r.stderr and message in r.stderr, r.stderr


def test_a_pth_without_a_tokenizer_says_which_to_pass(tmp_path, tiny_tokenizer_dir):
    torch.manual_seed(0)
    model = GPT(build_config("tiny", overrides={"vocab_size": 50})[0])
    torch.save(model.state_dict(), tmp_path / "m.pth")
    with pytest.raises(NanoforgeError, match="holds no tokenizer; pass --tokenizer DIR"):
        load_model(tmp_path / "m.pth")
    pair_tokenizer(tmp_path / "m.pth", tiny_tokenizer_dir)  # more tokens than the 50 embeddings
    with pytest.raises(NanoforgeError, match="tokens but .* has 50 embeddings"):
        load_model(tmp_path / "m.pth")


class Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pth_with_code_in_its_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "x": Payload(marker)}, tmp_path / "evil.pth")
    with open(tmp_path / "evil.pth", "rb") as f:
        torch.load(f, weights_only=False)  # the premise: loaded unsafely, the payload runs
    assert marker.exists()
    marker.unlink()
    with pytest.raises(NanoforgeError, match="not a state dict that torch.load reads as plain tensors"):
        read_pth(tmp_path / "evil.pth")
    assert not marker.exists()


def test_hf_export_ends_a_reply_at_eos_token_id(tmp_path, mm_tokenizer):
    """MiniMind's eval_llm.py generates with `eos_token_id=tokenizer.eos_token_id`: our export names <|im_end|>,
    so a reply stops at its turn's end. The weights make <|im_end|> every position's likeliest next token."""
    transformers = pytest.importorskip("transformers")
    cfg = build_config("tiny", overrides={"vocab_size": 6400})[0]
    model = GPT(cfg)
    from nanoforge.chat.tokenizer import load_tokenizer
    tok = load_tokenizer(mm_tokenizer)
    with torch.no_grad():
        for block in model.model.layers:  # blocks add nothing: the stream is the token's embedding
            block.self_attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        direction = torch.randn(cfg.d_model)
        emb.copy_(0.01 * torch.randn_like(emb) + direction)
        emb[tok.im_end_id] = 3 * direction
    from nanoforge.weights.export import write_hf_dir
    write_hf_dir(model, tok, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.pad_token == "<|endoftext|>"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)])
    out = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=hf_tok.eos_token_id,
                      pad_token_id=hf_tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 1 and out[0, -1].item() == tok.im_end_id


def test_lora_on_a_pth_keeps_its_base(tmp_path, mm, mm_tokenizer, shared_data):
    """A LoRA run records the .pth as its base (path, sha256, fingerprint) and loads on it later."""
    pth = tmp_path / "full_sft_64.pth"
    torch.save(minimind_model(mm, seed=5).state_dict(), pth)
    cli("lora", "--init", pth, "--tokenizer", mm_tokenizer, "--data", shared_data / "tiny" / "sft_tiny.jsonl",
        "--out", tmp_path / "lora", "--max-steps", 1, "--batch-size", 2, "--seq-len", 64, "--eval-every", 0,
        "--tensorboard", "false", "--precision", "fp32", "--quiet")
    config = (tmp_path / "lora" / "config.toml").read_text()
    assert str(pth.resolve()) in config and "base_sha256" in config
    gen = cli("generate", tmp_path / "lora", "--prompt", "hi", "--max-new-tokens", 2, "--temperature", 0)
    assert gen.stdout.startswith("hi")
    torch.save(minimind_model(mm, seed=6).state_dict(), pth)  # another base under the same name is refused
    r = cli("generate", tmp_path / "lora", "--prompt", "hi", "--max-new-tokens", 2, check=False)
    assert r.returncode == 1 and "adapter was trained on base" in r.stderr


def test_minimind_eval_llm_stops_our_export_at_the_reply_end(tmp_path, minimind_code, mm_tokenizer):
    """MiniMind's own eval_llm.py, run on our HF export: it generates with eos_token_id=tokenizer.eos_token_id,
    so its reply ends at <|im_end|> only if our tokenizer_config names it. The weights spell a reply "A": the
    generation prompt's last token -> "A" -> <|im_end|>, and <|im_end|> -> "B" -> <|im_end|> for a run that does
    not stop there (blocks add nothing; the untied head reads each token's own direction)."""
    from nanoforge.chat.tokenizer import load_tokenizer
    from nanoforge.weights.export import write_hf_dir
    tok = load_tokenizer(mm_tokenizer)
    model = GPT(build_config("tiny", overrides={"vocab_size": 6400, "tie_embeddings": False})[0])
    last = tok.encode("\n\n")[-1]  # MiniMind-3's generation prompt ends "<think>\n\n</think>\n\n"
    a, b, end = tok.encode("A")[0], tok.encode("B")[0], tok.im_end_id
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.copy_(0.01 * torch.randn_like(emb))
        head.zero_()
        for i, (token, following) in enumerate([(last, a), (a, end), (end, b), (b, end)]):
            emb[token, i] = 1.0
            head[following, i] = 10.0
    write_hf_dir(model, tok, tmp_path / "export")
    proc = subprocess.run([sys.executable, str(minimind_code / "eval_llm.py"), "--load_from", str(tmp_path / "export"),
                           "--device", "cpu", "--max_new_tokens", "6", "--show_speed", "0"], input="1\nhi\n\n",
                          capture_output=True, text=True, cwd=minimind_code, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reply = proc.stdout.split("🧠: ", 1)[1].split("\n", 1)[0]
    assert reply == "A", proc.stdout


@pytest.mark.parametrize("fused", [False, True])
def test_minimind_moe_as_qwen3_moe_loads(tmp_path, mm, mm_tokenizer, fused):
    """MiniMind-3-MoE converted to Qwen3-MoE (its convert_model.py): transformers 5 names the expert count
    num_local_experts, and a state dict may hold the experts fused (gate_up_proj (E, 2F, C), down_proj (E, C, F))."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    theirs = minimind_model(mm, seed=7, use_moe=True)
    c = theirs.config
    qwen = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, max_position_embeddings=32768,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=True, num_experts=4,
        num_experts_per_tok=1, moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=True))
    qwen.save_pretrained(tmp_path / "q")
    weights = {k: v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    if fused:
        for layer in range(c.num_hidden_layers):
            p = f"model.layers.{layer}.mlp.experts"
            gates = torch.stack([weights.pop(f"{p}.{e}.gate_proj.weight") for e in range(4)])
            ups = torch.stack([weights.pop(f"{p}.{e}.up_proj.weight") for e in range(4)])
            weights[f"{p}.gate_up_proj"] = torch.cat([gates, ups], dim=1)
            weights[f"{p}.down_proj"] = torch.stack([weights.pop(f"{p}.{e}.down_proj.weight") for e in range(4)])
    assert set(load_file(tmp_path / "q" / "model.safetensors")) == set(weights) or fused
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "q" / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "q" / name).write_bytes((mm_tokenizer / name).read_bytes())
    ours, _, _ = load_model(tmp_path / "q")
    with torch.no_grad():
        assert (theirs(IDS).logits - ours(IDS)).abs().max().item() <= 1e-4


def test_tokenizer_flag_without_a_pth_is_refused(tmp_path, tmp_path_factory, tiny_tokenizer, tiny_tokenizer_dir):
    from test_generate import make_tiny_run
    r = cli("generate", make_tiny_run(tmp_path_factory, tiny_tokenizer), "--tokenizer", tiny_tokenizer_dir,
            "--prompt", "a", check=False)
    assert r.returncode == 1 and "--tokenizer is for a model given as a MiniMind .pth" in r.stderr
