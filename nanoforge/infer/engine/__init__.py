"""One generation engine for every command that generates (see core.py): continuous batching over a KV cache
of slots, per-sequence sampling (sampler.py), incremental text with stop strings (text.py)."""
from nanoforge.infer.engine.core import Engine, Request, Sequence

__all__ = ["Engine", "Request", "Sequence"]
