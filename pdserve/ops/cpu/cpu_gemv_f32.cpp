// A float32 linear layer over weights stored in bf16, for the rows of a decode step (AVX2 + FMA).
//
// On a CPU without native bf16 (AVX2-only, or AVX-512 without AVX512-BF16) the engine computes in
// float32, and a batch-1 decode step is bound by reading the weights: SmolLM2-135M's 540 MB of fp32
// weights a token at ~11.6 GB/s on one core of an AVX2-only EPYC. Stored in bf16 they are half the
// bytes; widening a bf16 to an fp32 is a 16-bit shift (a bf16 is the top half of an fp32), so the
// arithmetic stays float32 (fp32 products of bf16-rounded weights and fp32 inputs, fp32 sums).
//
// The weight uses the stream layout of the AVX512-BF16 kernel (cpu_gemv.cpp), with its own tile
// width: [N, K] is stored as [ceil(N/16), ceil(K/2), 16, 2] (for each tile of 16 outputs, each pair
// of inputs: the 16 outputs' two weights side by side, zero-padded), one forward stream of tiles. One
// 256-bit load holds 8 outputs x 2 inputs; the even input's weights are the load shifted left by 16
// bits, the odd input's the load with its low halves cleared. Up to four input rows share each load
// (8 accumulators + 4 widened weights + 2 broadcasts of the 16 ymm registers). Measured against
// MKL's fp32 F.linear on SmolLM2's projections, one thread, AVX2-only EPYC (docs/performance.md):
// ~2x at 1 row, 2.5-3.5x at 2-4 (MKL is slow there), 1.6x at 8, 1.2x at 16, even at 32, 0.88x at 64.
//
//   stream_linear_f32(x [M, K] f32, packed [ceil(N/16), ceil(K/2), 16, 2] bf16, N, bias [N] f32 or None)
//     -> [M, N] f32: x @ W.T + bias with W the bf16 weight widened exactly
//   stream_linear_f32_available() -> bool: whether this build has it (AVX2 and FMA at compile time)
//
// Numerics: the same products as float32 F.linear over the bf16-rounded weight, summed in another
// order (two input streams, even and odd, per accumulator), so results differ from it in the last
// bits (tests/test_cpu_gemv_f32.py bounds it).
//
// Built with the other kernels into one library by cpu/kernels.py; torch.ops.pdserve.*.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_STREAM_GEMV_F32 1
#endif

