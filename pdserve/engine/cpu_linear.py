"""Linear layers with their weights prepacked for oneDNN, on CPU (torch).

`F.linear` on CPU hands oneDNN (bf16) or MKL (fp32) a plain [out, in] weight on every call, and for
the few rows of a decode step the library spends a good part of the call on that layout: measured
on a 2-vCPU EPYC with AVX512-BF16, one thread, bf16, SmolLM2's shapes, a prepacked weight made the
M = 1 projections 1.2-2.4x faster and the 49152-row lm_head 1.8x (docs/performance.md). So, where
the machine's measurement says it pays (cpu_choice.py), each projection's weight is reordered once,
at load, into oneDNN's blocked layout, and called through `torch.ops.mkldnn._linear_pointwise` (the
op torch's own compiler uses for frozen CPU models). bf16 results are bit-identical to `F.linear`
(both are oneDNN); fp32 ones differ in the last bits (oneDNN's summation order, not MKL's).
"""

from __future__ import annotations

import torch
from torch import nn

# oneDNN picks the blocked layout for this many rows; measured, the layout chosen for a few rows
# serves the decode steps best and costs prefill (hundreds of rows) nothing noticeable.
BATCH_HINT = 1


def onednn_available() -> bool:
    available = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    return available and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the same weight in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The overload itself, not the packet: resolving the packet costs ~3 us of Python a call
    # (measured at 22 -> 19 us for a tiny weight; ~120 calls a decode step).
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")
    return out


class PackedLinear(nn.Module):
    """nn.Linear's forward over a prepacked weight. The weight is not a parameter any more: the
    model is loaded before its layers are packed, and never trained."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn prepacked"


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear (CPU only); returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
