"""MiniMind's own weight files, both ways: the `.pth` state dicts its trainers write to `out/` (`pretrain_768.pth`,
`full_sft_768_moe.pth`, ...: fp16, dense or MoE, under the same parameter names as ours, lm_head stored beside the
embedding it is tied to).

In: read with torch's weights-only unpickler (tensors and plain containers, never code), the shape inferred from
the tensors; what tensors cannot say (RoPE theta, the norm's epsilon, top-k) is MiniMindConfig's default. A `.pth`
holds no tokenizer: `--tokenizer DIR` pairs one with it (`pair_tokenizer`, from the command line), else one is
looked for beside the file and in MiniMind's checkout layout (`out/X.pth` next to `model/tokenizer.json`).
Out: a `.pth` (with FILE.pth.sha256 beside it, checked when nanoforge reads it back) that MiniMind's eval_llm.py
and its trainers' `--from_weight` load strictly; they build
MiniMindConfig(hidden_size, num_hidden_layers, use_moe) with every other field at its default, so the model
must have exactly those defaults (`minimind_mismatches`)."""
import os
import pickle
import re
import zipfile
from pathlib import Path

import torch

from nanoforge.core.checksums import replace_with_checksum, verify_file
from nanoforge.core.config import ConfigError, ModelConfig, derived_ffn
from nanoforge.core.dirlock import staged
from nanoforge.core.errors import NanoforgeError
from nanoforge.weights.checkpoint import check_finite

# MiniMindConfig's defaults (model/model_minimind.py at commit d65ef2c) that a state dict does not show
MINIMIND_ROPE_THETA, MINIMIND_NORM_EPS, MINIMIND_POSITIONS, MINIMIND_AUX_COEF = 1e6, 1e-6, 32768, 5e-4
_WRAPPERS = ("module.", "_orig_mod.")  # DDP's and torch.compile's prefixes, in case a state dict kept them
_TOKENIZERS: dict[Path, Path] = {}  # .pth -> the tokenizer directory its command line gave (pair_tokenizer)


def is_pth(path: str | os.PathLike | None) -> bool:
    return path is not None and str(path).endswith(".pth")


def pair_tokenizer(pth: str | os.PathLike, tokenizer_dir: str | os.PathLike | None) -> None:
    """Record `--tokenizer DIR` as the tokenizer of `pth` for this process (None: look for one)."""
    if tokenizer_dir is not None:
        _TOKENIZERS[Path(pth).resolve()] = Path(tokenizer_dir)


def pth_tokenizer_dir(pth: str | os.PathLike) -> Path:
    """The tokenizer directory of a `.pth`: the paired one, else a tokenizer.json beside it or in ../model."""
    pth = Path(pth)
    given = _TOKENIZERS.get(pth.resolve())
    if given is not None:
        if not (given / "tokenizer.json").is_file():
            raise NanoforgeError(f"--tokenizer {given}: no tokenizer.json there (MiniMind's is in its model/ folder)")
        return given
    for candidate in (pth.parent, pth.parent.parent / "model"):
        if (candidate / "tokenizer.json").is_file():
            return candidate
    raise NanoforgeError(f"{pth}: a MiniMind .pth holds no tokenizer; pass --tokenizer DIR (the model/ folder "
                         "of a MiniMind checkout, github.com/jingyaogong/minimind)")


