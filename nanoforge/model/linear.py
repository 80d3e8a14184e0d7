"""The model's linear layer: nn.Linear, plus a faster path for generating on a CPU.

A decoding step multiplies each weight by a handful of rows (one per sequence in the batch). For those shapes
MKL's sgemm (what F.linear runs on a CPU) is well below what the memory allows; oneDNN's matmul over a weight
reordered once into its blocked layout is faster (docs/perf.md, "Decode linears", has the figures and the
command). So, without autograd, in float32 on a CPU and for 2 to PACKED_MAX_ROWS rows, the layer multiplies by a
packed copy of its weight; everything else (training, one row, a long prefill, other dtypes and devices) is
nn.Linear's own path. The copy is made on first use and made again whenever the weight changes (its version
counter or storage moves: an optimizer step, a load), so a model that trains between rollouts never reads stale
weights. It is not a parameter or a buffer: state dicts, exports and `isinstance(m, nn.Linear)` are unchanged."""
import torch
import torch.nn as nn
import torch.nn.functional as F

PACKED_MIN_ROWS, PACKED_MAX_ROWS = 2, 64


def _packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_AVAILABLE = _packing_available()


class Linear(nn.Linear):
    """nn.Linear with the packed CPU path described in the module doc."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._packed: tuple | None = None  # (weight version, storage pointer, packed weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _AVAILABLE and self._use_packed(x):
            return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)

    def _use_packed(self, x: torch.Tensor) -> bool:
        rows = x.numel() // max(x.shape[-1], 1)
        return (not torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype == torch.float32
                and self.weight.dtype == torch.float32 and PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS)

    def _packed_weight(self) -> torch.Tensor:
        key = (self.weight._version, self.weight.data_ptr())
        if self._packed is None or self._packed[:2] != key:
            with torch.no_grad():
                self._packed = (*key, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None))
        return self._packed[2]
