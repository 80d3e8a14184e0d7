"""Configuration as data: two dataclasses, presets, TOML files and `--field value` overrides.

A run is described by a ModelConfig (the shape of the network) and a TrainConfig (how it is trained).
Their field names are disjoint, so the command line can take any field of either as `--field value`
without a prefix. Every run directory saves the merged config it actually used as `config.toml`."""
from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable

from nanoforge.core.errors import NanoforgeError


PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # --precision; auto: device.py resolve_precision's rule
# ffn_rule: how ffn_hidden 0 derives the SwiGLU width from d_model, before rounding up to a multiple of 64.
# "8/3" is minimind2's (and LLaMA's) rule, "pi" MiniMind-3's (MiniMindConfig's intermediate_size).
FFN_RULES = {"8/3": lambda d_model: d_model * 8 / 3, "pi": lambda d_model: d_model * math.pi}


class ConfigError(NanoforgeError):
    """A config value or file a person has to fix; the message says which field and why."""


def option(default: Any = None, interval: str | None = None, **flag: Any) -> Any:
    """A config or options field: its default, and for its flag (cli.add_config_flags, add_option_flags) its help
    (every field has one: tests/test_cli_options.py), a number's interval ("[1, inf)", cli.number) and argparse's
    choices, metavar or nargs."""
    return dataclasses.field(default=default, metadata={"interval": interval, **flag})


