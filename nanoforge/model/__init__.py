"""The transformer and its KV cache; see gpt.py."""
from nanoforge.model.gpt import GPT, KVCache

__all__ = ["GPT", "KVCache"]