namespace {

constexpr int kVecs = 2;               // vectors of 8 fp32 outputs per tile
constexpr int64_t kCols = 8 * kVecs;   // outputs per tile
constexpr int64_t kPair = 2;           // inputs per weight pair
constexpr int kMaxRows = 4;            // input rows per pass over a tile
// A pair of inputs is one 64-byte line of the tile; the line this far ahead in the stream is asked
// for now. Measured on an AVX2-only EPYC, one thread, M = 1: 6.7 GB/s without, 7.5 with 256 bytes,
// ~9.6 with 4-8 KiB (MKL's fp32 GEMV read 8-9.7 GB/s in the same runs). A prefetch never faults, so
// the last lines may look past the weight's end.
constexpr int64_t kPrefetchBytes = 4096;

#ifdef PDSERVE_STREAM_GEMV_F32

// MR input rows against one tile of kCols outputs, over all K inputs. A chain of FMAs into one
// accumulator waits ~4-5 cycles a link, so with few rows the sums are split to keep ~8 chains in
// flight: SPLIT keeps the even and the odd input's products apart, U pairs in turn go to U sets.
template <int MR, int U, bool SPLIT>
void tile_rows(const float* x, int64_t x_stride, const uint16_t* w, int64_t K, const float* bias, float* out,
               int64_t out_stride, int64_t cols_here) {
  constexpr int kSets = U * (SPLIT ? 2 : 1);
  __m256 acc[kSets][MR][kVecs];
  for (int s = 0; s < kSets; ++s)
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < kVecs; ++v) acc[s][m][v] = _mm256_setzero_ps();
  const __m256i high_halves = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  // One pair of inputs (p) into accumulator set u; `odd_input` false for an odd K's last input.
  const auto pair = [&](const uint16_t* w_pair, int64_t p, int u, bool odd_input) {
    __m256 even[kVecs], odd[kVecs];
    _mm_prefetch(reinterpret_cast<const char*>(w_pair) + kPrefetchBytes, _MM_HINT_T0);
    for (int v = 0; v < kVecs; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_pair + v * 8 * kPair));
      even[v] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      odd[v] = _mm256_castsi256_ps(_mm256_and_si256(raw, high_halves));
    }
    const int se = u * (SPLIT ? 2 : 1), so = se + (SPLIT ? 1 : 0);
    for (int m = 0; m < MR; ++m) {
      const __m256 xe = _mm256_broadcast_ss(x + m * x_stride + p * kPair);
      for (int v = 0; v < kVecs; ++v) acc[se][m][v] = _mm256_fmadd_ps(even[v], xe, acc[se][m][v]);
      if (odd_input) {
        const __m256 xo = _mm256_broadcast_ss(x + m * x_stride + p * kPair + 1);
        for (int v = 0; v < kVecs; ++v) acc[so][m][v] = _mm256_fmadd_ps(odd[v], xo, acc[so][m][v]);
      }
    }
  };
  const int64_t full_pairs = K / kPair;
  int64_t p = 0;
  for (; p + U <= full_pairs; p += U)
    for (int u = 0; u < U; ++u) pair(w + (p + u) * kCols * kPair, p + u, u, true);
  for (; p < full_pairs; ++p) pair(w + p * kCols * kPair, p, 0, true);
  if (K % kPair != 0) pair(w + full_pairs * kCols * kPair, full_pairs, 0, false);  // its pair's 2nd weight: padding
  for (int s = 1; s < kSets; ++s)
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < kVecs; ++v) acc[0][m][v] = _mm256_add_ps(acc[0][m][v], acc[s][m][v]);
  // Bias added in fp32; only the tile's real outputs are stored.
  alignas(32) static constexpr int32_t kLane[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  const __m256i lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLane));
  for (int v = 0; v < kVecs; ++v) {
    const int64_t here = cols_here - 8 * v;
    if (here <= 0) break;
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(here < 8 ? here : 8)), lanes);
    const __m256 b = bias == nullptr ? _mm256_setzero_ps() : _mm256_maskload_ps(bias + 8 * v, keep);
    for (int m = 0; m < MR; ++m)
      _mm256_maskstore_ps(out + m * out_stride + 8 * v, keep, _mm256_add_ps(acc[0][m][v], b));
  }
}

using TileRows = void (*)(const float*, int64_t, const uint16_t*, int64_t, const float*, float*, int64_t, int64_t);
constexpr TileRows kTileRows[kMaxRows + 1] = {nullptr, tile_rows<1, 2, true>, tile_rows<2, 1, true>,
                                              tile_rows<3, 1, false>, tile_rows<4, 1, false>};

#endif  // PDSERVE_STREAM_GEMV_F32

bool stream_linear_f32_available() {
#ifdef PDSERVE_STREAM_GEMV_F32
  return true;
#else
  return false;
#endif
}

int64_t stream_f32_cols() { return kCols; }

at::Tensor stream_linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                             const std::optional<at::Tensor>& bias) {
#ifndef PDSERVE_STREAM_GEMV_F32
  TORCH_CHECK(false, "stream_linear_f32: this build has no AVX2/FMA (see stream_linear_f32_available())");
#else
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "stream_linear_f32: x must be [M, K] float32");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kCols && packed.size(3) == kPair,
              "stream_linear_f32: packed must be a contiguous [N/", kCols, ", K/2, ", kCols, ", 2] bfloat16 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t tiles = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(N > 0 && (N + kCols - 1) / kCols == tiles, "stream_linear_f32: N does not match the packed weight");
  TORCH_CHECK(K > 0 && (K + kPair - 1) / kPair == pairs, "stream_linear_f32: x has ", K,
              " columns; the weight wants ", pairs * kPair, " (padded)");
  at::Tensor bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "stream_linear_f32: bias must be [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const int64_t x_stride = xc.stride(0);
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* op = out.data_ptr<float>();
  const float* bp = bias.has_value() ? bias_f32.data_ptr<float>() : nullptr;
  const int64_t tile_size = pairs * kCols * kPair;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* w = wp + t * tile_size;
      const int64_t n0 = t * kCols, cols_here = N - n0 < kCols ? N - n0 : kCols;
      const float* b = bp == nullptr ? nullptr : bp + n0;
      // kMaxRows rows at a time share each weight load; later groups find the tile in L1/L2.
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
  m.def("stream_linear_f32_available() -> bool", &stream_linear_f32_available);
  m.def("stream_f32_cols() -> int", &stream_f32_cols);
  m.def("stream_linear_f32(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("stream_linear_f32", &stream_linear_f32); }