@dataclass
class ModelConfig:
    vocab_size: int = option(6400, help="tokens in the embedding; training commands size it to the tokenizer unless "
                             "given")
    d_model: int = option(512, help="model width; head_dim and, with ffn_hidden 0, the SwiGLU width follow it")
    n_layers: int = option(8, help="transformer blocks")
    n_heads: int = option(8, help="query heads (head_dim = d_model / n_heads)")
    n_kv_heads: int = option(2, help="key/value heads shared by groups of query heads (GQA); = n_heads for plain "
                             "attention")
    ffn_hidden: int = option(0, help="SwiGLU hidden width; 0 derives it from d_model by ffn_rule")
    ffn_rule: str = option("8/3", help="how ffn_hidden 0 is derived: 8/3 (minimind2's: 8/3 x d_model rounded up to a "
                           "multiple of 64) or pi (MiniMind-3's, the minimind-3 presets': ceil(d_model pi / 64) x 64)")
    max_seq_len: int = option(512, help="longest context the model is built for (RoPE tables)")
    rope_theta: float = option(1e4, help="RoPE base frequency")
    rope_scaling_factor: float = option(1.0, help="YaRN context extension (arXiv 2309.00071): factor > 1 stretches "
                                        "RoPE to factor * rope_original_max_seq_len.")
    rope_original_max_seq_len: int = option(0, help="YaRN: the context length trained at; 0 means max_seq_len")
    norm_eps: float = option(1e-5, help="RMSNorm epsilon")
    qk_norm: bool = option(False, help="RMSNorm on per-head q and k (Qwen3 style)")
    dropout: float = option(0.0, help="dropout on attention and residual branches while training")
    attn_dropout: float = option(-1.0, help="dropout on the attention weights alone; -1 means `dropout`. On a CPU any "
                                 "> 0 sends attention to SDPA's math kernel, ~10x slower than its flash one")
    tie_embeddings: bool = option(True, help="the output head shares the input embedding's weights")
    init_std: float = option(0.02,
                             help="std of the normal initialisation (residual projections scaled by 1/sqrt(2 "
                             "n_layers))")
    n_experts: int = option(0, help="mixture of experts: 0 keeps the dense SwiGLU; otherwise each token goes to its "
                            "top experts_per_token")
    experts_per_token: int = option(2, help="experts each token is routed to")
    moe_aux_weight: float = option(0.01, help="weight of the load-balancing loss added to the training loss")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def attention_dropout(self) -> float:
        return self.dropout if self.attn_dropout == -1.0 else self.attn_dropout

    @property
    def ffn_dim(self) -> int:
        return self.ffn_hidden or derived_ffn(self.d_model, self.ffn_rule)

    def describe(self) -> str:
        """The shape in one line (`nanoforge plan` prints it), the widths derived from d_model included."""
        return (f"{self.n_layers} layers, d_model {self.d_model}, {self.n_heads} heads of {self.head_dim} / "
                f"{self.n_kv_heads} KV, SwiGLU {self.ffn_dim}" + ("" if self.ffn_hidden else f" ({self.ffn_rule} rule)")
                + f", vocab {self.vocab_size}"
                + (f", {self.n_experts} experts top-{self.experts_per_token}" if self.n_experts else ""))

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters of the GPT this config builds (model/gpt.py; a test holds the two equal), counted without
        building it (`nanoforge report` needs no torch): a tied embedding once; `exclude_embeddings` leaves out
        the token embedding table, as GPT.num_params does."""
        d, h = self.d_model, self.head_dim
        attention = d * h * 2 * (self.n_heads + self.n_kv_heads) + (2 * h if self.qk_norm else 0)
        mlp = 3 * d * self.ffn_dim
        ffn = self.n_experts * (mlp + d) if self.n_experts else mlp  # an expert: an MLP and its router column
        body = self.n_layers * (attention + ffn + 2 * d) + d + (0 if self.tie_embeddings else self.vocab_size * d)
        return body if exclude_embeddings else body + self.vocab_size * d

    def validate(self) -> None:
        _finite(self)
        _positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim = d_model/n_heads = {self.head_dim} must be even for RoPE")
        _require(self, "ffn_hidden", self.ffn_hidden >= 0, ">= 0 (0 derives it from d_model)")
        _one_of(self, "ffn_rule", tuple(FFN_RULES))
        _require(self, "rope_original_max_seq_len", self.rope_original_max_seq_len >= 0, ">= 0 (0: max_seq_len)")
        _require(self, "dropout", 0.0 <= self.dropout < 1.0, "in [0, 1)")
        _require(self, "attn_dropout", self.attn_dropout == -1.0 or 0.0 <= self.attn_dropout < 1.0,
                 "in [0, 1), or -1 for dropout's value")
        _require(self, "rope_theta", self.rope_theta > 0, "> 0")
        _require(self, "rope_scaling_factor", self.rope_scaling_factor >= 1.0, ">= 1")
        if self.norm_eps <= 0 or self.init_std <= 0:
            raise ConfigError("norm_eps and init_std must be > 0")
        if self.n_experts < 0 or self.moe_aux_weight < 0:
            raise ConfigError("n_experts and moe_aux_weight must be >= 0")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ConfigError(f"experts_per_token={self.experts_per_token} must be between 1 and "
                              f"n_experts={self.n_experts}")


@dataclass
class TrainConfig:
    # schedule of the run
    max_steps: int = option(1000, help="optimizer steps to train (see also epochs)")
    epochs: float = option(0.0, help="> 0: train this many passes over the data (sets max_steps from the data's size)")
    time_budget: float = option(0.0, help="> 0: stop after this many seconds of training (or at max_steps), the lr "
                                "schedule following elapsed / budget")
    batch_size: int = option(4, help="sequences per micro-batch")
    grad_accum: int = option(1, help="micro-batches per optimizer step")
    micro_batch: str = option("", help="\"\" trains batch_size x grad_accum as given; \"auto\" finds the largest "
                              "micro-batch that fits (a probe, see train/microbatch.py) and N uses micro-batch N; "
                              "both then set grad_accum so the global batch (batch_size x grad_accum) stays the same")
    memory_budget_gb: float = option(0.0, help="memory --micro-batch auto may fill; 0: the device's (CPU: 80% of "
                                     "MemAvailable)")
    seq_len: int = option(512, help="tokens per training sequence")
    # optimizer
    lr: float = option(5e-4, help="peak learning rate (AdamW)")
    min_lr_ratio: float = option(0.1, help="final lr = lr * min_lr_ratio")
    schedule: str = option("cosine", help="cosine | wsd | onecycle | constant")
    warmup_steps: int = option(100, help="linear warmup from 0 to lr")
    decay_fraction: float = option(0.2, help="wsd: share of the steps spent decaying at the end")
    weight_decay: float = option(0.1,
                                 help="AdamW decoupled weight decay (matrices only; not norms, biases or embeddings)")
    beta1: float = option(0.9, help="AdamW beta1")
    beta2: float = option(0.95, help="AdamW beta2")
    grad_clip: float = option(1.0, help="clip the global gradient norm to this; 0 disables clipping")
    # muon: Newton-Schulz orthogonalised momentum for the blocks' weight matrices, AdamW (lr) for the rest
    optimizer: str = option("adamw", help="adamw | muon")
    muon_lr: float = option(0.02, help="peak lr of the muon matrices; follows the same schedule as lr")
    muon_momentum: float = option(0.95, help="muon's Nesterov momentum")
    # numerics and device
    precision: str = option("auto", help="auto | fp32 | bf16 | fp16; auto: bf16 where the device computes it "
                            "natively, else fp32")
    device: str = option("auto", help="auto | cpu | cuda | cuda:N | mps")
    compile: bool = option(False, help="torch.compile the model for training (evaluation and sampling use it "
                           "uncompiled)")
    activation_checkpointing: bool = option(False, help="recompute block activations in backward: less memory, ~1/3 "
                                            "more compute")
    tf32: bool = option(True, help="CUDA: fp32 matmuls on tensor cores (TF32)")
    sync_timing: bool = option(False, help="CUDA: synchronise at phase boundaries so data/fwd_bwd/optim times are "
                               "exact (slower)")
    fsdp: bool = option(False, help="under torchrun: shard parameters, gradients and optimizer state (FSDP2) instead "
                        "of DDP")
    seed: int = option(0, help="fixes the initial weights, the data order and dropout")
    # evaluation, logging, checkpoints
    eval_every: int = option(100, help="steps between validations; 0 disables periodic validation")
    eval_batches: int = option(20, help="validation batches per evaluation (capped by the split's size)")
    early_stop_patience: int = option(0, help="evaluations without improvement before stopping; 0 disables")
    log_every: int = option(10, help="steps between progress lines and metrics.jsonl records")
    sample_every: int = option(0, help="generate the sample prompts every N steps (to samples.jsonl, TensorBoard and "
                               "wandb); 0 disables")
    sample_prompts: str = option("", help="file of prompts for samples (JSONL with \"prompt\" or one per line); "
                                 "empty: built-in set")
    save_every: int = option(500, help="steps between checkpoints; 0 saves only at the end and on interruption")
    keep_last: int = option(3, help="checkpoints kept on disk (older ones are deleted)")
    tensorboard: bool = option(True, help="write TensorBoard events to RUN/tb")
    wandb_project: str = option("", help="log to this wandb project too (empty: off); WANDB_* variables are honoured")
    # guard against non-finite loss or gradients
    nonfinite_patience: int = option(3, help="consecutive bad steps before rolling back to the last checkpoint")
    rollback_lr_factor: float = option(0.5, help="lr multiplier after each rollback")
    # data
    val_fraction: float = option(0.01, help="held out when raw JSONL/text is prepared on the fly (a text file: its "
                                 "tail)")
    workers: int = option(0, help="tokenization processes when preparing on the fly; 0 means all cores")
    text_column: str = option("text", help="Parquet / datasets pretraining input: the column that holds the text")

    def validate(self) -> None:
        _finite(self)
        _positive(self, "max_steps", "batch_size", "grad_accum", "seq_len", "eval_batches", "log_every",
                  "keep_last", "nonfinite_patience")
        _one_of(self, "precision", PRECISIONS)
        _one_of(self, "schedule", ("cosine", "wsd", "onecycle", "constant"))
        _one_of(self, "optimizer", ("adamw", "muon"))
        if self.muon_lr <= 0 or not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"muon_lr={self.muon_lr} must be > 0 and muon_momentum={self.muon_momentum} in [0, 1)")
        _require(self, "lr", self.lr > 0, "> 0")
        _require(self, "min_lr_ratio", 0.0 <= self.min_lr_ratio <= 1.0, "in [0, 1]")
        _require(self, "decay_fraction", 0.0 <= self.decay_fraction <= 1.0, "in [0, 1]")
        _require(self, "rollback_lr_factor", 0.0 < self.rollback_lr_factor <= 1.0, "in (0, 1]")
        _require(self, "epochs", self.epochs >= 0, ">= 0 (0 trains for max_steps)")
        _require(self, "val_fraction", 0.0 <= self.val_fraction < 1.0, "in [0, 1)")
        for name in ("warmup_steps", "eval_every", "save_every", "early_stop_patience", "workers", "sample_every",
                     "weight_decay", "grad_clip", "memory_budget_gb", "time_budget"):
            _require(self, name, getattr(self, name) >= 0, ">= 0")
        if self.micro_batch not in ("", "auto") and not (self.micro_batch.isdigit() and int(self.micro_batch) > 0):
            raise ConfigError(f"micro_batch={self.micro_batch!r} must be empty, 'auto' or a positive integer")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError("beta1 and beta2 must be in [0, 1)")


# short target name -> (submodule of a Block, Linear inside it)
TARGETS: dict[str, tuple[str, str]] = {
    "q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"), "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"),
    "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"), "down": ("mlp", "down_proj"),
}


def parse_targets(spec: str | Iterable[str]) -> tuple[str, ...]:
    """"q,k,v" (or "q_proj,v_proj", or "all", or a list of names) -> ("q", "k", "v"), in the model's order."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [s.strip() for s in items if s.strip()]
    if names == ["all"]:
        return tuple(TARGETS)
    wanted = set()
    for name in names:
        short = name[:-len("_proj")] if name.endswith("_proj") else name
        if short not in TARGETS:
            raise NanoforgeError(f"unknown LoRA target {name!r}; valid targets: {', '.join(TARGETS)} "
                                 f"(or their _proj names, or 'all')")
        wanted.add(short)
    if not wanted:
        raise NanoforgeError(f"no LoRA targets given; choose from {', '.join(TARGETS)} (or 'all')")
    return tuple(t for t in TARGETS if t in wanted)


