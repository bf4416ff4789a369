// Shared by the CPU paged-attention kernels: cpu_paged_attention.cpp (the fp32 kernels for AVX-512,
// AVX2 and scalar, the dispatch and the torch op; its head comment says how the kernels work) and
// cpu_paged_attention_bf16.cpp (the AVX512-BF16 kernels). The problem, its work items, the vector ISAs.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_vec.h"

namespace pdserve_paged {

using namespace pdserve_vec;

constexpr int64_t QT = 16;  // queries of one sequence per work item (prompt chunks)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }

// ---------------------------------------------------------------------------------------------------
// Vector ISAs: W fp32 lanes and what the kernel needs of them.

struct Scalar {
  static constexpr int W = 1;
  static constexpr int QK_ROWS = 4, PV_ROWS = 4, PV_REGS = 8;
  using reg = float;
  static reg zero() { return 0.0f; }
  static reg set1(float x) { return x; }
  static reg load(const float* p) { return *p; }
  static reg load(const c10::BFloat16* p) { return static_cast<float>(*p); }
  static void store(float* p, reg v) { *p = v; }
  static reg fma(reg a, reg b, reg c) { return a * b + c; }
  static reg mul(reg a, reg b) { return a * b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg add(reg a, reg b) { return a + b; }
  static reg max(reg a, reg b) { return std::max(a, b); }
  static float hmax(reg a) { return a; }
  static float hsum(reg a) { return a; }
  static reg exp_nonpositive(reg x) {  // x <= 0; -inf (a masked key) gives exactly 0
    if (x < -87.0f) return 0.0f;
    const float n = std::floor(x * LOG2E + 0.5f);
    return exp_reduced(x, n) * from_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  }
  static void transpose(reg*) {}
};

#if defined(__AVX2__) && defined(__FMA__)
struct Avx2 {
  static constexpr int W = 8;
  static constexpr int QK_ROWS = 8, PV_ROWS = 2, PV_REGS = 4;  // 8 + 4 of the 16 ymm registers
  using reg = __m256;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load(const c10::BFloat16* p) { return from_bf16x8(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static float hmax(reg v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static float hsum(reg v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
  }
  static reg exp_nonpositive(reg x) {
    const __m256 floor_x = _mm256_set1_ps(-87.0f);
    const __m256 keep = _mm256_cmp_ps(x, floor_x, _CMP_GE_OQ);
    x = _mm256_max_ps(x, floor_x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 p = exp_reduced(x, n);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), keep);
  }
  // x where lo <= key <= hi (lane by lane), -inf elsewhere: a key outside a row's range.
  static reg keep_in_range(reg x, reg key, reg lo, reg hi) {
    const __m256 in = _mm256_and_ps(_mm256_cmp_ps(key, hi, _CMP_LE_OQ), _mm256_cmp_ps(key, lo, _CMP_GE_OQ));
    return _mm256_blendv_ps(_mm256_set1_ps(NEG_INF), x, in);
  }
  // x, with -inf lanes replaced by 0 (a row that has no key yet keeps exp's arguments free of NaN).
  static reg finite_or_zero(reg x) { return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(NEG_INF), _CMP_EQ_OQ), x); }
  static void transpose(reg r[8]) {  // 8 x 8, in place
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
  }
};
#endif

#if defined(__AVX512F__)
// 16 x 16 transpose of 32-bit lanes, in place (also used on bf16 pairs).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

struct Avx512 {
  static constexpr int W = 16;
  static constexpr int QK_ROWS = 8, PV_ROWS = 4, PV_REGS = 4;  // 16 + 4 of the 32 zmm registers
  using reg = __m512;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load(const c10::BFloat16* p) { return from_bf16x16(static_cast<const void*>(p)); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static float hmax(reg v) { return _mm512_reduce_max_ps(v); }
  static float hsum(reg v) { return _mm512_reduce_add_ps(v); }
  static reg exp_nonpositive(reg x) {
    const __m512 floor_x = _mm512_set1_ps(-87.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, floor_x, _CMP_GE_OQ);
    x = _mm512_max_ps(x, floor_x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 p = exp_reduced(x, n);
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(bits));
  }
  static reg keep_in_range(reg x, reg key, reg lo, reg hi) {
    const __mmask16 in = _mm512_cmp_ps_mask(key, hi, _CMP_LE_OQ) & _mm512_cmp_ps_mask(key, lo, _CMP_GE_OQ);
    return _mm512_mask_mov_ps(_mm512_set1_ps(NEG_INF), in, x);
  }
  static reg finite_or_zero(reg x) {
    return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, _mm512_set1_ps(NEG_INF), _CMP_EQ_OQ), _mm512_setzero_ps());
  }
  static void transpose(reg r[16]) { transpose16(r); }
};
#endif

// ---------------------------------------------------------------------------------------------------
// The problem and one work item's state.

struct Problem {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks, window;
  int64_t q_token_stride, q_head_stride;
  float scale;
  const int64_t* tables;  // [S, max_blocks]
  const int64_t* seq_lens;
  const int64_t* starts;  // [S + 1]
};

// A work item: queries [first_query, first_query + num_queries) of a sequence, for KV heads
// [kv_head, kv_head + kv_heads). Decodes take all KV heads of their sequence at once (when there are
// enough sequences for the threads): a token's K (and V) rows of all heads are contiguous, which
// streams from memory far better than a slice of each; prompt chunks take one KV head (their K/V
// tiles are reused from cache by many queries).
struct Item {
  int64_t seq, kv_head, kv_heads, first_query, num_queries;
};

// Keys [lo, hi] that query position `pos` attends.
inline int64_t key_lo(const Problem& p, int64_t pos) { return p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0; }

// Cache offsets (elements) of `n` consecutive tokens from `first`, for one KV head.
inline void token_offsets(const Problem& p, const int64_t* table, int64_t first, int64_t n, int64_t kv_head,
                          int64_t* out) {
  int64_t block = first / p.block_size, slot = first % p.block_size;
  const int64_t token_stride = p.num_kv_heads * p.head_dim;
  for (int64_t t = 0; t < n; ++t) {
    out[t] = (table[block] * p.block_size + slot) * token_stride + kv_head * p.head_dim;
    if (++slot == p.block_size) slot = 0, ++block;
  }
}

// Prefetch the K and V rows of tokens [first, first + count) (count <= 16) for the item's heads: blocks
// are scattered, so the hardware prefetcher loses the stream at every block boundary. Called two
// tiles ahead: one tile's work is shorter than a trip to DRAM.
template <typename cache_t>
inline void prefetch_tokens(const Problem& p, const int64_t* table, int64_t first, int64_t count, int64_t kv_head,
                            int64_t kv_heads, const cache_t* k_cache, const cache_t* v_cache) {
  if (count <= 0) return;
  int64_t offsets[16];
  count = std::min<int64_t>(count, 16);
  token_offsets(p, table, first, count, kv_head, offsets);
  const int64_t bytes = kv_heads * p.head_dim * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t t = 0; t < count; ++t) {
    const char* kp = reinterpret_cast<const char*>(k_cache + offsets[t]);
    const char* vp = reinterpret_cast<const char*>(v_cache + offsets[t]);
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(kp + b);
      __builtin_prefetch(vp + b);
    }
  }
}

