"""A model loaded to generate with: what `nanoforge chat`, `generate` and `serve` each start from."""
from __future__ import annotations

import sys

from nanoforge.core.device import precision_note, resolve_device, resolve_precision
from nanoforge.weights.load import load_model


def load_for_inference(run_dir, device: str, precision: str, announce: bool = False):
    """(model, tokenizer, checkpoint, precision) with device and precision resolved; `announce` tells stderr
    what was loaded where, and the precision and why (the line every command prints)."""
    target = resolve_device(device)
    precision = resolve_precision(precision, target)
    model, tokenizer, checkpoint = load_model(run_dir, device=target)
    model.requires_grad_(False)  # never trained here: its linears may read packed weights (model/linear.py)
    if announce:
        print(f"loaded {checkpoint} ({model.num_params() / 1e6:.1f}M parameters) on {target}, {precision}\n"
              + precision_note(precision, target), file=sys.stderr)
    return model, tokenizer, checkpoint, precision