@dataclass
class LoraConfig:
    """`nanoforge lora`'s options (cli.add_option_flags), saved with the run as to_dict's lora_* keys."""
    rank: int = option(16, "[1, inf)", help="adapter rank")
    alpha: float = option(32.0, "(0, inf)", help="adapter scale numerator, scale = alpha / rank (a new rank, same lr)")
    dropout: float = option(0.05, "[0, 1)", help="dropout on the adapters' input (the frozen path sees x unchanged)")
    targets: str | tuple[str, ...] = option(",".join(TARGETS), help="linear layers to adapt")

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise NanoforgeError(f"lora rank={self.rank!r} must be a positive integer")
        if not self.alpha > 0:
            raise NanoforgeError(f"lora alpha={self.alpha!r} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise NanoforgeError(f"lora dropout={self.dropout!r} must be in [0, 1)")
        self.targets = parse_targets(self.targets)

    def to_dict(self) -> dict[str, Any]:
        """Flat scalars, for config.toml's [run] section and state.json."""
        return {"lora_rank": self.rank, "lora_alpha": float(self.alpha), "lora_dropout": float(self.dropout),
                "lora_targets": ",".join(self.targets)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoraConfig:
        try:
            return cls(rank=d["lora_rank"], alpha=d["lora_alpha"], dropout=d["lora_dropout"], targets=d["lora_targets"])
        except KeyError as e:
            raise NanoforgeError(f"LoRA settings are incomplete: {e.args[0]} is missing") from None


def _later_length_wins(train: dict[str, Any], layer: dict[str, Any]) -> None:
    """A run's length is max_steps or epochs, whichever a later layer set: a layer that gives max_steps but
    not epochs (a preset, a --max-steps on resume) turns off the epochs of the layers below it."""
    if "max_steps" in layer and "epochs" not in layer:
        train["epochs"] = 0.0


def _finite(cfg) -> None:
    """No NaN or infinity in a float field (a NaN passes every `x <= 0` check and poisons training)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name}={value} must be a finite number")


def _positive(cfg, *names: str) -> None:
    for name in names:
        _require(cfg, name, getattr(cfg, name) > 0, "> 0")


def derived_ffn(d_model: int, rule: str) -> int:
    """ffn_hidden 0's SwiGLU width: FFN_RULES[rule] of d_model rounded up to a multiple of 64 (MiniMind's rounding)."""
    return 64 * math.ceil(FFN_RULES[rule](d_model) / 64)


def _require(cfg, name: str, ok: bool, what: str) -> None:
    """`ok` or a ConfigError: `NAME=VALUE must be WHAT`."""
    if not ok:
        raise ConfigError(f"{name}={getattr(cfg, name)} must be {what}")


def _one_of(cfg, name: str, choices: tuple[str, ...]) -> None:
    if getattr(cfg, name) not in choices:
        raise ConfigError(f"{name}={getattr(cfg, name)!r} is not one of {', '.join(choices)}")


MODEL_FIELDS = {f.name: f for f in fields(ModelConfig)}
# Model fields that regularise or initialise training and leave what trained weights compute alone: a run from
# --init may set them. Every other model field is the model's shape, which its weights fix.
TRAINING_ONLY = ("dropout", "attn_dropout", "moe_aux_weight", "init_std")
SHAPE_FIELDS = tuple(name for name in MODEL_FIELDS if name not in TRAINING_ONLY)
TRAIN_FIELDS = {f.name: f for f in fields(TrainConfig)}
assert not set(MODEL_FIELDS) & set(TRAIN_FIELDS), "model and train field names must be disjoint"

_MINIMIND_3 = dict(d_model=768, n_layers=8, n_heads=8, n_kv_heads=4, ffn_rule="pi", qk_norm=True, rope_theta=1e6,
                   norm_eps=1e-6, max_seq_len=32768)
# Presets are partial configs: only what differs from the dataclass defaults.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # a few hundred thousand parameters: for tests and smoke runs
    "tiny": {
        "model": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128),
        "train": dict(seq_len=64, batch_size=4, warmup_steps=10, lr=3e-3, eval_every=50, save_every=100),
    },
    # `nanoforge demo`: a million parameters that memorise a thousand short answers in ~2 minutes on a 2-core
    # CPU, with the CPU speedrun's recipe (Muon, WSD, batch 8; docs/perf.md); see nanoforge/demo/pipeline.py
    "demo": {
        "model": dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256),
        "train": dict(seq_len=256, batch_size=8, optimizer="muon", muon_lr=0.01, lr=6e-3, schedule="wsd",
                      decay_fraction=0.4, min_lr_ratio=0.0, warmup_steps=20, weight_decay=0.1, eval_every=100,
                      eval_batches=8, log_every=10, save_every=0, keep_last=1),
    },
    # MiniMind's older 26M (minimind2-small): d_model 512, 8 layers, 8 heads, 2 KV heads, vocab 6400
    "mini": {"model": {}, "train": {}},
    # the mini shape with 4 SwiGLU experts per layer, 2 active per token (MiniMind's MoE routes top-2 of 4)
    "mini-moe": {"model": dict(n_experts=4, experts_per_token=2), "train": {}},
    # MiniMind-3, MiniMind's main model (64M; model/model_minimind.py's MiniMindConfig at commit d65ef2c): 768 wide,
    # 8 layers, 8 heads of 96, 4 KV heads, SwiGLU ceil(768 pi / 64) * 64 = 2432, QK-norm, RoPE theta 1e6, eps 1e-6,
    # tied embeddings, 32768 positions (its RoPE table). Its SwiGLU width and head_dim are derived from d_model, as
    # MiniMindConfig derives them from hidden_size: --d-model 128 gives ceil(128 pi / 64) * 64 = 448 and heads of 16
    "minimind-3": {"model": dict(_MINIMIND_3), "train": {}},
    # MiniMind-3-MoE (198M, 64M active): the same with 4 experts of 2432 per layer, top-1; MiniMind adds each layer's
    # aux loss times 5e-4, which is our mean over the 8 layers times 8 * 5e-4
    "minimind-3-moe": {"model": dict(_MINIMIND_3, n_experts=4, experts_per_token=1, moe_aux_weight=8 * 5e-4),
                       "train": {}},
    # about 100M parameters, MiniMind's larger dense shape (768 wide, 16 layers)
    "base": {
        "model": dict(d_model=768, n_layers=16, n_heads=8, n_kv_heads=2, max_seq_len=1024),
        "train": dict(seq_len=1024, lr=3e-4),
    },
}


_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_value(name: str, f: dataclasses.Field, text: str) -> Any:
    """Turn a command-line string into the field's type, with an error naming the field."""
    kind = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str}[f.type]
    try:
        if kind is bool:
            return _BOOL_WORDS[text.lower()]
        if kind is int:
            return int(float(text)) if ("e" in text.lower() and float(text).is_integer()) else int(text)
        return kind(text)
    except (ValueError, KeyError):
        raise ConfigError(f"--{name.replace('_', '-')}: {text!r} is not a valid {kind.__name__}") from None