// out rows of an item: acc / l, in the model dtype. Rows: (KV head h of the span, query i, head j).
template <typename q_t>
inline void write_out(const Problem& p, const Item& item, const float* acc, const float* l, q_t* out) {
  const int64_t D = p.head_dim, G = p.group, per_head = item.num_queries * G;
  for (int64_t h = 0; h < item.kv_heads; ++h) {
    for (int64_t i = 0; i < item.num_queries; ++i) {
      q_t* otok = out + (p.starts[item.seq] + item.first_query + i) * p.num_heads * D;
      for (int64_t j = 0; j < G; ++j) {
        const int64_t r = h * per_head + i * G + j;
        q_t* orow = otok + ((item.kv_head + h) * G + j) * D;
        const float inv = 1.0f / l[r];  // every query attends at least itself
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<q_t>(acc[r * D + d] * inv);
      }
    }
  }
}

// The step's work items (item_order says the order the threads take them in).
inline std::vector<Item> work_items(const Problem& p, int64_t num_seqs) {
  std::vector<Item> items;
  int64_t decodes = 0;
  for (int64_t s = 0; s < num_seqs; ++s) decodes += p.starts[s + 1] - p.starts[s] == 1;
  // Whole decodes when they keep every thread busy (one thread: always; its K/V rows then stream).
  const int threads = at::get_num_threads();
  const bool whole_decodes = threads == 1 || decodes >= 2 * threads;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = p.starts[s + 1] - p.starts[s];
    if (q_len == 1 && whole_decodes) {
      items.push_back({s, 0, p.num_kv_heads, 0, 1});
      continue;
    }
    for (int64_t i0 = 0; i0 < q_len; i0 += QT) {
      for (int64_t g = 0; g < p.num_kv_heads; ++g) items.push_back({s, g, 1, i0, std::min<int64_t>(QT, q_len - i0)});
    }
  }
  return items;
}

// The order the threads take the items in (pdserve_parallel::for_each_taken): the costliest first,
// by the keys each reads per KV head and its query rows; a prompt tile's 16 queries share each key
// tile read, so its rows weigh an eighth of a decode's (measured: a 16-query, one-KV-head item of a
// short chunk ~7 us, a 3-KV-head decode of 256 tokens ~45 us).
inline std::vector<int64_t> item_order(const Problem& p, const std::vector<Item>& items) {
  std::vector<double> cost(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    const int64_t q_len = p.starts[item.seq + 1] - p.starts[item.seq];
    const int64_t last = p.seq_lens[item.seq] - q_len + item.first_query + item.num_queries - 1;  // position
    const int64_t keys = last + 1 - key_lo(p, last);
    cost[i] = static_cast<double>(item.kv_heads * keys) * (1.0 + (item.num_queries - 1) / 8.0);
  }
  return pdserve_parallel::costliest_first(cost);
}

// Rows of scratch an item can need: a tile of queries of one KV head, or one query of them all.
inline int64_t max_rows(const Problem& p) { return std::max(QT * p.group, p.num_heads); }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// q and both caches in bf16, head_dim % 32 == 0 (cpu_paged_attention_bf16.cpp).
void run_bf16(const Problem& p, int64_t num_seqs, const at::Tensor& q, const at::Tensor& k_cache,
              const at::Tensor& v_cache, at::Tensor& out);
#endif

}  // namespace pdserve_paged
