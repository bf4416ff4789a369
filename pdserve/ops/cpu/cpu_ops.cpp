// Fused per-layer ops of the Llama family on CPU: what the portable path does in several torch ops
// (each a pass over memory and ~5 us of dispatch), here in one pass each:
//   rms_norm            out = w * (x / rms(x))                      (HF: in fp32, then the model dtype)
//   add_rms_norm        residual += x, then out = rms_norm(residual)  (residual updated in place)
//   rotary_and_cache    RoPE (rotate-half) on q in place in the qkv rows, RoPE on k, then k and v
//                       written to their cache slots
//   silu_and_mul        out = silu(gate) * up
//   argmax_rows         the index of each row's largest value (greedy sampling), as torch.argmax:
//                       the first of equal maxima, the first NaN if the row has one
// Numerics follow Hugging Face's modules op for op, with the same roundings to the model dtype
// between them (a bf16 product is rounded to bf16 before it is added, as torch does), so greedy
// outputs stay those of the portable path. No FMA contraction where torch rounds in between.
//
// Built with cpu_attention.cpp into one library by cpu/kernels.py; torch.ops.pdserve.*.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_vec.h"

namespace {

using namespace pdserve_vec;

// Element access on raw storage (float, or the 16 bits of a bf16) with conversions written as plain
// integer arithmetic, so that gcc vectorizes the loops below (c10::BFloat16's own conversion does
// the same rounding, round to nearest even with NaN kept, but its loops stay scalar).
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  using raw = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
  static float round(float x) { return x; }
};

template <>
struct Elem<c10::BFloat16> {
  using raw = uint16_t;
  static float load(uint16_t b) { return from_bf16_bits(b); }
  static uint16_t store(float f) { return bf16_bits(f); }
  static float round(float f) { return load(store(f)); }  // the value as bf16 holds it
};

template <typename T>
using raw_t = typename Elem<T>::raw;

template <typename T>
inline raw_t<T>* raw(at::Tensor& t) {
  return reinterpret_cast<raw_t<T>*>(t.mutable_data_ptr<T>());
}

template <typename T>
inline const raw_t<T>* raw(const at::Tensor& t) {
  return reinterpret_cast<const raw_t<T>*>(t.const_data_ptr<T>());
}

// e^x over the whole float range, Cephes' expf polynomial (~1 ulp), branch-free so that `omp simd`
// loops vectorize it (glibc's expf does not vectorize without -ffast-math). Up to ~88.72 the result
// is finite (silu(-88.5) needs e^88.5 = 2.7e38), past it inf: 2^n is applied as 2^(n - 1) * 2 so
// that n = 128 does not build an exponent field of 255. Below -87 it stays at e^-87, which is all
// silu needs (1 + e^x rounds to 1 long before).
constexpr float EXP_MAX_ARG = 88.75f;  // > log(FLT_MAX) = 88.7228: every larger x gives inf

inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.0f), EXP_MAX_ARG);
  const float n = std::floor(x * LOG2E + 0.5f);
  const float p = exp_reduced(x, n);
  return p * from_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 126) << 23) * 2.0f;
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, n] with contiguous rows, got ", x.sizes(),
              " strides ", x.strides());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", x.scalar_type());
}

// One row: out = w * round(x * inv_rms) (HF's `weight * hidden.to(input_dtype)`).
template <typename T>
void norm_row(const raw_t<T>* __restrict x, const raw_t<T>* __restrict w, raw_t<T>* __restrict out, int64_t n,
              float eps) {
  using E = Elem<T>;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = E::load(x[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = E::store(E::load(w[i]) * E::round(E::load(x[i]) * inv));
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, at::Tensor* residual, double eps) {
  using E = Elem<T>;
  const int64_t rows = x.size(0), n = x.size(1);
  const raw_t<T>* xp = raw<T>(x);
  const raw_t<T>* wp = raw<T>(w);
  raw_t<T>* op = raw<T>(out);
  raw_t<T>* rp = residual ? raw<T>(*residual) : nullptr;
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const raw_t<T>* src = xp + r * xs;
      if (rp != nullptr) {  // residual = residual + x, rounded as torch's add; then its norm
        raw_t<T>* res = rp + r * rs;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) res[i] = E::store(E::load(res[i]) + E::load(src[i]));
        src = res;
      }
      norm_row<T>(src, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
}

at::Tensor norm_common(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor* residual) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be contiguous [", x.size(1), "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x dtypes differ");
  if (residual != nullptr) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x: ", residual->sizes(), " vs ", x.sizes());
  }
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(x, weight, out, residual, eps);
  } else {
    rms_norm_impl<c10::BFloat16>(x, weight, out, residual, eps);
  }
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm_common(x, weight, eps, nullptr);
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps) {
  return norm_common(x, weight, eps, &residual);
}

