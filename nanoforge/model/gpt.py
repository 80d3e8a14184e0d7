"""The transformer: a decoder-only GPT in the Llama mould (its KV cache: model/kvcache.py).

Pre-norm RMSNorm, rotary position embeddings (optionally YaRN-scaled), grouped-query attention through
`scaled_dot_product_attention`, SwiGLU feed-forward, optional QK-norm, optionally tied embeddings. The module
tree and parameter names are HF `LlamaForCausalLM`'s (`Qwen3ForCausalLM`'s with `qk_norm`), so export is a
strict load with no renaming:

    model.embed_tokens.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    model.layers.{i}.self_attn.{q,k}_norm.weight        (qk_norm only)
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight
    lm_head.weight                                      (the same tensor as embed_tokens when tied)

The numerics follow HF too (RMSNorm in float32, RoPE's rotate_half layout, YaRN's NTK-by-parts frequencies),
so an exported model gives the same logits in `transformers`."""
import math

import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F

from nanoforge.core.config import ModelConfig
from nanoforge.model.kvcache import KVCache
from nanoforge.model.linear import Linear
from nanoforge.model.slots import SlotStep, expand_kv_for_cuda
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.moe import MLP, MoE


# -------------------------------------------------------------------------------------------------- RMSNorm

class RMSNorm(nn.Module):
    """Root-mean-square norm (arXiv 1910.07467) with a learned per-channel gain and no bias. Computed in float32
    whatever the input dtype, as HF Llama does (in bf16 the mean of squares of a 512-wide vector loses most of its
    mantissa); the gain is applied after casting back, so the two agree bit for bit in fp32, to rounding in bf16."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # F.rms_norm computes exactly x * rsqrt(mean(x^2) + eps) (one kernel on CUDA; on CPU, torch 2.13, it is
        # those ops). Passing no weight keeps HF's order: normalise, cast, then scale.
        x = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(dtype)
        # Under autocast the matmuls that read a float32 stream's norm (q, k, v; gate, up) would each cast it
        # again, and each gradient back: cast once here, to the same values (QK-norm's output stays as it was).
        autocast = dtype == torch.float32 and torch.is_autocast_enabled(x.device.type)
        return x.to(torch.get_autocast_dtype(x.device.type)) if autocast else x


# -------------------- Rotary position embeddings (RoFormer, arXiv 2104.09864), with YaRN (arXiv 2309.00071)

def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """The rotation frequency of each channel pair, (head_dim/2,) float32, and the attention factor that scales
    cos and sin. Plain RoPE when cfg.rope_scaling_factor == 1, else YaRN, mirroring HF transformers'
    `_compute_default_rope_parameters` and `_compute_yarn_parameters` (beta_fast=32, beta_slow=1,
    truncate=True) operation for operation, so that float32 results are equal."""
    hd, base, factor = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor
    pos_freqs = base ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)  # (hd/2,)
    if factor <= 1.0:
        return 1.0 / pos_freqs, 1.0

    original_max = cfg.rope_original_max_seq_len or cfg.max_seq_len
    beta_fast, beta_slow = 32, 1

    # A channel pair with inv_freq w completes original_max * w / (2 pi) rotations over the original
    # context. Pairs that rotate more than beta_fast times have seen every angle during training and keep
    # their frequency (extrapolation); pairs that rotate less than beta_slow times are interpolated
    # (divided by factor); pairs in between blend linearly. This solves for the pair index at a rotation count.
    def correction_dim(rotations: float) -> float:
        return hd * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), hd - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = torch.clamp((torch.arange(hd // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp  # 1 for the fast (low-index) pairs, 0 for the slow ones
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    # Interpolation flattens the attention logits' distribution; YaRN sharpens it back with this factor
    # on cos and sin (so on q.k, squared), fitted empirically in the paper (eq. 22).
    return inv_freq, 0.1 * math.log(factor) + 1.0


class RotaryEmbedding(nn.Module):
    """cos and sin tables for every position the model can see, float32, (n_positions, head_dim). Non-persistent
    buffers (derived from the config), rebuilt after every `.to()`/`.cuda()`/`.half()`/`.to_empty()` (see `_apply`)
    to stay float32 and correct on the new device: `model.to(torch.bfloat16)` would round them to under three
    significant digits, unlike HF's, and a table built on the meta device has no values at all."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.n_positions = int(cfg.max_seq_len * max(1.0, cfg.rope_scaling_factor))
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset()

    @torch.no_grad()
    def reset(self, device: torch.device | None = None) -> None:
        device = device if device is not None else self.cos.device
        inv_freq, attention_factor = rope_inv_freq(self.cfg)
        freqs = torch.outer(torch.arange(self.n_positions, dtype=torch.float32), inv_freq)  # (P, hd/2)
        # HF's layout: the two halves of a head are the two coordinates of each rotated pair.
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, hd)
        self.cos = (emb.cos() * attention_factor).to(device)
        self.sin = (emb.sin() * attention_factor).to(device)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.reset(self.cos.device)
        return self


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + hd/2) of x (B, H, T, hd) by the angles in cos/sin, (T, hd) or
    (B, 1, T, hd). Done in x's dtype, as HF does (it casts the float32 tables to x's dtype)."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


