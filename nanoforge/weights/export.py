"""Export a trained model for other tools: an HF transformers directory, a GGUF file for llama.cpp, MiniMind's .pth.

`export_hf` writes a directory that `transformers` loads with `AutoModelForCausalLM`/`AutoTokenizer`
`.from_pretrained`: config.json (LlamaForCausalLM; Qwen3ForCausalLM with QK-norm, Qwen3MoeForCausalLM for a
QK-norm MoE model), model.safetensors (our parameter names are HF's, see model/gpt.py, so they load strictly),
the tokenizer files with the chat template, and generation_config.json. `export_gguf` writes one GGUF file for
llama.cpp (and so Ollama, LM Studio, ...): the weights under llama.cpp's tensor names, the shape as metadata, the
byte-level BPE vocabulary with its merges. `export_minimind` writes MiniMind's own `.pth` (weights/minimind.py),
for its eval_llm.py and `--from_weight`. All read their model through weights/load.py (reading HF directories is
weights/hf.py's), and write under a temporary name renamed into place: a failed export leaves nothing behind.
Each carries the sha256 of its files (core/checksums.py: checksums.sha256 in an HF directory, which transformers
ignores; FILE.sha256 beside a .gguf or .pth), checked where nanoforge reads an export back."""
import contextlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from nanoforge.chat.template import without_generation_markers
from nanoforge.core.checksums import replace_with_checksum, write_dir_checksums
from nanoforge.core.config import ModelConfig
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.dirlock import staged, staged_dir
from nanoforge.core.fsutil import check_out_apart, write_json, writing
from nanoforge.weights.hf import HF_ARCHITECTURES
from nanoforge.weights import checkpoint as ckpt
from nanoforge.weights.load import load_model
from nanoforge.weights.minimind import is_pth, write_pth


# ------------------------------------------------------------------------ HF transformers directory: export

def export_hf(run_or_checkpoint: str | os.PathLike, out_dir: str | os.PathLike, force: bool = False) -> Path:
    """Write the latest checkpoint of a run (or the given checkpoint) as an HF transformers directory."""
    check_out_apart(out_dir, [run_or_checkpoint])
    model, tokenizer, _ = load_model(run_or_checkpoint)
    with writing(out_dir, also=(SafetensorError,)):  # safetensors wraps the OS's error
        return write_hf_dir(model, tokenizer, out_dir, force=force)


def write_hf_dir(model, tokenizer, out_dir: str | os.PathLike, force: bool = False) -> Path:
    """Write an in-memory GPT and its tokenizer as an HF transformers directory (atomically)."""
    from safetensors.torch import save_file

    config = hf_config(model.cfg, tokenizer)  # first: an unsupported model fails before anything is written
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NanoforgeError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise NanoforgeError(f"{out} already exists and is not empty; choose another --out or add --force")
    with staged_dir(out) as tmp:  # one writer; what a killed export left there removed
        write_json(tmp / "config.json", config)
        write_json(tmp / "generation_config.json", generation_config(tokenizer))
        # float32, contiguous, no shared storage (the tied head is left out, as HF does)
        weights = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict_for_save().items()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(tmp)
        hf_tokenizer_config(tmp / "tokenizer_config.json", tokenizer)
        write_dir_checksums(tmp)  # checksums.sha256: transformers ignores it; weights/hf.py checks it
    return out


def hf_eos_id(tokenizer) -> int | None:
    """The end token an export names everywhere (config.json, tokenizer_config.json, first of generation_config's
    stops): <|im_end|>, as MiniMind-3's own, so that tools that stop at `eos_token_id` (MiniMind's eval_llm.py,
    pipelines) end a reply at its turn's end; <|endoftext|> when the tokenizer has no chat tokens. <|endoftext|>
    stays the pad token and the end of a document (generation_config.json stops at both)."""
    return tokenizer.eos_id if tokenizer.im_end_id is None else tokenizer.im_end_id


def hf_tokenizer_config(path: Path, tokenizer) -> None:
    """An export's tokenizer_config.json: its eos_token hf_eos_id's, and model_input_names without token_type_ids
    (transformers' default for a fast tokenizer lists them, and `model.generate(**tokenizer(text))` refuses them;
    MiniMind's own config has that default)."""
    config = json.loads(path.read_text(encoding="utf-8"))
    eos = hf_eos_id(tokenizer)
    write_json(path, {**config, "model_input_names": ["input_ids", "attention_mask"],
                      **({"eos_token": tokenizer.id_to_token(eos)} if eos is not None else {})})


def export_minimind(run_or_checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str = "f16",
                    force: bool = False) -> Path:
    """Write a model as MiniMind's .pth (fp16 as its trainers save, or f32), named for the run's stage when `out`
    is a directory (pretrain_768.pth, full_sft_768.pth, ...)."""
    check_out_apart(out, [run_or_checkpoint])
    model, _, path = load_model(run_or_checkpoint)
    stage = "" if is_pth(path) or not (path / "state.json").is_file() else \
        ckpt.load_state(path).get("run", {}).get("stage", "")
    with writing(out, also=(RuntimeError,)):  # torch.save reports a full disk as a RuntimeError
        return write_pth(model, out, stage, torch.float16 if dtype == "f16" else torch.float32, force)


