"""The model's linear layer: nn.Linear, plus a faster path for generating on a CPU.

A decoding step multiplies each weight by a handful of rows (one per sequence in the batch). For those shapes
MKL's sgemm (what F.linear runs on a CPU) is well below what the memory allows; oneDNN's matmul over a weight
reordered once into its blocked layout is faster (docs/perf.md, "Decode steps on oneDNN-packed weights", has
the figures and the command). So, without autograd, in float32 on a CPU, for 2 to PACKED_MAX_ROWS rows and for
a frozen weight (one that does not require grad: a model loaded to generate, a reference or teacher model), the
layer multiplies by a packed copy of its weight; everything else (training, one row, a long prefill, other
dtypes and devices, and a policy sampling between its own optimizer steps) is nn.Linear's own path.

Frozen, because an optimizer may change a weight without a trace: the fused AdamW this project uses on a CPU
updates parameters in place without bumping their version counter, so a copy keyed on the version would go stale
between RL steps. A frozen weight changed in place anyway (load_state_dict, copy_) does bump it: the copy is
made on first use and again whenever the weight's version or storage changes. It is not a parameter or a
buffer: state dicts, exports and `isinstance(m, nn.Linear)` are unchanged; it costs one more copy of the frozen
weights in memory."""
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
        return (not torch.is_grad_enabled() and not self.weight.requires_grad and x.device.type == "cpu"
                and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS)

    def _packed_weight(self) -> torch.Tensor:
        key = (self.weight._version, self.weight.data_ptr())
        if self._packed is None or self._packed[:2] != key:
            with torch.no_grad():
                self._packed = (*key, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None))
        return self._packed[2]