def read_pth(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A MiniMind `.pth` (or the `model` of its `*_resume.pth`) -> float32 tensors by name. Never runs a pickle."""
    path = Path(path)
    if not path.is_file():
        raise NanoforgeError(f"{path}: no such file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, ValueError, OSError):
        with open(path, "rb") as f:
            head = f.read(2)
        why = ("it holds objects other than tensors, which only an unsafe load (one that can run code) would read"
               if head == b"PK" or head[:1] == b"\x80" else "not a file torch.save writes (truncated or corrupted?)")
        raise NanoforgeError(f"{path}: not a state dict that torch.load reads as plain tensors: {why}") from None
    verify_file(path)  # against FILE.sha256, written by `export --format minimind`
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict) and "optimizer" in obj:
        obj = obj["model"]  # MiniMind's resume file keeps the weights under "model"
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise NanoforgeError(f"{path}: not a state dict (a mapping of parameter names to tensors)")
    out = {}
    for key, tensor in obj.items():
        for prefix in _WRAPPERS:
            key = key.removeprefix(prefix)
        out[str(key)] = tensor.to(torch.float32)
    check_finite(out, path)
    return out


def config_from_state_dict(sd: dict[str, torch.Tensor], where: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a MiniMind state dict, from its tensors' shapes (and MiniMindConfig's defaults)."""
    def need(key: str) -> torch.Tensor:
        if key not in sd:
            raise NanoforgeError(f"{where}: {key} is missing: not a MiniMind model's state dict (its keys are "
                                 "model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, ...)")
        return sd[key]

    vocab, width = need("model.embed_tokens.weight").shape
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if layers != set(range(len(layers))) or not layers:
        raise NanoforgeError(f"{where}: layers {sorted(layers)[:8]}: expected model.layers.0 to model.layers.N-1")
    q_norm = sd.get("model.layers.0.self_attn.q_norm.weight")
    head_dim = q_norm.shape[0] if q_norm is not None else width // 8  # MiniMind's 8 heads without QK-norm
    n_heads = need("model.layers.0.self_attn.q_proj.weight").shape[0] // head_dim
    n_kv = need("model.layers.0.self_attn.k_proj.weight").shape[0] // head_dim
    router = sd.get("model.layers.0.mlp.gate.weight")
    ffn = need("model.layers.0.mlp.experts.0.gate_proj.weight" if router is not None
               else "model.layers.0.mlp.gate_proj.weight").shape[0]
    if n_heads * head_dim != width:
        raise NanoforgeError(f"{where}: {n_heads} heads of {head_dim} do not make hidden size {width}; nanoforge "
                             "needs head_dim = hidden_size / num_attention_heads")
    head = sd.get("lm_head.weight")
    tied = head is None or torch.equal(head, sd["model.embed_tokens.weight"])
    try:
        cfg = ModelConfig(vocab_size=vocab, d_model=width, n_layers=len(layers), n_heads=n_heads, n_kv_heads=n_kv,
                          ffn_hidden=ffn, max_seq_len=MINIMIND_POSITIONS, rope_theta=MINIMIND_ROPE_THETA,
                          norm_eps=MINIMIND_NORM_EPS, qk_norm=q_norm is not None, tie_embeddings=tied,
                          n_experts=router.shape[0] if router is not None else 0, experts_per_token=1,
                          moe_aux_weight=MINIMIND_AUX_COEF * len(layers) if router is not None else 0.01)
        cfg.validate()
    except ConfigError as e:
        raise NanoforgeError(f"{where}: does not map onto a nanoforge model: {e}") from None
    return cfg


def minimind_ffn(d_model: int) -> int:
    """MiniMindConfig's intermediate_size: ceil(hidden * pi / 64) * 64 (config.FFN_RULES' "pi")."""
    return derived_ffn(d_model, "pi")


def minimind_mismatches(cfg: ModelConfig) -> list[str]:
    """How `cfg` differs from MiniMindConfig(hidden_size=d_model, num_hidden_layers=n_layers, use_moe=...)."""
    expected = {"vocab_size": 6400, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": minimind_ffn(cfg.d_model),
                "qk_norm": True, "tie_embeddings": True, "rope_theta": MINIMIND_ROPE_THETA,
                "norm_eps": MINIMIND_NORM_EPS, "rope_scaling_factor": 1.0}
    if cfg.n_experts:
        expected.update(n_experts=4, experts_per_token=1)
    return [f"{name} {getattr(cfg, name)!r} (MiniMind: {want!r})" for name, want in expected.items()
            if getattr(cfg, name) != want]


def write_pth(model, out: str | os.PathLike, stage: str = "", dtype: torch.dtype = torch.float16,
              force: bool = False) -> Path:
    """Write `model` as MiniMind's `.pth` (every key of MiniMindForCausalLM's state dict, lm_head included), to
    `out` (a .pth file, or a directory: MiniMind's name `{weight}_{hidden}[_moe].pth` for the run's stage)."""
    cfg = model.cfg
    wrong = minimind_mismatches(cfg)
    if wrong:
        raise NanoforgeError("MiniMind builds MiniMindConfig(hidden_size, num_hidden_layers, use_moe) with its other "
                             "fields at their defaults, and this model differs: " + "; ".join(wrong)
                             + " (train with --preset minimind-3 or minimind-3-moe; or export --format hf)")
    out = Path(out)
    if not is_pth(out):
        weight = {"pretrain": "pretrain", "dpo": "dpo", "grpo": "grpo", "ppo": "ppo_actor"}.get(stage, "full_sft")
        out = out / f"{weight}_{cfg.d_model}{'_moe' if cfg.n_experts else ''}.pth"
    if out.exists() and not force:
        raise NanoforgeError(f"{out} already exists; choose another --out or add --force")
    state = {k: v.detach().to("cpu", dtype).clone() for k, v in model.state_dict().items()}
    with staged(out) as tmp:  # one writer; what a killed export left there removed
        torch.save(state, tmp)
        replace_with_checksum(tmp, out)
    return out
