"""Linear layers with their weights prepacked for oneDNN, on CPU (torch).

`F.linear` on CPU hands oneDNN (bf16) or MKL (fp32) a plain [out, in] weight on every call, and for
the few rows of a decode step the library spends a good part of the call on that layout: measured
on a 2-vCPU EPYC with AVX512-BF16, one thread, bf16, SmolLM2's shapes, a prepacked weight made the
M = 1 projections 1.2-2.4x faster and the 49152-row lm_head 1.8x (when this was built; cpu/plan.py measures it again on each machine). So, where
the machine's measurement says it pays (cpu/plan.py), each projection's weight is reordered once,
at load, into oneDNN's blocked layout, and called through `torch.ops.mkldnn._linear_pointwise` (the
op torch's own compiler uses for frozen CPU models). bf16 results are bit-identical to `F.linear`
(both are oneDNN); fp32 ones differ in the last bits (oneDNN's summation order, not MKL's).

In bf16, where the machine has AVX512-BF16 and its measurement says it pays, a layer also keeps its
weight a second time, laid out as one sequential stream for `torch.ops.pdserve.stream_linear`
(cpu_gemv.cpp), and uses that for steps of up to `stream_rows` rows (a decode step's streams):
it reads the weights up to twice as fast as oneDNN does at 1-8 rows. The price is the memory of a
second copy of the weights (SmolLM2: 269 MB); the results differ from oneDNN's in the last bit of
some outputs (another summation order).

In float32, on a CPU without native bf16 (where the engine computes in fp32) whose C++ kernels have
AVX2 and FMA, where the measurement says it pays, the weights are *stored* in bf16: each is rounded to
bf16 once, kept in the stream layout of `torch.ops.pdserve.stream_linear_f32` (cpu_gemv_f32.cpp),
which widens it back to fp32 in registers, for steps of up to `stream_rows` rows (half the bytes a
decode step reads), and as an fp32 copy of the same rounded values for wider steps (MKL / oneDNN).
Every step then computes with the same weights: the model's, rounded to bf16, in fp32 arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


def stream_linear_available() -> bool:
    """Whether the C++ kernels are loaded and were built with the stream GEMV (AVX512-BF16)."""
    from pdserve.ops.cpu.kernels import decode_attention_kernel  # loads (or builds) the library

    if decode_attention_kernel() is None:
        return False
    available: bool = torch.ops.pdserve.stream_linear_available()
    return available


def stream_linear_f32_available() -> bool:
    """Whether the C++ kernels are loaded and were built with the fp32 stream GEMV (AVX2 + FMA)."""
    from pdserve.ops.cpu.kernels import decode_attention_kernel

    if decode_attention_kernel() is None:
        return False
    available: bool = torch.ops.pdserve.stream_linear_f32_available()
    return available


STREAM_COLS, STREAM_PAIR = 48, 2  # cpu_gemv.cpp's kCols and kPair
STREAM_F32_COLS = 16  # cpu_gemv_f32.cpp's kCols
# Input rows per pass over a tile of the weights (the kernels' kMaxRows): a step's time on the
# stream climbs by one pass's arithmetic every this many rows (pdserve/sim/step_time.py models it).
STREAM_ROWS_PER_PASS, STREAM_F32_ROWS_PER_PASS = 8, 4


def stream_pack(weight: torch.Tensor, cols: int = STREAM_COLS) -> torch.Tensor:
    """[N, K] bf16 -> [ceil(N/cols), ceil(K/2), cols, 2]: for each tile of `cols` outputs, each pair
    of inputs, the outputs' two weights side by side (zero-padded): one forward stream of tiles."""
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, -k % STREAM_PAIR, 0, -n % cols))  # [N', K']
    tiles, pairs = padded.shape[0] // cols, padded.shape[1] // STREAM_PAIR
    return padded.view(tiles, cols, pairs, STREAM_PAIR).permute(0, 2, 1, 3).contiguous()


def stream_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:  # [M, K] bf16 -> [M, N] bf16
    out: torch.Tensor = torch.ops.pdserve.stream_linear.default(x, packed, out_features, bias)
    return out


def stream_linear_f32(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:  # [M, K] f32 (weights: bf16 in the 16-output stream layout) -> [M, N] f32
    out: torch.Tensor = torch.ops.pdserve.stream_linear_f32.default(x, packed, out_features, bias)
    return out


class PackedLinear(nn.Module):
    """nn.Linear's forward over a prepacked weight (oneDNN's layout, or the plain one when oneDNN's
    does not pay here), plus the stream layout for steps of up to `stream_rows` rows: in bf16 the
    AVX512-BF16 kernel's, in float32 the AVX2 kernel's over the weight rounded to bf16 (and then the
    wider steps' weight is that rounded one too). The weight is not a parameter any more: the model
    is loaded before its layers are packed, and never trained."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool = True, stream_rows: int = 0
    ) -> None:
        super().__init__()
        weight = weight.detach()  # [out, in]
        self.out_features, self.in_features = weight.shape
        self.stream_rows = stream_rows
        self.stream: torch.Tensor | None = None
        self.bf16_weights = stream_rows > 0 and weight.dtype == torch.float32
        if self.bf16_weights:  # stored in bf16: the stream, and its exact fp32 widening for wide steps
            rounded = weight.to(torch.bfloat16)
            self.stream = stream_pack(rounded, STREAM_F32_COLS)
            weight = rounded.to(torch.float32)
        elif stream_rows > 0:
            self.stream = stream_pack(weight)
        self.packed = pack_weight(weight) if onednn else None
        self.weight = None if onednn else weight
        self.bias = None if bias is None else bias.detach()

    @property
    def rows_per_pass(self) -> int:
        """How many of a step's rows the stream GEMV computes per pass over the weights."""
        return STREAM_F32_ROWS_PER_PASS if self.bf16_weights else STREAM_ROWS_PER_PASS

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.stream is not None and x.shape[0] <= self.stream_rows:
            if self.bf16_weights:
                return stream_linear_f32(x, self.stream, self.out_features, self.bias)
            return stream_linear(x, self.stream, self.out_features, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        layouts = ["onednn prepacked" if self.packed is not None else "plain"]
        if self.stream is not None:
            stored = ", weights stored in bf16" if self.bf16_weights else ""
            layouts.append(f"stream GEMV up to {self.stream_rows} rows{stored}")
        return f"in_features={self.in_features}, out_features={self.out_features}, {', '.join(layouts)}"


def pack_linears(module: nn.Module, onednn: bool = True, stream_rows: int = 0) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear (CPU only); returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
            setattr(module, name, PackedLinear(child.weight, child.bias, onednn, stream_rows))
            count += 1
        else:
            count += pack_linears(child, onednn, stream_rows)
    return count