// One head's rows rotated (rotate-half layout): out1 = x1*c - x2*s, out2 = x2*c + x1*s over the two
// halves, each product rounded to T before the sum (HF: q * cos + rotate_half(q) * sin in T, with
// cos and sin already in T). `out` may be `x` (q is rotated in place).
template <typename T>
__attribute__((optimize("fp-contract=off"))) inline void rotate(const raw_t<T>* x, raw_t<T>* out,
                                                                 const float* __restrict c,
                                                                 const float* __restrict s, int64_t half) {
  using E = Elem<T>;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = E::load(x[i]), x2 = E::load(x[i + half]);
    const float a = E::round(x1 * c[i]), b = E::round(-x2 * s[i]);
    const float e = E::round(x2 * c[i + half]), f = E::round(x1 * s[i + half]);
    out[i] = E::store(a + b);
    out[i + half] = E::store(e + f);
  }
}

template <typename T>
void rotary_and_cache_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slots, int64_t H, int64_t KVH, int64_t D) {
  using E = Elem<T>;
  const int64_t T_ = qkv.size(0), row = qkv.stride(0), half = D / 2;
  raw_t<T>* base = raw<T>(qkv);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  raw_t<T>* kc = raw<T>(k_cache);
  raw_t<T>* vc = raw<T>(v_cache);
  const int64_t cache_row = KVH * D;
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    // cos/sin of a position as T holds them, widened back: HF multiplies by cos.to(dtype).
    float c[512], s[512];
    for (int64_t t = begin; t < end; ++t) {
      const float* crow = cp + pos[t] * D;
      const float* srow = sp + pos[t] * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) {
        c[i] = E::round(crow[i]);
        s[i] = E::round(srow[i]);
      }
      raw_t<T>* q = base + t * row;
      for (int64_t h = 0; h < H; ++h) rotate<T>(q + h * D, q + h * D, c, s, half);
      const raw_t<T>* k = q + H * D;
      const raw_t<T>* v = k + KVH * D;
      raw_t<T>* kdst = kc + slot[t] * cache_row;
      for (int64_t h = 0; h < KVH; ++h) rotate<T>(k + h * D, kdst + h * D, c, s, half);
      std::memcpy(vc + slot[t] * cache_row, v, cache_row * sizeof(raw_t<T>));
    }
  });
}

void rotary_and_cache(at::Tensor qkv,                // [T, (H + 2 KVH) * D]: q rotated in place
                      const at::Tensor& positions,   // [T] int64
                      const at::Tensor& cos,         // [P, D] float32 (rotate-half layout, as HF)
                      const at::Tensor& sin,         // [P, D] float32
                      at::Tensor k_cache,            // [NB, BS, KVH, D]
                      at::Tensor v_cache,            // [NB, BS, KVH, D]
                      const at::Tensor& slot_mapping,  // [T] int64
                      int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  const int64_t D = k_cache.size(3), H = num_heads, KVH = num_kv_heads;
  TORCH_CHECK(D % 2 == 0 && D <= 512, "head_dim must be even and <= 512, got ", D);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D, "qkv has ", qkv.size(1), " columns, expected (", H, " + 2 * ", KVH,
              ") * ", D);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == KVH && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous [NB, BS, ", KVH, ", ", D, "]");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "the cache and qkv dtypes differ");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "cos and sin must be contiguous float32 [P, ", D, "]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() && positions.numel() == qkv.size(0) &&
                  slot_mapping.numel() == qkv.size(0),
              "positions and slot_mapping must be contiguous int64 [T]");
  const int64_t slots = k_cache.size(0) * k_cache.size(1), max_pos = cos.size(0);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t* slot = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < qkv.size(0); ++t) {  // out-of-range ids would write outside the cache
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside [0, ", max_pos, ")");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " outside [0, ", slots, ")");
  }
  if (qkv.scalar_type() == at::kFloat) {
    rotary_and_cache_impl<float>(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, H, KVH, D);
  } else {
    rotary_and_cache_impl<c10::BFloat16>(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, H, KVH, D);
  }
}