def hf_config(cfg: ModelConfig, tokenizer) -> dict[str, Any]:
    """config.json for transformers: the architecture our module tree matches, and our shape in HF's names."""
    if cfg.n_experts and not cfg.qk_norm:
        raise NanoforgeError("MoE export not supported yet for models without qk_norm: the only HF MoE "
                             "architecture with our layout (Qwen3-MoE) normalises q and k; train the MoE "
                             "model with --qk-norm true to export it")
    model_type = "qwen3_moe" if cfg.n_experts else "qwen3" if cfg.qk_norm else "llama"
    bos_name = tokenizer.hf_config().get("bos_token")
    config: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        # what the model can attend over: max_seq_len, times the YaRN factor when scaled (as our RoPE tables)
        "max_position_embeddings": int(cfg.max_seq_len * max(1.0, cfg.rope_scaling_factor)),
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": cfg.init_std,
        "bos_token_id": tokenizer.token_to_id(bos_name) if bos_name else None, "eos_token_id": hf_eos_id(tokenizer),
        "pad_token_id": tokenizer.pad_id, "torch_dtype": "float32", "use_cache": True}
    if model_type == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    if model_type == "qwen3_moe":
        config.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                      moe_intermediate_size=cfg.ffn_dim, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=cfg.moe_aux_weight)
    # transformers 5 reads `rope_parameters` (rope_theta inside); 4.x reads `rope_theta` and `rope_scaling`.
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_factor > 1.0:
        # The factor is given explicitly, so transformers uses it as is; max_position_embeddings above equals
        # original * factor whenever rope_original_max_seq_len is 0 (= max_seq_len), so nothing disagrees.
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling_factor,
                "original_max_position_embeddings": cfg.rope_original_max_seq_len or cfg.max_seq_len,
                "beta_fast": 32.0, "beta_slow": 1.0}
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    config["rope_parameters"] = rope
    return config


def generation_config(tokenizer) -> dict[str, Any]:
    """generation_config.json: stop at <|im_end|> (end of an assistant turn) as well as <|endoftext|>.

    Without it `generate` runs to max_length after every reply (MiniMind's exports repeated themselves
    forever because the config named only one of the two)."""
    eos = [i for i in (hf_eos_id(tokenizer), tokenizer.eos_id) if i is not None]
    bos_name = tokenizer.hf_config().get("bos_token")
    config = {"bos_token_id": tokenizer.token_to_id(bos_name) if bos_name else None,
              "eos_token_id": list(dict.fromkeys(eos)), "pad_token_id": tokenizer.pad_id, "do_sample": False}
    with contextlib.suppress(Exception):  # not installed: the field is informational
        config["transformers_version"] = importlib.metadata.version("transformers")
    return config


# ----------------------------------------------------------------------------------------- GGUF (llama.cpp)

def export_gguf(run_or_checkpoint: str | os.PathLike, out_file: str | os.PathLike, dtype: str = "f32",
                force: bool = False) -> Path:
    """Write the latest checkpoint of a run (or the given checkpoint) as one GGUF file, f32 or f16.
    An existing directory as `out_file` gets `model.gguf` inside it."""
    if Path(out_file).is_dir():
        out_file = Path(out_file) / "model.gguf"
    check_out_apart(out_file, [run_or_checkpoint])
    model, tokenizer, _ = load_model(run_or_checkpoint)
    with writing(out_file):
        return write_gguf(model, tokenizer, out_file, dtype=dtype, force=force)


def permute_for_llama_cpp(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of q_proj/k_proj from HF's RoPE layout to llama.cpp's.

    HF rotates channel i of a head with channel i + head_dim/2 (`rotate_half`); llama.cpp's llama architecture
    rotates adjacent channels (2i, 2i+1), the layout of Meta's original checkpoints. Interleaving the two
    halves of each head's rows makes q.k, and so the model, the same. w: (n_heads * head_dim, d_model)."""
    half = w.shape[0] // n_heads // 2
    # rows of a head: [first half | second half] -> (half, 2) pairs -> interleaved
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(model, tokenizer, out_file: str | os.PathLike, dtype: str = "f32", force: bool = False) -> Path:
    """Write an in-memory GPT and its tokenizer as a GGUF file (atomically)."""
    import gguf
    import numpy as np

    cfg = model.cfg
    if cfg.n_experts:
        raise NanoforgeError("GGUF export of MoE models is not supported yet")
    if dtype not in ("f32", "f16"):
        raise NanoforgeError(f"GGUF dtype {dtype!r} is not one of f32, f16")
    out = Path(out_file)
    if out.exists() and not force:
        raise NanoforgeError(f"{out} already exists; choose another --out or add --force")
    # Qwen3's architecture in llama.cpp has the q/k norms and uses HF's RoPE layout (NeoX), so no permutation.
    arch = "qwen3" if cfg.qk_norm else "llama"
    tensors = gguf_tensors(model, permute=arch == "llama")
    with staged(out) as tmp:  # one writer; what a killed export left there removed
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_name(out.stem)
        writer.add_context_length(int(cfg.max_seq_len * max(1.0, cfg.rope_scaling_factor)))
        writer.add_embedding_length(cfg.d_model)
        writer.add_block_count(cfg.n_layers)
        writer.add_feed_forward_length(cfg.ffn_dim)
        writer.add_head_count(cfg.n_heads)
        writer.add_head_count_kv(cfg.n_kv_heads)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_theta)
        writer.add_layer_norm_rms_eps(cfg.norm_eps)
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
        if cfg.rope_scaling_factor > 1.0:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(cfg.rope_scaling_factor)
            writer.add_rope_scaling_orig_ctx_len(cfg.rope_original_max_seq_len or cfg.max_seq_len)
        add_gguf_tokenizer(writer, tokenizer, cfg.vocab_size)
        for name, tensor in tensors.items():
            array = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
            # norms stay f32 (llama.cpp expects 1-D tensors in f32)
            if dtype == "f16" and array.ndim == 2:
                array = array.astype(np.float16)
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        replace_with_checksum(tmp, out)  # and model.gguf.sha256
    return out


