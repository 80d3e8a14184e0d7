"""Reading HF transformers directories: config.json -> ModelConfig, model.safetensors (or its shards) -> weights.

Llama- and Qwen3-shaped models only, and MiniMind's own MiniMindForCausalLM (Qwen3's computation under other
config names): our parameter names already are HF's (see model/gpt.py), so the weights keep their names, and
`model_config_from_hf` refuses (by field name) anything our model does not compute the same way.
Building a model from such a directory is weights/load.py's; writing one is weights/export.py's."""
import json
import os
from pathlib import Path
from typing import Any

import torch

from nanoforge.core import safejson
from nanoforge.core.config import ConfigError, ModelConfig
from nanoforge.core.errors import NanoforgeError
from nanoforge.core.fsutil import read_json
from nanoforge.weights.checkpoint import read_weights
from nanoforge.weights.minimind import MINIMIND_AUX_COEF, minimind_ffn, read_pth

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def is_hf_dir(path: str | os.PathLike) -> bool:
    """A directory with an HF config.json naming a model type (not one of our run or checkpoint directories)."""
    try:
        config = read_json(Path(path) / "config.json", "config.json")
    except NanoforgeError:  # none, or not JSON: not an HF directory
        return False
    return "model_type" in config or "architectures" in config


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise NanoforgeError(f"{hf_dir}: no config.json; not an HF model directory")
    return read_json(path, "config.json")


