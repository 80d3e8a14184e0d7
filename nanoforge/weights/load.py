"""One way from a path to a model, for every caller: chat, serve, eval, export, the demo and the stages' --init.

    RUN/                              a run directory: its latest checkpoint
    RUN/checkpoints/step_NNNNNN/      one checkpoint (weights/checkpoint.py's format)
    a LoRA run or checkpoint          adapters, put on the base recorded in state.json (checked), merged
    an HF directory                   config.json, model.safetensors, tokenizer.json (weights/hf.py)
    MiniMind's FILE.pth               a state dict from its trainers' out/, with --tokenizer DIR (weights/minimind.py)

`load_model` turns any of them into (GPT in eval mode, its tokenizer, the path loaded); `init_config`,
`init_tokenizer_dir` and `init_weights` read the same paths piecewise for a stage's --init. A LoRA run records
its base (`adapter_metadata`: the path and sha256 of the base model.safetensors and a fingerprint of the base
tensors), and `check_base` refuses any other base."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from nanoforge.core.checksums import sha256_of
from nanoforge.core.config import MODEL_FIELDS, ModelConfig
from nanoforge.core.errors import NanoforgeError
from nanoforge.weights.hf import is_hf_dir, model_config_from_hf, read_hf_config, read_hf_weights
from nanoforge.model.gpt import GPT
from nanoforge.model.lora import LoraConfig, LoraModel, sampled_weights_fingerprint
from nanoforge.chat.tokenizer import load_tokenizer
from nanoforge.weights import checkpoint as ckpt
from nanoforge.weights.minimind import config_from_state_dict, is_pth, pth_tokenizer_dir, read_pth

CRITIC_PREFIX = "critic."  # a PPO checkpoint's critic keys (rl/critic.py, which must not be imported here)


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """A run directory, checkpoint, LoRA run or HF directory -> (model in eval mode, its tokenizer, the path).

    The model's shape comes from the config saved in the checkpoint and the weights load strictly; the
    tokenizer is the run's own copy (RUN/tokenizer), so what generates is what was trained."""
    if is_hf_dir(path):
        model, tokenizer = load_hf_model(path)
        return model.to(device).eval(), tokenizer, Path(path)
    if is_pth(path):
        model, tokenizer = load_pth_model(path)
        return model.to(device).eval(), tokenizer, Path(path)
    path = ckpt.resolve_checkpoint(path)
    state = ckpt.load_state(path)
    if "base_sha256" in state.get("run", {}):  # a LoRA run: adapters on a recorded base, merged into a plain GPT
        model = load_adapter_checkpoint(path)
    else:
        model = GPT(ModelConfig(**_saved_model_fields(path, state)))
        model.load_weights(policy_only(ckpt.load_weights_file(path)))
    tokenizer_dir = init_tokenizer_dir(path)
    if not tokenizer_dir.is_dir():
        raise NanoforgeError(f"{tokenizer_dir}: the run's tokenizer is missing")
    return model.to(device).eval(), load_tokenizer(tokenizer_dir), path


