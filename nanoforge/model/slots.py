"""A KV cache of slots for continuous batching (infer/engine/), and the plan of one forward over it.

`SlotCache` keeps, per layer, keys and values as (slots, n_kv_heads, capacity, head_dim) and a length per slot:
each slot holds one sequence, whatever the others hold, so rows of different lengths need no left padding and
each keeps its own RoPE positions. Slots and capacity grow on demand (up to the limits given), so a server
that may hold 32 sequences of 2,048 tokens pays only for what it holds.

`SlotStep` is one forward's worth of work: one new token for each decoding slot, and chunks of prompt for
slots still prefilling, all flattened into one (1, N) row of tokens. The linear layers see all N tokens at
once (one matmul for the whole batch); attention (`attend`, called by model/gpt.py's Attention) writes each
token's key and value into its slot and reads the slot back: the decoding slots together in one SDPA call with a
mask of their lengths, each prefill chunk in a call of its own, causal from its slot's current length."""
import torch
import torch.nn.functional as F

from nanoforge.core.errors import NanoforgeError


def expand_kv_for_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool) -> tuple:
    """(k, v, enable_gqa) for SDPA. On CUDA only flash attention (and math) take enable_gqa, and flash takes no
    mask and no fp32: there expanded heads keep the memory-efficient kernel instead of the math one."""
    gqa = k.shape[1] != q.shape[1]
    if gqa and q.is_cuda and (masked or q.dtype == torch.float32):
        rep = q.shape[1] // k.shape[1]
        return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    return k, v, gqa


class SlotCache:
    """Keys and values of up to `max_slots` sequences of up to `max_len` positions each (see the module doc)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_slots: int, max_len: int,
                 device: torch.device, dtype: torch.dtype):
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.max_slots, self.max_len, self.device, self.dtype = max_slots, max_len, device, dtype
        self.lengths = [0] * max_slots
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._allocate(min(4, max_slots), min(256, max_len))

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def _allocate(self, slots: int, capacity: int) -> None:
        shape = (slots, self.n_kv_heads, capacity, self.head_dim)
        old = list(zip(self.k, self.v))
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.n_layers)]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.n_layers)]
        for (k_old, v_old), k, v in zip(old, self.k, self.v):
            s, c = min(k_old.shape[0], slots), min(k_old.shape[2], capacity)
            k[:s, :, :c] = k_old[:s, :, :c]
            v[:s, :, :c] = v_old[:s, :, :c]

    def reserve(self, slots: int, length: int) -> None:
        """Room for `slots` slots of `length` positions; grows by doubling, up to the limits."""
        if slots > self.max_slots or length > self.max_len:
            raise NanoforgeError(f"the slot cache holds {self.max_slots} sequences of {self.max_len} positions; "
                                 f"asked for {slots} of {length}")
        if slots > self.slots or length > self.capacity:
            grow_s = min(self.max_slots, max(slots, 2 * self.slots)) if slots > self.slots else self.slots
            grow_c = min(self.max_len, max(length, 2 * self.capacity)) if length > self.capacity else self.capacity
            self._allocate(grow_s, grow_c)

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst` becomes a copy of slot `src` (a forked sample, or compaction after a slot is freed)."""
        n = self.lengths[src]
        for k, v in zip(self.k, self.v):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
        self.lengths[dst] = n