def model_config_from_hf(config: dict[str, Any], where: str | os.PathLike = "config.json") -> ModelConfig:
    """Map an HF config onto ModelConfig, or raise a NanoforgeError naming the field we cannot honour.

    Strict on purpose: a feature we silently ignored (a bias, sliding windows, another RoPE scaling) would
    load without complaint and then compute something else than the original model."""
    def fail(field: str, why: str):
        raise NanoforgeError(f"{where}: {field} = {json.dumps(config.get(field))}: {why}")

    def need(field: str):
        if field not in config:
            raise NanoforgeError(f"{where}: {field} is missing")
        return config[field]

    if config.get("model_type") == "minimind":
        config = _from_minimind(config, where)
    model_type = config.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        fail("model_type", f"only {', '.join(HF_ARCHITECTURES)} and minimind models can be imported")
    if config.get("hidden_act", "silu") != "silu":
        fail("hidden_act", "only silu (SwiGLU) is supported")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if config.get(flag):
            fail(flag, "not supported by nanoforge's model")
    if "quantization_config" in config:
        fail("quantization_config", "quantized checkpoints cannot be imported")
    if config.get("pretraining_tp", 1) not in (1, None):
        fail("pretraining_tp", "only 1 is supported")
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    if config.get("head_dim") not in (None, hidden // heads) or hidden % heads:
        fail("head_dim", f"must equal hidden_size / num_attention_heads = {hidden}/{heads}")

    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        fail("partial_rotary_factor", "only full rotary embeddings are supported")
    factor, original = 1.0, 0
    if rope_type == "yarn":
        factor = float(rope.get("factor") or 0)
        original = int(rope.get("original_max_position_embeddings") or 0)
        if factor < 1.0 or original <= 0:
            fail(rope_field, "YaRN needs factor >= 1 and original_max_position_embeddings")
        for key, value in {"beta_fast": 32, "beta_slow": 1, "truncate": True}.items():
            if rope.get(key) not in (None, value):
                fail(rope_field, f"YaRN {key} must be {value} (nanoforge computes YaRN with the paper's defaults)")
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if rope.get(key) is not None:
                fail(rope_field, f"YaRN {key} is not supported")
    elif rope_type != "default":
        fail(rope_field, f"rope type {rope_type!r} is not supported (only default and yarn)")

    n_experts, experts_per_token, ffn = 0, 2, need("intermediate_size")
    if model_type == "qwen3_moe":
        n_experts = config.get("num_experts", config.get("num_local_experts"))  # transformers 5's name: the latter
        n_experts, experts_per_token = n_experts or need("num_experts"), need("num_experts_per_tok")
        ffn = need("moe_intermediate_size")
        if config.get("decoder_sparse_step", 1) != 1:
            fail("decoder_sparse_step", "every layer must be an MoE layer")
        if config.get("mlp_only_layers"):
            fail("mlp_only_layers", "every layer must be an MoE layer")
        if not config.get("norm_topk_prob", False):
            fail("norm_topk_prob", "nanoforge renormalises the top-k routing weights; must be true")

    max_positions = int(need("max_position_embeddings"))
    try:
        cfg = ModelConfig(
            vocab_size=need("vocab_size"), d_model=hidden, n_layers=need("num_hidden_layers"), n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads") or heads, ffn_hidden=ffn,
            # with YaRN our tables span max_seq_len * factor positions and the ramp is fitted on the original
            max_seq_len=original if factor > 1.0 else max_positions, rope_theta=float(theta),
            rope_scaling_factor=factor, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            qk_norm=model_type != "llama", tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            init_std=float(config.get("initializer_range", 0.02)), n_experts=n_experts,
            experts_per_token=experts_per_token,
            moe_aux_weight=float(config.get("router_aux_loss_coef", 0.01)) if n_experts else 0.01)
        cfg.validate()
    except (ConfigError, TypeError) as e:
        raise NanoforgeError(f"{where}: does not map onto a nanoforge model: {e}") from None
    return cfg


def _from_minimind(config: dict[str, Any], where) -> dict[str, Any]:
    """MiniMind's config.json (scripts/convert_model.py's MiniMindForCausalLM) in Qwen3's names, MiniMindConfig's
    defaults filling what it leaves out. Its YaRN (inference_rope_scaling) is its own variant: refused."""
    if config.get("inference_rope_scaling") or config.get("rope_scaling"):
        raise NanoforgeError(f"{where}: inference_rope_scaling: MiniMind's own YaRN variant is not supported")
    hidden, layers = config.get("hidden_size", 768), config.get("num_hidden_layers", 8)
    out = {"vocab_size": 6400, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 32768,
           "intermediate_size": minimind_ffn(hidden), "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "tie_word_embeddings": True, "num_experts": 4, "num_experts_per_tok": 1, "norm_topk_prob": True,
           **{k: v for k, v in config.items() if v is not None}, "hidden_size": hidden, "num_hidden_layers": layers}
    out.pop("rope_parameters", None)
    out["moe_intermediate_size"] = config.get("moe_intermediate_size") or out["intermediate_size"]
    # MiniMind adds each layer's aux loss times its coefficient; ours is the layers' mean times the weight
    out["router_aux_loss_coef"] = config.get("router_aux_loss_coef", MINIMIND_AUX_COEF) * layers
    out["model_type"] = "qwen3_moe" if config.get("use_moe") else "qwen3"
    return out


def read_hf_weights(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors (or of the shards its index lists), as float32, checked (checksums,
    non-finite values). Never a pickle."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if (hf_dir / "model.safetensors").is_file():
        files = [hf_dir / "model.safetensors"]
    elif index.is_file():
        try:
            weight_map = safejson.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = [hf_dir / f for f in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise NanoforgeError(f"{index}: unreadable index ({e})") from None
    elif (hf_dir / "pytorch_model.bin").is_file():  # MiniMind's own exports: read as tensors only, never code
        return read_pth(hf_dir / "pytorch_model.bin")
    else:
        raise NanoforgeError(f"{hf_dir}: no model.safetensors or pytorch_model.bin")
    weights: dict[str, torch.Tensor] = {}
    for f in files:  # each checked against an export's checksums.sha256, when there is one
        weights.update(read_weights(f))
    return split_experts({k: v.to(torch.float32) for k, v in weights.items()})


def split_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts (`mlp.experts.gate_up_proj` (E, 2F, C), `mlp.experts.down_proj` (E, C, F)),
    as MiniMind's convert_model.py writes them, -> one gate/up/down_proj.weight per expert, as our MoE names them."""
    for key in [k for k in weights if k.endswith(".mlp.experts.gate_up_proj")]:
        prefix = key[:-len("gate_up_proj")]
        gate_up, down = weights.pop(key), weights.pop(prefix + "down_proj")
        for e in range(gate_up.shape[0]):
            gate, up = gate_up[e].chunk(2, dim=0)  # (F, C) each
            weights.update({f"{prefix}{e}.gate_proj.weight": gate, f"{prefix}{e}.up_proj.weight": up,
                            f"{prefix}{e}.down_proj.weight": down[e]})
    return weights