# ------------------------------------------------------------------------------------------------ Attention

class Attention(nn.Module):
    """Causal grouped-query self-attention (GQA, arXiv 2305.13245): n_kv_heads key/value heads, each shared
    by n_heads / n_kv_heads query heads, which shrinks the KV cache by that ratio."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.dropout = cfg.attention_dropout
        self.q_proj = Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        if cfg.qk_norm:
            # Qwen3: normalise each head's q and k before RoPE, which bounds the attention logits
            # and lets training run at higher learning rates without logit blow-up.
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                is_causal: bool, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H or Hkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(cache, SlotStep):  # continuous batching: the step writes and reads its slots
            y = cache.attend(layer, q, k, v)  # (1, H, N, hd)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, Hkv, S, hd), S = cached + T
            k, v = k.to(q.dtype), v.to(q.dtype)  # a float32 cache under bf16 autocast

        # enable_gqa lets SDPA share each k/v head across its query group without materialising copies.
        # Measured on a 2-core CPU, mini shape (B=4, T=512, 8 heads, 2 kv heads), SDPA forward+backward:
        # enable_gqa 54 ms, expand+reshape 59 ms, repeat_interleave 63 ms (fp32); 53 / 60 / 68 ms (bf16).
        # In decoding it also avoids copying the whole cache every step.
        k, v, gqa = expand_kv_for_cuda(q, k, v, mask is not None)
        dropout = self.dropout if self.training else 0.0
        if isinstance(mask, Segments):
            y = mask.attend(q, k, v, gqa, dropout)  # (B, H, T, hd)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa,
                                               dropout_p=dropout)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, C)
        return self.o_proj(y)


class Segments:
    """Packed rows as their segments, for attention that keeps each to itself: one causal SDPA call per segment.
    On a CPU that skips what a (B, 1, T, T) block-diagonal mask still computes (every block across segments and
    above the diagonal): packed SFT's attention forward+backward 52 -> 27 ms a layer (docs/perf.md)."""

    def __init__(self, starts: torch.Tensor):
        """starts (B, T) bool: True where a segment begins (position 0 always does)."""
        T = starts.shape[1]
        bounds = [[i for i, begins in enumerate(row) if begins] + [T] for row in starts.tolist()]
        self.lengths = [[e - s for s, e in zip(row, row[1:])] for row in bounds]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool, dropout: float) -> torch.Tensor:
        rows = []  # splits, not slices: their backward is one cat, not a zero-filled tensor per slice; 4-D
        for lengths, *row in zip(self.lengths, q.split(1), k.split(1), v.split(1)):  # or SDPA takes its math kernel
            parts = [F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa, dropout_p=dropout)
                     for qs, ks, vs in zip(*(t.split(lengths, dim=2) for t in row))]  # (1, H, length, hd) each
            rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
        return torch.cat(rows)  # (B, H, T, hd)


# ------------------------------------------------------------------------------------------ Block and model

class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). Residual dropout (on each branch's
    output, as in GPT-2) only when cfg.dropout > 0; HF Llama has none, and at 0 it is the identity."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin, mask, is_causal, cache=None, layer=0):
        x = x + self.resid_dropout(self.self_attn(self.input_layernorm(x), cos, sin, mask, is_causal, cache, layer))
        return x + self.resid_dropout(self.mlp(self.post_attention_layernorm(x)))  # (B, T, C)


