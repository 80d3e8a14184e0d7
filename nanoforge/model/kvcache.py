"""The keys and values of the tokens a model has seen, for generation one token at a time (GPT.forward's
`cache`)."""
import torch

from nanoforge.core.errors import NanoforgeError


class KVCache:
    """Keys and values of the tokens seen so far, preallocated per layer as (B, n_kv_heads, max_len, head_dim).

    `length` is how many positions are filled (the same for every row; left padding makes rows of different
    lengths line up). A forward with a cache writes its new keys and values at [length, length + T) in every
    layer and then advances `length` by T. Create one with `GPT.new_cache`."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.max_len:
            raise NanoforgeError(f"KV cache overflow: it holds {self.length} of {self.max_len} positions and "
                                 f"{n_new} more were given; create the cache with a larger max_len")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv_heads, T, hd) after the cached positions; return all keys and values so far,
        (B, n_kv_heads, length + T, hd). `length` itself moves once per forward, in `advance`."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n_new: int) -> None:
        self.length += n_new
