"""The transformer and its KV cache; see gpt.py."""
from nanoforge.model.gpt import GPT
from nanoforge.model.kvcache import KVCache

__all__ = ["GPT", "KVCache"]