#if defined(__AVX512F__)
// exp_poly on 16 lanes, the same operations in the same order (so the same bits).
inline __m512 exp_poly16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(EXP_MAX_ARG));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 p = exp_reduced(x, n);
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(126)), 23);
  return _mm512_mul_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(bits)), _mm512_set1_ps(2.0f));
}
#endif

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  using E = Elem<T>;
  const int64_t rows = x.size(0), n = out.size(1), xs = x.stride(0);
  const raw_t<T>* xp = raw<T>(x);
  raw_t<T>* op = raw<T>(out);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const raw_t<T>* __restrict gate = xp + r * xs;
      const raw_t<T>* __restrict up = gate + n;
      raw_t<T>* __restrict o = op + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      // gcc's own vectorization of the loop below runs at a third of this (bf16: 1.5 against
      // 0.5 ms for [512, 2 x 1536]); the same operations, so the same bits.
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= n; i += 16) {
          const __m512 g = from_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate + i)));
          const __m512 u = from_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(up + i)));
          const __m512 act = from_bf16x16(to_bf16x16(_mm512_div_ps(g, _mm512_add_ps(one, exp_poly16(_mm512_sub_ps(_mm512_setzero_ps(), g))))));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), to_bf16x16(_mm512_mul_ps(act, u)));
        }
      }
#endif
#pragma omp simd
      for (int64_t j = i; j < n; ++j) {  // torch: silu(gate) in T, then times up in T
        const float g = E::load(gate[j]);
        const float act = E::round(g / (1.0f + exp_poly(-g)));
        o[j] = E::store(act * E::load(up[j]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {  // [T, 2 I] -> [T, I]
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up needs an even number of columns, got ", gate_up.size(1));
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_and_mul_impl<float>(gate_up, out);
  } else {
    silu_and_mul_impl<c10::BFloat16>(gate_up, out);
  }
  return out;
}

// torch.argmax of a row, in two passes over it (a vocabulary row is L2-resident): its maximum, then
// the first index holding it. torch's own argmax tracks the index at every element, one element
// at a time: ~0.65 ms for 8 rows of SmolLM2's 49152 logits, ~1.3% of a batch-8 decode step.
#if defined(__AVX512F__)
template <typename T>
inline __m512 load16(const raw_t<T>* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(x);
  } else {  // a bf16 is the top half of an fp32
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
}
#endif

template <typename T>
int64_t argmax_row(const raw_t<T>* x, int64_t n) {
  using E = Elem<T>;
  // Pass 1: the maximum, or the first NaN (torch's argmax ranks NaN above everything).
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16<T>(x + i);
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) break;  // the scalar loop finds which
    vm = _mm512_max_ps(vm, v);
  }
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; i < n; ++i) {
    const float v = E::load(x[i]);
    if (std::isnan(v)) return i;
    m = v > m ? v : m;
  }
  // Pass 2: the first index holding it.
  i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load16<T>(x + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i) {
    if (E::load(x[i]) == m) return i;
  }
  return 0;  // unreachable: m is one of the row's values
}

template <typename T>
void argmax_rows_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const raw_t<T>* xp = raw<T>(x);
  int64_t* op = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row<T>(xp + r * xs, n);
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {  // [S, V] -> [S] int64
  check_rows(x, "logits");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows needs at least one column");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) {
    argmax_rows_impl<float>(x, out);
  } else {
    argmax_rows_impl<c10::BFloat16>(x, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def(
      "rotary_and_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_and_cache", &rotary_and_cache);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
}