def gguf_tensors(model, permute: bool = True) -> dict[str, torch.Tensor]:
    """Our weights under llama.cpp's tensor names (q and k rows permuted for the llama architecture)."""
    cfg = model.cfg
    sd = model.state_dict()
    out = {"token_embd.weight": sd["model.embed_tokens.weight"]}
    for i in range(cfg.n_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if permute:
            q, k = permute_for_llama_cpp(q, cfg.n_heads), permute_for_llama_cpp(k, cfg.n_kv_heads)
        out[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[b + "attn_q.weight"] = q
        out[b + "attn_k.weight"] = k
        out[b + "attn_v.weight"] = sd[p + "self_attn.v_proj.weight"]
        out[b + "attn_output.weight"] = sd[p + "self_attn.o_proj.weight"]
        if cfg.qk_norm:
            out[b + "attn_q_norm.weight"] = sd[p + "self_attn.q_norm.weight"]
            out[b + "attn_k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
        out[b + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[b + "ffn_gate.weight"] = sd[p + "mlp.gate_proj.weight"]
        out[b + "ffn_up.weight"] = sd[p + "mlp.up_proj.weight"]
        out[b + "ffn_down.weight"] = sd[p + "mlp.down_proj.weight"]
    out["output_norm.weight"] = sd["model.norm.weight"]
    if not cfg.tie_embeddings:
        out["output.weight"] = sd["lm_head.weight"]  # absent: llama.cpp reuses token_embd
    return out


def gguf_vocab(tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens in id order, their llama.cpp token types, merges as "a b" strings) for a byte-level BPE."""
    import gguf

    by_id = {i: t for t, i in tokenizer.backend.get_vocab(with_added_tokens=True).items()}
    added = tokenizer.backend.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            if i in added:
                types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
            else:
                types.append(gguf.TokenType.NORMAL)
        else:  # embedding rows past the tokenizer (vocab_size set larger than the tokenizer)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    model = json.loads(tokenizer.backend.to_str()).get("model", {})
    if model.get("type") != "BPE":
        raise NanoforgeError(f"GGUF export needs a BPE tokenizer, this one is {model.get('type')!r}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, [int(t) for t in types], merges


def gguf_pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for how the tokenizer splits text before BPE: "gpt-2" (a ByteLevel pre-tokenizer with
    GPT-2's pattern: older nanoforge tokenizers, MiniMind's) or "qwen2" (SPLIT_PATTERN, as `tokenizer train`
    writes now). Any other pre-tokenizer would be tokenized differently by llama.cpp, so it is refused."""
    if tokenizer.split_pattern is None:
        pre = json.loads(tokenizer.backend.to_str()).get("pre_tokenizer") or {}
        raise NanoforgeError(f"GGUF export: llama.cpp has no pre-tokenizer matching this tokenizer's "
                             f"{pre.get('type')!r} one; only GPT-2's ByteLevel and nanoforge's own (Qwen2's "
                             "pattern) can be exported")
    return tokenizer.split_pattern


def add_gguf_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    tokens, types, merges = gguf_vocab(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(gguf_pre_tokenizer(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    bos_name = tokenizer.hf_config().get("bos_token")
    bos = tokenizer.token_to_id(bos_name) if bos_name else None
    if bos is not None:
        writer.add_bos_token_id(bos)
    if tokenizer.eos_id is not None:
        writer.add_eos_token_id(tokenizer.eos_id)
        writer.add_pad_token_id(tokenizer.pad_id)
    if tokenizer.im_end_id is not None:
        writer.add_eot_token_id(tokenizer.im_end_id)  # end of turn: chat front-ends stop here
    writer.add_add_bos_token(False)  # our prompts never start with an implicit bos
    writer.add_add_eos_token(False)
    writer.add_chat_template(without_generation_markers(tokenizer.chat_template))  # llama.cpp: plain Jinja