class Decoder(nn.Module):
    """The stack between token ids and the final norm: HF's `LlamaModel`, hence the name `model` in GPT."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


class GPT(nn.Module):
    """A decoder-only language model; `forward(input_ids) -> logits`. Generation passes a `KVCache` (from
    `new_cache`) so that each step only computes the new tokens."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.activation_checkpointing = False  # set by the training loop (--activation-checkpointing)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every initialisation in one place. Call it again after building on the meta device and
        `to_empty()`: it re-ties lm_head to the embedding (the RoPE tables rebuild themselves)."""
        cfg = self.cfg
        if cfg.tie_embeddings:
            # One matrix both reads tokens in and scores them out (Press & Wolf, arXiv 1608.05859): with a
            # 6400-token vocabulary that saves 3.3M of the mini model's 25.8M parameters. Tied here rather than
            # in __init__ because to_empty() from the meta device replaces the Parameter objects and unties them.
            self.lm_head.weight = self.model.embed_tokens.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        # Each block adds two branches to the residual stream, whose variance would grow with depth;
        # GPT-2 (Radford et al. 2019, section 2.3) scales the branches' output projections by 1/sqrt(2L).
        for block in self.model.layers:
            outputs = [block.self_attn.o_proj]
            outputs += list(block.mlp.down_proj) if isinstance(block.mlp, MoE) else [block.mlp.down_proj]
            for proj in outputs:
                nn.init.normal_(proj.weight, mean=0.0, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))
        # (A tied lm_head was initialised with the embedding, twice, harmlessly.) Keep RoPE valid on the new device.
        self.model.rotary_emb.reset()

    # ---------------------------------------------------------------------------------------------- forward

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
                layout: tuple[torch.Tensor, torch.Tensor] | None = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, vocab_size), in whatever dtype autocast gives (callers upcast).

        Without a cache the tokens are positions 0..T-1; with one they follow its `cache.length` tokens, and their keys
        and values are appended. `attention_mask` (B, cache.length + T), 0 for left padding: padded keys are never
        attended to and positions count only real tokens. `segment_ids` (B, T), rows packed with several documents
        (SFT): a token attends only to its own segment, positions restarting at 0. `layout` (positions (B, T), allowed
        (B, T, T)): any other arrangement spelled out (model/prefix.py). `keep` (B, T) bool: the LM head runs at these
        positions only, logits (N, V) in row order (a loss skips the vocabulary matmul where it supervises nothing)."""
        if isinstance(cache, SlotStep):
            return self._forward_slots(input_ids, cache, keep)
        B, T = input_ids.shape
        start = 0 if cache is None else cache.length
        if cache is not None:
            if cache.batch_size != B:
                raise NanoforgeError(f"the KV cache was made for batch size {cache.batch_size}, got {B}")
            cache.check_room(T)
            if start == 0 and B > 1 and segment_ids is None and layout is None:
                shared = self._prefill_once(input_ids, cache, attention_mask)
                if shared is not None:
                    return shared
        rope = self.model.rotary_emb
        if layout is None and start + T > rope.n_positions:  # a layout's positions are those of its rows alone
            raise NanoforgeError(f"sequence of {start + T} positions is longer than the model's "
                                 f"{rope.n_positions} (max_seq_len * rope_scaling_factor)")
        if segment_ids is not None or layout is not None:
            if cache is not None or attention_mask is not None:
                raise NanoforgeError("packed rows cannot be combined with a cache or attention_mask")
            positions, allowed = layout or self._packed_layout(segment_ids, spans=input_ids.device.type == "cpu")
            cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)  # (B, 1, T, hd)
            mask = allowed if isinstance(allowed, Segments) else allowed.unsqueeze(1)  # or (B, 1, T, T)
            is_causal = False
        else:
            cos, sin, mask, is_causal = self._positions_and_mask(B, T, start, attention_mask, input_ids.device)

        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled() and cache is None
        for i, block in enumerate(self.model.layers):
            if recompute:  # keep only each block's input; its insides are recomputed during backward
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, mask, is_causal, None, i, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, is_causal, cache, i)
        x = self.model.norm(x)
        if cache is not None:
            cache.advance(T)
        return self.lm_head(x if keep is None else x[keep])  # (B, T, V), or (N, V) at the kept positions

    def _forward_slots(self, input_ids: torch.Tensor, step: SlotStep, keep: torch.Tensor | None) -> torch.Tensor:
        """One continuous-batching step (model/slots.py): input_ids (1, N) are the step's tokens, each at its own
        slot's position; logits (N, V), or at the `keep` (N,) positions only."""
        rope = self.model.rotary_emb
        if input_ids.shape != (1, step.n_tokens):
            raise NanoforgeError(f"a slot step of {step.n_tokens} tokens got input of shape {tuple(input_ids.shape)}")
        if int(step.positions.max()) >= rope.n_positions:
            raise NanoforgeError(f"a sequence reached position {int(step.positions.max())}; the model sees at most "
                                 f"{rope.n_positions} (max_seq_len * rope_scaling_factor)")
        cos, sin = rope.cos[step.positions], rope.sin[step.positions]  # (N, hd)
        x = self.model.embed_tokens(input_ids)  # (1, N, C)
        for i, block in enumerate(self.model.layers):
            x = block(x, cos, sin, None, False, step, i)
        x = self.model.norm(x)[0]  # (N, C)
        step.advance()
        return self.lm_head(x if keep is None else x[keep])

    def _positions_and_mask(self, B: int, T: int, start: int, attention_mask: torch.Tensor | None,
                            device: torch.device):
        """RoPE tables for the new tokens and the attention mask for SDPA (True = may attend)."""
        rope = self.model.rotary_emb
        S = start + T  # keys: everything cached plus the new tokens
        if attention_mask is None:
            cos, sin = rope.cos[start:S], rope.sin[start:S]  # (T, hd)
            if start == 0:
                return cos, sin, None, True  # training and prefill: SDPA's fused causal path
            if T == 1:
                return cos, sin, None, False  # one-token decode sees every cached key
            # Chunked prefill: is_causal would align the triangle top-left (query 0 to key 0), so spell it out.
            q_pos = torch.arange(start, S, device=device)
            return cos, sin, torch.arange(S, device=device)[None, :] <= q_pos[:, None], False  # (T, S)

        if attention_mask.shape != (B, S):
            raise NanoforgeError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected ({B}, {S}): "
                                 f"one entry per cached and new token")
        real = attention_mask.to(device=device, dtype=torch.bool)  # (B, S)
        # Position = number of real tokens before this one, so left padding does not shift RoPE.
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)[:, start:]  # (B, T)
        cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)  # (B, 1, T, hd)
        q_pos = torch.arange(start, S, device=device)[:, None]  # (T, 1)
        k_pos = torch.arange(S, device=device)[None, :]  # (1, S)
        allowed = (k_pos <= q_pos) & real[:, None, :]  # (B, T, S)
        # A padding query has no real key at or before it; a row of SDPA with no allowed key is NaN, and a NaN
        # in a padded position's values would reach real tokens through 0 * NaN in later layers. Letting
        # every query see itself keeps such rows finite; real tokens never look at padded keys either way.
        allowed = allowed | (k_pos == q_pos)
        return cos, sin, allowed.unsqueeze(1), False  # mask (B, 1, T, S)

    def _prefill_once(self, input_ids: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None):
        """A prefill with each distinct prompt computed once (an RL rollout repeats each G times), its keys and
        values then cached for every row that repeats it; None when the rows all differ."""
        T = input_ids.shape[1]
        rows = input_ids if attention_mask is None else torch.cat([input_ids, attention_mask.to(input_ids)], 1)
        distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
        if len(distinct) == len(rows):
            return None
        small = self.new_cache(len(distinct), max_len=T, dtype=cache.k[0].dtype)
        logits = GPT.forward(self, distinct[:, :T], small, None if attention_mask is None else distinct[:, T:])
        for layer in range(len(cache.k)):
            cache.update(layer, small.k[layer][inverse], small.v[layer][inverse])
        cache.advance(T)
        return logits[inverse]

    @staticmethod
    def _packed_layout(segment_ids: torch.Tensor, spans: bool = False) -> tuple[torch.Tensor, torch.Tensor | Segments]:
        """Per-segment positions of packed rows, and the block-diagonal causal mask (B, T, T), or with `spans`
        the Segments (one attention call each: faster on a CPU, where it was measured)."""
        idx = torch.arange(segment_ids.shape[1], device=segment_ids.device)
        starts = torch.ones_like(segment_ids, dtype=torch.bool)
        starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
        seg_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=-1).values  # (B, T)
        if spans:
            return idx - seg_start, Segments(starts)
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
        return idx - seg_start, same & (idx[None, :] <= idx[:, None])  # causal within the segment

    # -------------------------------------------------------------------------------- cache, sizes, weights

    def new_cache(self, batch_size: int, max_len: int | None = None, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> KVCache:
        """An empty KV cache for `batch_size` rows of up to `max_len` positions (default: all the model can
        see), on the model's device and in its parameters' dtype unless told otherwise."""
        cfg, weight = self.cfg, self.model.embed_tokens.weight
        max_len = max_len or self.context_length
        return KVCache(cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim,
                       device=device if device is not None else weight.device,
                       dtype=dtype if dtype is not None else weight.dtype)

    @property
    def context_length(self) -> int:
        """The most positions the model sees: max_seq_len, times rope_scaling_factor under YaRN. Every caller
        that asks how long a sequence may be asks this."""
        return self.model.rotary_emb.n_positions

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, a tied embedding counted once. `exclude_embeddings` leaves out the token
        embedding table (and so, when tied, the output projection that shares it)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        return n - self.model.embed_tokens.weight.numel() if exclude_embeddings else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at `seq_len`, by the PaLM / nanoGPT convention:
        6 * N + 12 * n_layers * d_model * seq_len.

        N counts the parameters in a matrix multiply for every token: all non-embedding ones plus the output
        projection (vocab_size * d_model), tied or not, since the lm_head matmul runs either way while the
        embedding lookup costs nothing. 6N is 2 (multiply-add) * 3 (forward, and backward for inputs and weights);
        the second term is attention's QK^T and AV at full (not causal-halved) length, as MFU figures count it."""
        cfg = self.cfg
        n = self.num_params(exclude_embeddings=True)
        if cfg.tie_embeddings:
            n += cfg.vocab_size * cfg.d_model
        if cfg.n_experts:  # only experts_per_token of the n_experts (3 * d_model * ffn_dim each) run for each token
            n -= cfg.n_layers * (cfg.n_experts - cfg.experts_per_token) * 3 * cfg.d_model * cfg.ffn_dim
        return 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * seq_len

    def aux_loss(self) -> torch.Tensor | None:
        """Mean load-balancing loss of the MoE layers from the last forward; None for a dense model."""
        return torch.stack([block.mlp.aux_loss for block in self.model.layers]).mean() if self.cfg.n_experts else None

    def state_dict_for_save(self) -> dict[str, torch.Tensor]:
        """The weights to write to a checkpoint: the state dict without `lm_head.weight` when it is tied
        (safetensors refuses tensors that share memory, and HF Llama with tie_word_embeddings has none)."""
        sd = self.state_dict()
        if self.cfg.tie_embeddings:
            del sd["lm_head.weight"]
        return sd

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint strictly: every key of `state_dict_for_save()` present with the same shape and
        nothing else, or a NanoforgeError naming the offending keys. Never a silent partial load."""
        sd = dict(state_dict)
        tied = self.cfg.tie_embeddings
        if tied and "lm_head.weight" in sd:
            # A checkpoint that stores the tied matrix twice is fine; one with a different head is not.
            head, emb = sd.pop("lm_head.weight"), sd.get("model.embed_tokens.weight")
            if emb is None or head.shape != emb.shape or not torch.equal(head, emb):
                raise NanoforgeError("checkpoint does not match the model: it has its own lm_head.weight but the "
                                     "model ties it to model.embed_tokens.weight (tie_embeddings=true); load it "
                                     "with tie_embeddings=false")
        check_same_tensors(self.state_dict_for_save(), sd, "checkpoint", "checkpoint does not match the model")
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight  # in case to_empty() untied them
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        self.load_state_dict(sd, strict=True)


def check_same_tensors(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor], source: str,
                       headline: str) -> None:
    """A strict load's check: `given` (from `source`) has exactly the keys of `expected`, with their shapes;
    else a NanoforgeError, `headline` then the first five offending keys. Never a silent partial load."""
    problems = []
    for key, tensor in expected.items():
        if key not in given:
            problems.append(f"{key} is missing from the {source}")
        elif given[key].shape != tensor.shape:
            problems.append(f"{key} has shape {tuple(given[key].shape)} in the {source}, {tuple(tensor.shape)} "
                            "in the model")
    problems += [f"{key} is in the {source} but not in the model" for key in given if key not in expected]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise NanoforgeError(f"{headline}: " + "; ".join(problems[:5]) + more)