class SlotStep:
    """One forward over a SlotCache: `decode` slots take one token each, then each (slot, n) of `prefill` takes n
    tokens; the input row holds the tokens in that order. `positions` (N,) are their RoPE positions. The
    slots' lengths advance when the forward is done (`advance`). `owners`: what each decode slot, then each prefill
    entry, belongs to (the engine's sequences), for whoever inspects a step; the forward never reads it."""

    def __init__(self, cache: SlotCache, decode: list[int], prefill: list[tuple[int, int]], owners: list | None = None):
        self.cache, self.decode, self.prefill, self.owners = cache, decode, prefill, owners
        lengths = cache.lengths
        positions = [lengths[s] for s in decode]
        for slot, n in prefill:
            positions.extend(range(lengths[slot], lengths[slot] + n))
        cache.reserve(cache.slots, max(positions) + 1)
        self.positions = torch.tensor(positions, dtype=torch.long, device=cache.device)
        self.n_tokens = len(positions)
        if decode:
            self._plan_decode(decode, [lengths[s] for s in decode])

    def _plan_decode(self, slots: list[int], lengths: list[int]) -> None:
        device = self.cache.device
        self.rows = max(slots) + 1  # SDPA runs over slots [0, rows): a view of the cache, no copy
        self.contiguous = slots == list(range(self.rows))
        self.slot_index = torch.tensor(slots, dtype=torch.long, device=device)
        self.write_at = torch.tensor(lengths, dtype=torch.long, device=device)
        self.keys = max(lengths) + 1
        if self.contiguous and min(lengths) == max(lengths):
            self.mask = None  # every row sees all `keys` keys
        else:
            seen = torch.zeros(self.rows, dtype=torch.long, device=device)  # a row not decoding sees key 0 only
            seen[self.slot_index] = self.write_at
            self.mask = (torch.arange(self.keys, device=device)[None, :] <= seen[:, None])[:, None, None, :]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, hd), k and v (1, Hkv, N, hd), already rotated: write k, v into the slots and return the
        attention output (1, H, N, hd)."""
        K, V = self.cache.k[layer], self.cache.v[layer]
        outs = []
        d = len(self.decode)
        if d:
            K[self.slot_index, :, self.write_at] = k[0, :, :d].transpose(0, 1).to(K.dtype)  # (d, Hkv, hd)
            V[self.slot_index, :, self.write_at] = v[0, :, :d].transpose(0, 1).to(V.dtype)
            qd = q[0, :, :d].transpose(0, 1).unsqueeze(2)  # (d, H, 1, hd)
            if not self.contiguous:
                qd = q.new_zeros(self.rows, *qd.shape[1:]).index_copy_(0, self.slot_index, qd)
            ks, vs = K[:self.rows, :, :self.keys].to(q.dtype), V[:self.rows, :, :self.keys].to(q.dtype)
            ks, vs, gqa = expand_kv_for_cuda(qd, ks, vs, self.mask is not None)
            y = F.scaled_dot_product_attention(qd, ks, vs, attn_mask=self.mask, enable_gqa=gqa)  # (rows, H, 1, hd)
            if not self.contiguous:
                y = y.index_select(0, self.slot_index)
            outs.append(y.squeeze(2).transpose(0, 1).unsqueeze(0))  # (1, H, d, hd)
        offset = d
        for slot, n in self.prefill:
            start = self.cache.lengths[slot]
            K[slot, :, start:start + n] = k[0, :, offset:offset + n].to(K.dtype)
            V[slot, :, start:start + n] = v[0, :, offset:offset + n].to(V.dtype)
            outs.append(self._attend_chunk(q[:, :, offset:offset + n], K[slot:slot + 1, :, :start + n],
                                           V[slot:slot + 1, :, :start + n], start))
            offset += n
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    @staticmethod
    def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """One slot's chunk of n new tokens after `start` cached ones, causal."""
        n = q.shape[2]
        mask = None
        if start:  # is_causal aligns the triangle top-left (query 0 to key 0): spell the offset out
            q_pos = torch.arange(start, start + n, device=q.device)[:, None]
            mask = torch.arange(start + n, device=q.device)[None, :] <= q_pos
        k, v, gqa = expand_kv_for_cuda(q, k.to(q.dtype), v.to(q.dtype), mask is not None)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not start, enable_gqa=gqa)

    def advance(self) -> None:
        lengths = self.cache.lengths
        for slot in self.decode:
            lengths[slot] += 1
        for slot, n in self.prefill:
            lengths[slot] += n
