// A bf16 linear layer for the rows of a decode step, over weights laid out as one stream.
//
// A batch-1 decode step reads every weight once, from memory, and does two flops per weight read:
// it is bound by how fast the weights stream in. oneDNN's kernels, made for wider matmuls, read a
// decode step's weights at ~11 GB/s on a 2-vCPU EPYC whose memory gives ~24 GB/s to one thread, and
// at 8-32 rows they reach half of the core's bf16 rate. This kernel reads the weight as a single
// forward stream of column tiles: [N, K] is stored as [ceil(N/48), ceil(K/2), 48, 2] (for each tile
// of 48 outputs, each pair of inputs: the 48 outputs' two weights side by side, zero-padded), the
// layout `vdpbf16ps` takes with one input pair broadcast to every lane. Up to eight input rows share
// each weight load (24 fp32 accumulators, three per row, no horizontal sums); the tile is read from
// memory once and from L1/L2 for further groups of eight rows. Software prefetch measured slower
// than none (it competes with the hardware prefetcher, which sees one stream). Measured on
// SmolLM2's projections, one thread (docs/performance.md): 1.6-1.9x oneDNN's speed at 1-8 rows,
// 1.2x at 32, about even from 64 rows on; 48-output tiles ran 3-8% faster than 32-output ones.
// Callers use it up to a row count measured per machine (cpu/plan.py).
//
//   stream_linear(x [M, K] bf16, packed [ceil(N/48), ceil(K/2), 48, 2] bf16, N, bias [N] or None)
//     -> [M, N] bf16: x @ W.T + bias, summed in fp32, rounded once to bf16 (round to nearest even)
//   stream_linear_available() -> bool: whether this build has it (AVX512-BF16 at compile time)
//
// Numerics: fp32 products of bf16 inputs (exact), summed in fp32 in another order than oneDNN's, so
// results differ from F.linear's in the last bit of some outputs (tests/test_cpu_gemv.py bounds it).
//
// Built with the other kernels into one library by cpu/kernels.py; torch.ops.pdserve.*.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>

#include "cpu_vec.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PDSERVE_STREAM_GEMV 1
#endif

namespace {

constexpr int kVecs = 3;                // vectors of 16 fp32 accumulators per row and tile
constexpr int64_t kCols = 16 * kVecs;   // outputs per tile
constexpr int64_t kPair = 2;            // inputs per lane of `vdpbf16ps`
constexpr int kMaxRows = 8;             // input rows per pass over a tile: 24 of the 32 vector registers

#ifdef PDSERVE_STREAM_GEMV

// MR input rows against one tile of kCols outputs, over all K inputs.
template <int MR>
void tile_rows(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K, const float* bias,
               uint16_t* out, int64_t out_stride, int64_t cols_here) {
  __m512 acc[MR][kVecs];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) acc[m][v] = _mm512_setzero_ps();
  const auto step = [&](const uint16_t* w_pair, const uint32_t* pairs) {
    __m512bh wv[kVecs];  // 16 outputs each, two inputs per output
    for (int v = 0; v < kVecs; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w_pair + v * 16 * kPair);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pairs[m]));
      for (int v = 0; v < kVecs; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], wv[v], xv);
    }
  };
  const int64_t full_pairs = K / kPair;
  uint32_t pairs[MR];
  for (int64_t p = 0; p < full_pairs; ++p, w += kCols * kPair) {
    for (int m = 0; m < MR; ++m) std::memcpy(&pairs[m], x + m * x_stride + p * kPair, sizeof(uint32_t));
    step(w, pairs);
  }
  if (K % kPair != 0) {  // an odd K: the last input alone (reading its neighbour would pass the row's end)
    for (int m = 0; m < MR; ++m) pairs[m] = x[m * x_stride + K - 1];
    step(w, pairs);
  }
  // Bias added in fp32, then one rounding to bf16 (round to nearest even); only the tile's real
  // outputs are stored.
  __mmask16 keep[kVecs];
  __m512 b[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    const int64_t here = cols_here - 16 * v;
    keep[v] = here >= 16 ? static_cast<__mmask16>(0xFFFF) : here <= 0 ? 0 : static_cast<__mmask16>((1u << here) - 1);
    b[v] = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(keep[v], bias + 16 * v);
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][v], b[v]));
      _mm256_mask_storeu_epi16(out + m * out_stride + 16 * v, keep[v], (__m256i)rounded);
    }
}

using TileRows = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, uint16_t*, int64_t,
                          int64_t);
constexpr TileRows kTileRows[kMaxRows + 1] = {nullptr,       tile_rows<1>, tile_rows<2>, tile_rows<3>, tile_rows<4>,
                                              tile_rows<5>, tile_rows<6>, tile_rows<7>, tile_rows<8>};

#endif  // PDSERVE_STREAM_GEMV

bool stream_linear_available() {
#ifdef PDSERVE_STREAM_GEMV
  return true;
#else
  return false;
#endif
}

at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias) {
#ifndef PDSERVE_STREAM_GEMV
  TORCH_CHECK(false, "stream_linear: this build has no AVX512-BF16 (see stream_linear_available())");
#else
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "stream_linear: x must be [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kCols && packed.size(3) == kPair,
              "stream_linear: packed must be a contiguous [N/48, K/2, 48, 2] bfloat16 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t tiles = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(N > 0 && (N + kCols - 1) / kCols == tiles, "stream_linear: N does not match the packed weight");
  TORCH_CHECK(K > 0 && (K + kPair - 1) / kPair == pairs, "stream_linear: x has ", K, " columns; the weight wants ",
              pairs * kPair, " (padded)");
  at::Tensor bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "stream_linear: bias must be [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();  // added in fp32, before the one rounding
  }
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const int64_t x_stride = xc.stride(0);
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float* bp = bias.has_value() ? bias_f32.data_ptr<float>() : nullptr;
  const int64_t tile_size = pairs * kCols * kPair;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* w = wp + t * tile_size;
      const int64_t n0 = t * kCols, cols_here = N - n0 < kCols ? N - n0 : kCols;
      const float* b = bp == nullptr ? nullptr : bp + n0;
      // Eight rows at a time share each weight load; later groups find the tile in L1/L2.
      for (int64_t m = 0; m < M; m += kMaxRows) {
        const int64_t rows = M - m < kMaxRows ? M - m : kMaxRows;
        kTileRows[rows](xp + m * x_stride, x_stride, w, K, b, op + m * N + n0, N, cols_here);
      }
    }
  });
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("stream_linear_available() -> bool", &stream_linear_available);
  m.def("stream_linear(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("stream_linear", &stream_linear); }
