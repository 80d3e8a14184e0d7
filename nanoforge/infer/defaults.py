"""Defaults of `nanoforge chat`, shared with `generate`, `serve` and the CLI, in a module that imports nothing:
`nanoforge --help` shows them without loading torch.

A little randomness and a mild repetition penalty keep a small model from looping; top-k and top-p cut off its
long tail of unlikely tokens.
"""
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_K = 50
DEFAULT_TOP_P = 0.9
DEFAULT_REPETITION_PENALTY = 1.1
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_DEVICE = "auto"
DEFAULT_PRECISION = "auto"  # bf16 on a GPU that supports it, else fp32 (bf16 on a CPU is slower, not faster)
PRECISION_CHOICES = ("auto", "fp32", "bf16", "fp16")
