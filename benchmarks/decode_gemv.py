"""A batch-1 decode's linear layers: oneDNN's prepacked `_linear_pointwise` (what the engine calls)
against an experimental bf16 GEMV over weights laid out as one sequential stream (AVX512-BF16 only).

A b1 decode step reads every weight once, from memory: SmolLM2's 30 layers' four projections are
212 MB in bf16, far more than the last-level cache, and this loop cycles over all of them as a
step does. The experiment's layout: [N/8, K/32, 8, 32] — eight output rows' 32-element pieces
side by side, so one `vdpbf16ps` per row reads the next 64 bytes of a single stream, with
software prefetch ahead of it. Not used by the engine (yet): a measurement of what a GEMV of our
own could give (docs/performance.md, "Why a b1 or b8 step gains little from a second thread").

    .venv/bin/python benchmarks/decode_gemv.py --threads 1 2 --rounds 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

// x: [K] bf16; w: [N/8, K/32, 8, 32] bf16 (see pack() in the script); returns [1, N] bf16.
at::Tensor gemv_stream(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K) {
  TORCH_CHECK(N % 8 == 0 && K % 32 == 0, "N % 8 and K % 32 must be 0");
  auto out = at::empty({1, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, N / 8, 8, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint16_t* p = wp + g * 8 * K;
      __m512 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 32, p += 256) {
        for (int i = 0; i < 8; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + 2048 + 32 * i), _MM_HINT_T0);
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xp + k);
        for (int i = 0; i < 8; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(p + 32 * i), xv);
      }
      for (int i = 0; i < 8; ++i) {  // fp32 -> bf16, round to nearest even
        const float s = _mm512_reduce_add_ps(acc[i]);
        uint32_t bits;
        std::memcpy(&bits, &s, 4);
        bits += 0x7fff + ((bits >> 16) & 1);
        op[g * 8 + i] = static_cast<uint16_t>(bits >> 16);
      }
    }
  });
  return out;
}
"""

# SmolLM2-135M's projections per layer: qkv, o, gate_up, down ([out, in]).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def pack(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape  # [N, K] -> [N/8, K/32, 8, 32]
    return w.view(n // 8, 8, k // 32, 32).permute(0, 2, 1, 3).contiguous()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args()
    ext = load_inline(
        "pdserve_decode_gemv_experiment",
        cpp_sources=SOURCE,
        functions=["gemv_stream"],
        extra_cflags=["-O3", "-march=native"],
    )
    torch.manual_seed(0)
    weights = [
        [torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for n, k in SHAPES] for _ in range(args.layers)
    ]
    ours = [[pack(w) for w in layer] for layer in weights]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in layer] for layer in weights]
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}
    total = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    w, x = weights[0][2], xs[576]
    ref = torch.nn.functional.linear(x.float(), w.float())
    mine = ext.gemv_stream(x.view(-1), ours[0][2], *w.shape).float()
    theirs = torch.ops.mkldnn._linear_pointwise.default(x, onednn[0][2], None, "none", [], "").float()
    print(
        f"max |diff| against fp32: stream {(mine - ref).abs().max():.2e}, oneDNN {(theirs - ref).abs().max():.2e}"
    )

    def run_stream() -> None:
        for layer, packed in zip(weights, ours, strict=True):
            for w, pw in zip(layer, packed, strict=True):
                ext.gemv_stream(xs[w.shape[1]].view(-1), pw, *w.shape)

    def run_onednn() -> None:
        for layer, packed in zip(weights, onednn, strict=True):
            for w, pw in zip(layer, packed, strict=True):
                torch.ops.mkldnn._linear_pointwise.default(xs[w.shape[1]], pw, None, "none", [], "")

    print(
        f"{total / 1e6:.0f} MB of bf16 weights per pass ({args.layers} layers); medians of {args.rounds}, interleaved"
    )
    for threads in args.threads:
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {"stream GEMV": [], "oneDNN": []}
        for _ in range(args.rounds):
            for name, fn in (("stream GEMV", run_stream), ("oneDNN", run_onednn)):
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(v) for name, v in times.items()}
        for name, med in medians.items():
            print(f"threads {threads}  {name:12s} {med * 1000:7.2f} ms  {total / med / 1e9:5.1f} GB/s")
        print(f"threads {threads}  oneDNN / stream: {medians['oneDNN'] / medians['stream GEMV']:.2f}x")


if __name__ == "__main__":
    main()