def _check_type(where: str, name: str, f: dataclasses.Field, value: Any) -> Any:
    kind = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str}[f.type]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if name == "micro_batch" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # `micro_batch = 8` in a TOML file means the same as --micro-batch 8
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ConfigError(f"{where}: {name} = {value!r} should be a {kind.__name__}")
    return value


def build_config(preset: str | None = None, config_file: str | Path | None = None,
                 overrides: dict[str, Any] | None = None,
                 base: dict[str, dict[str, Any]] | None = None) -> tuple[ModelConfig, TrainConfig]:
    """Merge, in order: dataclass defaults, `base` (e.g. a saved run config), the preset, the TOML file,
    then command-line overrides. Unknown keys are errors, never silently ignored."""
    model, train = {}, {}  # field -> value, merged layer by layer
    layers: list[tuple[str, dict[str, dict[str, Any]]]] = []
    if base:
        layers.append(("saved config", base))
    if preset:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        layers.append((f"preset {preset}", PRESETS[preset]))
    if config_file:
        layers.append((str(config_file), load_toml(config_file)))
    for where, layer in layers:
        for section, target, known in (("model", model, MODEL_FIELDS), ("train", train, TRAIN_FIELDS)):
            for key, value in layer.get(section, {}).items():
                if key not in known:
                    raise ConfigError(f"{where}: [{section}] has unknown key {key!r}")
                target[key] = _check_type(f"{where} [{section}]", key, known[key], value)
            if section == "train":
                _later_length_wins(train, layer.get("train", {}))
    if overrides and "max_steps" in overrides and overrides.get("epochs"):
        raise ConfigError("give --epochs or --max-steps, not both")
    for key, value in (overrides or {}).items():
        if key in MODEL_FIELDS:
            model[key] = value
        elif key in TRAIN_FIELDS:
            train[key] = value
        else:
            raise ConfigError(f"unknown config field {key!r}")
    _later_length_wins(train, {k: v for k, v in (overrides or {}).items() if k in TRAIN_FIELDS})
    mcfg, tcfg = ModelConfig(**model), TrainConfig(**train)
    try:
        mcfg.validate()
        tcfg.validate()
    except ConfigError as e:
        if config_file:  # the value may have come from the file: say which file was in play
            raise ConfigError(f"{config_file}: {e}") from None
        raise
    if tcfg.seq_len > mcfg.max_seq_len:
        raise ConfigError(f"seq_len={tcfg.seq_len} is longer than the model's max_seq_len={mcfg.max_seq_len} "
                          f"(raise it with --max-seq-len {tcfg.seq_len}, or shorten --seq-len)")
    return mcfg, tcfg


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    for section in data:
        # [run] is written by nanoforge into a run's config.toml (data, tokenizer, stage); it is informational
        if section not in ("model", "train", "run") or not isinstance(data[section], dict):
            raise ConfigError(f"{path}: unknown section [{section}]; expected [model] and [train]")
    return data


def config_to_toml(model: ModelConfig, train: TrainConfig, extra: dict[str, dict[str, Any]] | None = None) -> str:
    """Write the config as TOML (flat sections of scalars, so a tiny writer is enough)."""
    sections = {"model": dataclasses.asdict(model), "train": dataclasses.asdict(train), **(extra or {})}
    return "\n".join(f"[{name}]\n" + "".join(f"{key} = {_toml_scalar(value)}\n" for key, value in values.items())
                     for name, values in sections.items())


def _toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        import json
        return json.dumps(value, ensure_ascii=False)  # JSON string escapes are valid TOML basic strings
    raise TypeError(f"cannot write {value!r} to TOML")


def config_dicts(model: ModelConfig, train: TrainConfig | None = None) -> dict[str, dict[str, Any]]:
    return {"model": dataclasses.asdict(model), **({"train": dataclasses.asdict(train)} if train is not None else {})}