def _saved_model_fields(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    saved = state.get("config", {}).get("model", {})
    unknown = set(saved) - set(MODEL_FIELDS)
    if unknown:
        raise NanoforgeError(f"{path / 'state.json'}: unknown model config fields {sorted(unknown)}")
    return saved


def load_hf_model(hf_dir: str | Path, device: str | torch.device = "cpu"):
    """An HF Llama- or Qwen3-shaped directory -> (GPT in eval mode, Tokenizer)."""
    hf_dir = Path(hf_dir)
    cfg = model_config_from_hf(read_hf_config(hf_dir), hf_dir / "config.json")
    model = GPT(cfg)
    try:
        model.load_weights(read_hf_weights(hf_dir))
    except NanoforgeError as e:
        raise NanoforgeError(f"{hf_dir}: {e}") from None
    if not (hf_dir / "tokenizer.json").is_file():
        raise NanoforgeError(f"{hf_dir}: no tokenizer.json (only fast, tokenizer.json-based tokenizers load)")
    tokenizer = load_tokenizer(hf_dir)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise NanoforgeError(f"{hf_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                             f"vocab_size is {cfg.vocab_size}")
    return model.to(device).eval(), tokenizer


def load_pth_model(pth: str | Path):
    """A MiniMind `.pth` and the tokenizer paired with it -> (GPT, Tokenizer), the vocabulary checked."""
    weights = read_pth(pth)
    model = GPT(config_from_state_dict(weights, pth))
    try:
        model.load_weights(weights)
    except NanoforgeError as e:
        raise NanoforgeError(f"{pth}: {e}") from None
    tokenizer_dir = pth_tokenizer_dir(pth)
    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise NanoforgeError(f"{tokenizer_dir}: the tokenizer has {tokenizer.vocab_size} tokens but {pth} has "
                             f"{model.cfg.vocab_size} embeddings; pass the tokenizer it was trained with")
    return model, tokenizer


def load_adapter_checkpoint(path: str | Path, base: str | Path | None = None) -> nn.Module:
    """An adapter checkpoint (or LoRA run directory) -> the base GPT with the adapters merged in, in eval mode.
    The base is `base` if given, else the one recorded in the checkpoint; either way `check_base` must accept it."""
    path = ckpt.resolve_checkpoint(path)
    state = ckpt.load_state(path)
    run = state.get("run", {})
    if "base_sha256" not in run:
        raise NanoforgeError(f"{path}: not a LoRA adapter checkpoint (state.json has no base reference)")
    saved = _saved_model_fields(path, state)
    base_file = _base_file(base if base is not None else run["base_checkpoint"])
    check_base(run, base_file)
    gpt = GPT(ModelConfig(**saved))
    gpt.load_weights(read_base_weights(base_file))
    model = LoraModel(gpt, LoraConfig.from_dict(run))
    model.load_weights(ckpt.load_weights_file(path))
    return model.eval().merged()


# ------------------------------------------------------------------------- Which base an adapter belongs to

def _base_file(base_checkpoint: str | Path) -> Path:
    """A model.safetensors or MiniMind .pth file, a checkpoint directory or a run directory -> the weights file."""
    path = Path(base_checkpoint)
    return path if path.is_file() else ckpt.resolve_checkpoint(path) / "model.safetensors"


def read_base_weights(path: Path) -> dict[str, torch.Tensor]:
    return read_pth(path) if is_pth(path) else ckpt.read_weights(path)


def file_sha256(path: str | Path) -> str:
    try:
        return sha256_of(path)
    except OSError as e:
        raise NanoforgeError(f"{path}: cannot read the base model weights: {e.strerror or e}") from None


def adapter_metadata(base_checkpoint: str | Path, base_weights: dict[str, torch.Tensor] | nn.Module) -> dict[str, str]:
    """What an adapter checkpoint records about its base (flat strings, for config.toml and state.json)."""
    path = _base_file(base_checkpoint)
    return {"base_checkpoint": str(path.resolve()), "base_sha256": file_sha256(path),
            "base_fingerprint": sampled_weights_fingerprint(base_weights)}


def check_base(meta: dict[str, Any], base_checkpoint: str | Path) -> None:
    """Refuse to put an adapter on a base other than the one it was trained on.

    The same file (sha256) passes at once; a different file passes only when its tensors have the base's
    fingerprint (the same weights re-saved or moved)."""
    for key in ("base_sha256", "base_fingerprint"):
        if key not in meta:
            raise NanoforgeError(f"the adapter's metadata has no {key}; cannot tell which base it was trained on")
    path = _base_file(base_checkpoint)
    sha = file_sha256(path)
    if sha != meta["base_sha256"] and sampled_weights_fingerprint(read_base_weights(path)) != meta["base_fingerprint"]:
        raise NanoforgeError(f"adapter was trained on base {meta.get('base_checkpoint', '?')} "
                             f"(sha256 {meta['base_sha256'][:12]}), not {path} (sha256 {sha[:12]}); "
                             f"give the base it was trained on")


# ----------------------------------------------------------------------------------------- A stage's --init

def init_config(init: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint (HF model directory, MiniMind .pth) --init points at, and the config it was trained with."""
    if is_hf_dir(init) or is_pth(init):
        path = Path(init)
        m = config_from_state_dict(read_pth(path), path) if is_pth(path) else \
            model_config_from_hf(read_hf_config(path), path / "config.json")
        return path, {"model": dataclasses.asdict(m), "train": {"seq_len": min(512, m.max_seq_len)}}
    path = ckpt.resolve_checkpoint(init)
    return path, ckpt.load_state(path).get("config", {})


def init_tokenizer_dir(init_path: Path) -> Path:
    """An HF directory's own tokenizer, a .pth's paired one, or the RUN/tokenizer of a checkpoint RUN/checkpoints/N."""
    if is_pth(init_path):
        return pth_tokenizer_dir(init_path)
    return init_path if is_hf_dir(init_path) else init_path.parent.parent / "tokenizer"


def init_weights(init_path: Path):
    """Weights of --init: a checkpoint's model.safetensors, an HF directory's or a .pth's (strictly mapped later)."""
    if is_pth(init_path):
        return read_pth(init_path)
    return read_hf_weights(init_path) if is_hf_dir(init_path) else policy_only(ckpt.load_weights_file(init_path))


def policy_only(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's weights without a PPO run's critic (rl/critic.py saves it under CRITIC_PREFIX beside the
    policy's unchanged keys): what chat, eval, export and a later stage's --init read is the policy."""
    return {k: v for k, v in weights.items() if not k.startswith(CRITIC_PREFIX)}
