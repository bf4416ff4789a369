// A bf16 linear layer for the few rows of a decode step, over weights laid out as one stream.
//
// A batch-1 decode step reads every weight once, from memory, and does two flops per weight read:
// it is bound by how fast the weights stream in. oneDNN's kernels, made for wider matmuls, read a
// decode step's weights at ~11 GB/s on a 2-vCPU EPYC whose memory gives ~24 GB/s to one thread.
// This kernel reads them as a single sequential stream: the weight [N, K] is stored as
// [ceil(N/8), ceil(K/32), 8, 32] (eight output rows' next 32 inputs side by side, zero-padded), so
// each `vdpbf16ps` takes the next 64 bytes, and the hardware prefetcher sees one forward stream
// (software prefetch measured slower: it competes with the hardware's). Measured on SmolLM2's
// projections: 1.5-2x oneDNN's speed at M = 1 on one thread; from ~3 rows on, oneDNN's
// register-blocked GEMM wins, so callers use this only below a row count measured per machine
// (cpu_choice.py).
//
//   stream_linear(x [M, K] bf16, packed [ceil(N/8), ceil(K/32), 8, 32] bf16, N, bias [N] or None)
//     -> [M, N] bf16: x @ W.T + bias, summed in fp32, rounded once to bf16 (round to nearest even)
//   stream_linear_available() -> bool: whether this build has it (AVX512-BF16 at compile time)
//
// Numerics: fp32 products of bf16 inputs (exact), summed in fp32 in another order than oneDNN's, so
// results differ from F.linear's in the last bit of some outputs (tests/test_cpu_gemv.py bounds it).
//
// Built with the other kernels into one library by cpu_kernels.py; torch.ops.pdserve.*.

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

constexpr int64_t kRows = 8;    // output rows per group
constexpr int64_t kDepth = 32;  // inputs per 64-byte piece

#ifdef PDSERVE_STREAM_GEMV

// MR input rows against one group of eight output rows: MR * 8 accumulators (MR <= 2: 16 of the 32
// vector registers). A three-row variant (24 accumulators) measured 7-10% faster at M = 3-4 in one
// scratch run, within this machine's noise; not kept.
template <int MR>
void group_rows(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K, int64_t pieces,
                const float* bias, uint16_t* out, int64_t out_stride, int64_t rows_here) {
  __m512 acc[MR][kRows];
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < kRows; ++i) acc[m][i] = _mm512_setzero_ps();
  for (int64_t piece = 0; piece < pieces; ++piece, w += kRows * kDepth) {
    const int64_t k = piece * kDepth;
    // The last piece may run past K: load only what is there (the weight's padding is zero).
    const __mmask32 mask = k + kDepth <= K ? ~__mmask32(0) : static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * x_stride + k);
    for (int i = 0; i < kRows; ++i) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i * kDepth);
      for (int m = 0; m < MR; ++m) acc[m][i] = _mm512_dpbf16_ps(acc[m][i], wv, xv[m]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t i = 0; i < rows_here; ++i) {
      const float sum = _mm512_reduce_add_ps(acc[m][i]);
      out[m * out_stride + i] = pdserve_vec::bf16_bits(bias == nullptr ? sum : sum + bias[i]);
    }
}

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
                  packed.size(2) == kRows && packed.size(3) == kDepth,
              "stream_linear: packed must be a contiguous [N/8, K/32, 8, 32] bfloat16 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t groups = packed.size(0), pieces = packed.size(1);
  TORCH_CHECK(N > 0 && (N + kRows - 1) / kRows == groups, "stream_linear: N does not match the packed weight");
  TORCH_CHECK((K + kDepth - 1) / kDepth == pieces, "stream_linear: x has ", K, " columns; the weight wants ",
              pieces * kDepth, " (padded)");
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
  const int64_t group_size = pieces * kRows * kDepth;
  at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint16_t* w = wp + g * group_size;
      const int64_t n0 = g * kRows, rows_here = N - n0 < kRows ? N - n0 : kRows;
      const float* b = bp == nullptr ? nullptr : bp + n0;
      // Pairs of input rows share each weight load; later pairs find the group in L1/L2.
      int64_t m = 0;
      for (; m + 2 <= M; m += 2)
        group_rows<2>(xp + m * x_stride, x_stride, w, K, pieces, b, op + m * N + n0, N, rows_here);
      if (m < M) group_rows<1>(xp + m * x_stride, x_stride, w, K, pieces, b, op + m * N + n0, N, rows_here);
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
