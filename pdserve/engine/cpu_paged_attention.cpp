// Paged attention on CPU for a whole step: decode tokens and prompt chunks alike, K and V read in
// place from their cache blocks (never gathered into a new tensor; the bf16 kernel copies a whole
// decode's keys 256 tokens at a time into a per-thread buffer, see StagedKv), GQA handled by attending the G = H / KVH
// query heads of one KV head together so each K/V row is read once for all of them.
//
// A step's batch is a list of sequences; sequence s has q_len = qsl[s + 1] - qsl[s] new tokens
// (rows qsl[s].. of q; 1 for a decode) and seq_lens[s] tokens in the cache, its new ones included,
// so its query i sits at position seq_lens[s] - q_len + i and attends keys
// (pos - window, pos] (all of [0, pos] without a window): causal over the chunk and its context.
//
// Work items are (sequence, KV head, tile of up to QT queries); each walks its keys in tiles of W
// tokens (the vector width) with an online softmax (running max m, sum l, fp32 accumulator per row):
//   1. the W keys' K rows transposed to [D][W] (tokens in vector lanes), so a row of scores is D
//      vector FMAs, shared by the G * QT query rows of the item;
//   2. scores scaled, masked where a key is outside a query's range, softmax-updated per row;
//   3. the W V rows (as they are: [W][D]) accumulated, weighted, into each row's output.
// Vector code for AVX-512 (W = 16) and AVX2 (W = 8), chosen at compile time (-march=native, see
// cpu_kernels.py); a scalar version elsewhere. With AVX512-BF16 and a bf16 cache, the two products
// use VDPBF16PS on pairs of bf16 (K pairs transposed along D, V pairs interleaved along tokens, the
// probabilities rounded to bf16 as torch's own CPU flash attention does). exp is a branch-free
// polynomial (~1 ulp).
// Prompt items whose rows (QT queries x G heads) fill whole vectors take a third kernel with the
// rows in vector lanes instead (attend_lanes_bf16: the softmax is vertical, Q is packed once per item,
// K is broadcast from its cache rows; 1.3x the row-at-a-time kernel on a 2048-token prefill).
//
// Registered as torch.ops.pdserve.paged_attention.

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
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

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
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
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
  static reg load(const c10::BFloat16* p) {  // a bf16 is the top half of an fp32
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
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
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), keep);
  }
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
  static reg load(const c10::BFloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
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
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(bits));
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

// Per thread scratch for one ISA; rows = G * QT.
template <class V>
struct Scratch {
  std::vector<float> q, scores, acc, m, l, kt, vrows, zero;
  std::vector<int64_t> offsets;
  Scratch(int64_t rows, int64_t D)
      : q(rows * D), scores(rows * V::W), acc(rows * D), m(rows), l(rows), kt(D * V::W), vrows(V::W * D),
        zero(D, 0.0f), offsets(V::W) {}
};

// The online-softmax step of one row over a tile: scores sr[0..W) (already scaled and masked).
// Returns false if every key of the tile is masked for this row (nothing to add).
template <class V>
inline bool softmax_row(float* sr, float& m, float& l, float* acc, int64_t D) {
  const float tile_max = V::hmax(V::load(sr));
  if (tile_max == NEG_INF) return false;
  const float m_new = std::max(m, tile_max);
  if (m_new > m) {
    if (m != NEG_INF) {  // acc and l are 0 before the first tile: nothing to rescale
      const float a = Scalar::exp_nonpositive(m - m_new);
      const typename V::reg av = V::set1(a);
      for (int64_t d = 0; d < D; d += V::W) V::store(acc + d, V::mul(V::load(acc + d), av));
      l *= a;
    }
    m = m_new;
  }
  const typename V::reg p = V::exp_nonpositive(V::sub(V::load(sr), V::set1(m_new)));
  V::store(sr, p);
  l += V::hsum(p);
  return true;
}

// ---------------------------------------------------------------------------------------------------
// The fp32 kernel (any ISA; bf16 caches widened as they are read).

// Chains of FMAs per row so that a few rows (a decode's G) still keep the FMA units busy: each
// product's latency is several cycles, and one chain per row would wait on itself.
template <int ROWS>
constexpr int chains() {
  return ROWS >= 8 ? 1 : (8 + ROWS - 1) / ROWS;
}

template <class V, int ROWS>
inline void qk_rows(const float* q, const float* kt, float* scores, int64_t D) {
  // scores[r][0..W) = q[r] . K^T for ROWS rows; kt is [D][W].
  constexpr int U = chains<ROWS>();
  typename V::reg s[ROWS][U];
  for (int r = 0; r < ROWS; ++r)
    for (int u = 0; u < U; ++u) s[r][u] = V::zero();
  int64_t d = 0;
  for (; d + U <= D; d += U) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const typename V::reg k = V::load(kt + (d + u) * V::W);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) s[r][u] = V::fma(V::set1(q[r * D + d + u]), k, s[r][u]);
    }
  }
  for (; d < D; ++d) {
    const typename V::reg k = V::load(kt + d * V::W);
    for (int r = 0; r < ROWS; ++r) s[r][0] = V::fma(V::set1(q[r * D + d]), k, s[r][0]);
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int u = 1; u < U; ++u) s[r][0] = V::add(s[r][0], s[r][u]);
    V::store(scores + r * V::W, s[r][0]);
  }
}

template <class V, int ROWS>
inline void pv_rows(float* acc, const float* p, const float* vrows, int64_t n, int64_t D, const bool* live) {
  // acc[r] += sum_t p[r][t] * v[t] for ROWS rows, PV_REGS registers of columns at a time.
  constexpr int C = V::PV_REGS;
  for (int64_t c0 = 0; c0 < D; c0 += C * V::W) {
    const int regs = static_cast<int>(std::min<int64_t>(C, (D - c0) / V::W));
    typename V::reg a[ROWS][C];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < C; ++j) a[r][j] = j < regs ? V::load(acc + r * D + c0 + j * V::W) : V::zero();
    for (int64_t t = 0; t < n; ++t) {
      typename V::reg v[C];
      for (int j = 0; j < C; ++j) v[j] = j < regs ? V::load(vrows + t * D + c0 + j * V::W) : V::zero();
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const typename V::reg pr = V::set1(p[r * V::W + t]);
        for (int j = 0; j < C; ++j) a[r][j] = V::fma(pr, v[j], a[r][j]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      if (!live[r]) continue;  // a row with no key in this tile keeps its acc untouched
      for (int j = 0; j < regs; ++j) V::store(acc + r * D + c0 + j * V::W, a[r][j]);
    }
  }
}

// Rows in blocks of ROWS, then the remainder in one call of its own size (each call reads the
// tile once more).
template <class V, int N>
void qk_rest(const float* q, const float* kt, float* scores, int64_t rest, int64_t D) {
  if constexpr (N > 0) {
    if (rest == N) return qk_rows<V, N>(q, kt, scores, D);
    qk_rest<V, N - 1>(q, kt, scores, rest, D);
  }
}

template <class V, int ROWS>
void qk_block(const float* q, const float* kt, float* scores, int64_t rows, int64_t D) {
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) qk_rows<V, ROWS>(q + r * D, kt, scores + r * V::W, D);
  qk_rest<V, ROWS - 1>(q + r * D, kt, scores + r * V::W, rows - r, D);
}

template <class V, int N>
void pv_rest(float* acc, const float* p, const float* vrows, int64_t n, int64_t rest, int64_t D, const bool* live) {
  if constexpr (N > 0) {
    if (rest == N) return pv_rows<V, N>(acc, p, vrows, n, D, live);
    pv_rest<V, N - 1>(acc, p, vrows, n, rest, D, live);
  }
}

template <class V, int ROWS>
void pv_block(float* acc, const float* p, const float* vrows, int64_t n, int64_t rows, int64_t D, const bool* live) {
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) pv_rows<V, ROWS>(acc + r * D, p + r * V::W, vrows, n, D, live + r);
  pv_rest<V, ROWS - 1>(acc + r * D, p + r * V::W, vrows, n, rows - r, D, live + r);
}

// Scale a tile's scores, mask the keys outside each row's range, and run the online softmax.
// Rows are (query i, head j of the group) of one KV head; `live[r]`: the row has a key in the tile.
template <class V>
inline void softmax_tile(const Problem& p, float* scores, float* m, float* l, float* acc, bool* live,
                         int64_t rows, int64_t first_pos, int64_t k0, int64_t n) {
  constexpr int W = V::W;
  const int64_t D = p.head_dim, G = p.group;
  const bool full = n == W;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = first_pos + r / G, lo = key_lo(p, pos);
    float* sr = scores + r * W;
    V::store(sr, V::mul(V::load(sr), V::set1(p.scale)));
    if (!(full && k0 >= lo && k0 + W - 1 <= pos)) {
      for (int t = 0; t < W; ++t) {
        const int64_t key = k0 + t;
        if (t >= n || key > pos || key < lo) sr[t] = NEG_INF;
      }
    }
    live[r] = softmax_row<V>(sr, m[r], l[r], acc + r * D, D);
    if (!live[r]) std::fill(sr, sr + W, 0.0f);
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

template <class V, typename cache_t, typename q_t>
void attend_fp32(const Problem& p, const Item& item, const q_t* q, const cache_t* k_cache, const cache_t* v_cache,
                 q_t* out, Scratch<V>& sc) {
  constexpr int W = V::W;
  const int64_t D = p.head_dim, G = p.group;
  const int64_t per_head = item.num_queries * G, rows = item.kv_heads * per_head;
  const int64_t q_len = p.starts[item.seq + 1] - p.starts[item.seq];
  const int64_t first_pos = p.seq_lens[item.seq] - q_len + item.first_query;  // of the item's first query
  const int64_t last_pos = first_pos + item.num_queries - 1;
  const int64_t* table = p.tables + item.seq * p.max_blocks;
  for (int64_t h = 0; h < item.kv_heads; ++h) {  // the rows as fp32
    for (int64_t i = 0; i < item.num_queries; ++i) {
      const q_t* qtok = q + (p.starts[item.seq] + item.first_query + i) * p.q_token_stride;
      for (int64_t j = 0; j < G; ++j) {
        const q_t* qrow = qtok + ((item.kv_head + h) * G + j) * p.q_head_stride;
        float* dst = sc.q.data() + (h * per_head + i * G + j) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = to_f(qrow[d]);
      }
    }
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * D, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + rows, NEG_INF);
  std::fill(sc.l.begin(), sc.l.begin() + rows, 0.0f);
  bool live[QT * 64];  // rows <= max(QT * G, H) <= QT * 64: checked by the caller

  typename V::reg regs[W];
  const int64_t start = key_lo(p, first_pos);
  for (int64_t k0 = start; k0 <= last_pos; k0 += W) {
    const int64_t n = std::min<int64_t>(W, last_pos + 1 - k0);
    token_offsets(p, table, k0, n, item.kv_head, sc.offsets.data());
    if (k0 == start) prefetch_tokens(p, table, k0 + W, last_pos + 1 - (k0 + W), item.kv_head, item.kv_heads, k_cache, v_cache);
    prefetch_tokens(p, table, k0 + 2 * W, last_pos + 1 - (k0 + 2 * W), item.kv_head, item.kv_heads, k_cache, v_cache);
    for (int64_t h = 0; h < item.kv_heads; ++h) {
      const int64_t head = h * D, r0 = h * per_head;
      // K^T of the tile: [D][W], W columns at a time through registers; missing tokens read zeros.
      for (int64_t c = 0; c < D; c += W) {
        for (int t = 0; t < W; ++t) regs[t] = t < n ? V::load(k_cache + sc.offsets[t] + head + c) : V::zero();
        V::transpose(regs);
        for (int t = 0; t < W; ++t) V::store(sc.kt.data() + (c + t) * W, regs[t]);
      }
      for (int64_t t = 0; t < n; ++t) {  // V rows as fp32 [W][D]
        const cache_t* vrow = v_cache + sc.offsets[t] + head;
        for (int64_t d = 0; d < D; d += W) V::store(sc.vrows.data() + t * D + d, V::load(vrow + d));
      }
      float* scores = sc.scores.data() + r0 * W;
      float* acc = sc.acc.data() + r0 * D;
      qk_block<V, V::QK_ROWS>(sc.q.data() + r0 * D, sc.kt.data(), scores, per_head, D);
      softmax_tile<V>(p, scores, sc.m.data() + r0, sc.l.data() + r0, acc, live + r0, per_head, first_pos, k0, n);
      pv_block<V, V::PV_ROWS>(acc, scores, sc.vrows.data(), n, per_head, D, live + r0);
    }
  }
  write_out(p, item, sc.acc.data(), sc.l.data(), out);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// ---------------------------------------------------------------------------------------------------
// The bf16 kernel (AVX512-BF16): products on pairs of bf16 with fp32 accumulation, twice the work of
// an fp32 FMA per instruction. Tiles of 32 keys (two groups of 16 lanes): the softmax bookkeeping
// of a row (its max, sum and rescale) is paid once per 32 keys. D % 32 == 0.

constexpr int64_t KT = 32;

struct Bf16Scratch {
  std::vector<uint32_t> kp, vp, pb;
  std::vector<float> scores, acc, m, l;
  Bf16Scratch(int64_t rows, int64_t D)
      : kp(2 * D / 2 * 16), vp(KT / 2 * D), pb(rows * KT / 2), scores(rows * KT), acc(rows * D), m(rows), l(rows) {}
};

// A whole decode's keys are staged in chunks of STAGE_TOKENS: one memcpy per run of a block's slots
// copies the chunk's K and V rows (all KV heads) into a per-thread buffer, and the tiles read from
// there. The tiles' own loads from the scattered blocks ran at a quarter of the core's memory
// bandwidth (~5.5 of ~20 GB/s measured on an AVX512-BF16 EPYC; software prefetch at any distance or
// hint did not help), while a memcpy streams (docs/performance.md, "Staging a decode's keys"). A
// chunk (2 x 256 x KVH x D bf16: 192 KiB for SmolLM2) stays in L2.
// Prompt chunks are not staged: many queries share each tile, so their loads are already amortised.
constexpr int64_t STAGE_TOKENS = 256;
static_assert(STAGE_TOKENS % KT == 0, "a tile must not straddle two staged chunks");

struct StagedKv {
  std::vector<c10::BFloat16> k, v;
};

// The per-thread buffer: at::parallel_for runs on a persistent pool, so this is allocated once per
// thread rather than once per layer call (a fresh 200 KB allocation is an mmap and page faults).
inline StagedKv& staged_kv() {
  thread_local StagedKv staged;
  return staged;
}

// Copies the K and V rows (row = KVH * D elements: all heads of a token) of tokens [first, first + n)
// from their blocks into `staged`, token t - first at row t - first.
inline void stage_tokens(const Problem& p, const int64_t* table, int64_t first, int64_t n, const c10::BFloat16* k_cache,
                         const c10::BFloat16* v_cache, StagedKv& staged) {
  const int64_t row = p.num_kv_heads * p.head_dim;
  if (static_cast<int64_t>(staged.k.size()) < n * row) {
    staged.k.resize(n * row);
    staged.v.resize(n * row);
  }
  for (int64_t t = first; t < first + n;) {
    const int64_t slot = t % p.block_size, run = std::min(p.block_size - slot, first + n - t);
    const int64_t src = (table[t / p.block_size] * p.block_size + slot) * row;
    const size_t bytes = static_cast<size_t>(run * row) * sizeof(c10::BFloat16);
    std::memcpy(staged.k.data() + (t - first) * row, k_cache + src, bytes);
    std::memcpy(staged.v.data() + (t - first) * row, v_cache + src, bytes);
    t += run;
  }
}

inline __m512bh as_bh(__m512i v) {
  __m512bh b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

inline __m512i bh_bits(__m512bh b) {
  __m512i v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

// scores[r][0..16 * GROUPS) = q[r] . K^T for ROWS rows: kp holds the tile's K as pairs along D,
// transposed, one [pairs][16] block per group of 16 keys.
template <int ROWS, int GROUPS>
inline void qk_pairs(const uint32_t* const* q, const uint32_t* kp, float* scores, int64_t pairs) {
  constexpr int U = std::max(1, 8 / (ROWS * GROUPS));  // independent chains (see chains())
  __m512 s[ROWS][GROUPS][U];
  for (int r = 0; r < ROWS; ++r)
    for (int g = 0; g < GROUPS; ++g)
      for (int u = 0; u < U; ++u) s[r][g][u] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + U <= pairs; c += U) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      __m512bh k[GROUPS];
      for (int g = 0; g < GROUPS; ++g) k[g] = as_bh(_mm512_loadu_si512(kp + (g * pairs + c + u) * 16));
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh qr = as_bh(_mm512_set1_epi32(static_cast<int>(q[r][c + u])));
        for (int g = 0; g < GROUPS; ++g) s[r][g][u] = _mm512_dpbf16_ps(s[r][g][u], qr, k[g]);
      }
    }
  }
  for (; c < pairs; ++c) {
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh qr = as_bh(_mm512_set1_epi32(static_cast<int>(q[r][c])));
      for (int g = 0; g < GROUPS; ++g) {
        s[r][g][0] = _mm512_dpbf16_ps(s[r][g][0], qr, as_bh(_mm512_loadu_si512(kp + (g * pairs + c) * 16)));
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int g = 0; g < GROUPS; ++g) {
      for (int u = 1; u < U; ++u) s[r][g][0] = _mm512_add_ps(s[r][g][0], s[r][g][u]);
      _mm512_storeu_ps(scores + r * KT + g * 16, s[r][g][0]);
    }
  }
}

template <int GROUPS, int N>
void qk_pairs_rest(const uint32_t* const* q, const uint32_t* kp, float* scores, int64_t rest, int64_t pairs) {
  if constexpr (N > 0) {
    if (rest == N) return qk_pairs<N, GROUPS>(q, kp, scores, pairs);
    qk_pairs_rest<GROUPS, N - 1>(q, kp, scores, rest, pairs);
  }
}

template <int GROUPS>
void qk_pairs_block(const uint32_t* const* q, const uint32_t* kp, float* scores, int64_t rows, int64_t pairs) {
  constexpr int ROWS = 8;
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) qk_pairs<ROWS, GROUPS>(q + r, kp, scores + r * KT, pairs);
  qk_pairs_rest<GROUPS, ROWS - 1>(q + r, kp, scores + r * KT, rows - r, pairs);
}

// acc[r] += sum_j pb(r, j) . vp[j] over `token_pairs` pairs of keys, for ROWS rows, where pb(r, j) =
// pb[r * row_stride + j * pair_stride]: the probabilities of row r for keys 2j and 2j + 1 as a pair of
// bf16 (rows in turn for the row-at-a-time softmax, rows in vector lanes for prompt tiles).
template <int ROWS>
inline void pv_pairs(float* acc, const uint32_t* pb, int64_t row_stride, int64_t pair_stride, const uint32_t* vp,
                     int64_t token_pairs, int64_t D) {
  constexpr int C = 4;  // 4 x 16 columns: ROWS * 4 + 4 of the 32 zmm registers
  for (int64_t c0 = 0; c0 < D; c0 += C * 16) {
    const int regs = static_cast<int>(std::min<int64_t>(C, (D - c0) / 16));
    __m512 a[ROWS][C];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < C; ++j) a[r][j] = j < regs ? _mm512_loadu_ps(acc + r * D + c0 + j * 16) : _mm512_setzero_ps();
    for (int64_t t = 0; t < token_pairs; ++t) {
      __m512bh v[C];
      for (int j = 0; j < C; ++j) v[j] = as_bh(j < regs ? _mm512_loadu_si512(vp + t * D + c0 + j * 16) : _mm512_setzero_si512());
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh pr = as_bh(_mm512_set1_epi32(static_cast<int>(pb[r * row_stride + t * pair_stride])));
        for (int j = 0; j < C; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], pr, v[j]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < regs; ++j) _mm512_storeu_ps(acc + r * D + c0 + j * 16, a[r][j]);
  }
}

template <int N>
void pv_pairs_rest(float* acc, const uint32_t* pb, int64_t row_stride, int64_t pair_stride, const uint32_t* vp,
                   int64_t token_pairs, int64_t rest, int64_t D) {
  if constexpr (N > 0) {
    if (rest == N) return pv_pairs<N>(acc, pb, row_stride, pair_stride, vp, token_pairs, D);
    pv_pairs_rest<N - 1>(acc, pb, row_stride, pair_stride, vp, token_pairs, rest, D);
  }
}

void pv_pairs_block(float* acc, const uint32_t* pb, int64_t row_stride, int64_t pair_stride, const uint32_t* vp,
                    int64_t token_pairs, int64_t rows, int64_t D) {
  constexpr int ROWS = 4;
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) {
    pv_pairs<ROWS>(acc + r * D, pb + r * row_stride, row_stride, pair_stride, vp, token_pairs, D);
  }
  pv_pairs_rest<ROWS - 1>(acc + r * D, pb + r * row_stride, row_stride, pair_stride, vp, token_pairs, rows - r, D);
}

// V rows of a tile's n keys (offsets[t] + head: key t's row) as pairs along keys:
// vp[j][d] = (v[2j][d], v[2j + 1][d]), the second 0 past the last key. D % 32 == 0.
inline void pack_v_pairs(const c10::BFloat16* v_base, const int64_t* offsets, int64_t head, int64_t n, int64_t D,
                         uint32_t* vp) {
  // (v[t][d], v[t + 1][d]) for d < 16 and for 16 <= d < 32 of a 32-column chunk.
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t j = 0; j < (n + 1) / 2; ++j) {
    const c10::BFloat16* a = v_base + offsets[2 * j] + head;
    const bool second = 2 * j + 1 < n;
    const c10::BFloat16* b = second ? v_base + offsets[2 * j + 1] + head : nullptr;
    for (int64_t c = 0; c < D; c += 32) {
      const __m512i va = _mm512_loadu_si512(a + c);
      const __m512i vb = second ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + j * D + c, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(vp + j * D + c + 16, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// One row's online softmax over a tile of up to 32 raw scores (unscaled; scale > 0, so the max of
// the raw scores is the max of the scaled ones): probabilities exp(scale * (s - m)) written back as
// bf16 pairs into pb. Returns false when every key of the tile is masked for the row.
inline bool softmax_row32(const float* sr, int groups, float scale, float& m, float& l, float* acc, int64_t D,
                          uint32_t* pb) {
  const __m512 s0 = _mm512_loadu_ps(sr);
  const __m512 s1 = groups > 1 ? _mm512_loadu_ps(sr + 16) : _mm512_set1_ps(NEG_INF);
  const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
  if (tile_max == NEG_INF) return false;
  const float m_new = std::max(m, tile_max);
  if (m_new > m) {
    if (m != NEG_INF) {  // acc and l are 0 before the first tile: nothing to rescale
      const float a = Scalar::exp_nonpositive(scale * (m - m_new));
      const __m512 av = _mm512_set1_ps(a);
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), av));
      l *= a;
    }
    m = m_new;
  }
  const __m512 sv = _mm512_set1_ps(scale), shift = _mm512_set1_ps(-scale * m_new);
  const __m512 p0 = Avx512::exp_nonpositive(_mm512_fmadd_ps(s0, sv, shift));
  const __m512 p1 = groups > 1 ? Avx512::exp_nonpositive(_mm512_fmadd_ps(s1, sv, shift)) : _mm512_setzero_ps();
  l += _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
  // As bf16 pairs (p[2j], p[2j + 1]) for the V product; torch's CPU flash attention rounds the
  // probabilities to the input dtype too.
  const __m512bh pairs = _mm512_cvtne2ps_pbh(p1, p0);
  std::memcpy(pb, &pairs, sizeof(pairs));
  return true;
}

void attend_bf16(const Problem& p, const Item& item, const c10::BFloat16* q, const c10::BFloat16* k_cache,
                 const c10::BFloat16* v_cache, c10::BFloat16* out, Bf16Scratch& sc) {
  const int64_t D = p.head_dim, G = p.group, pairs = D / 2;
  const int64_t per_head = item.num_queries * G, rows = item.kv_heads * per_head;
  const int64_t q_len = p.starts[item.seq + 1] - p.starts[item.seq];
  const int64_t first_pos = p.seq_lens[item.seq] - q_len + item.first_query;
  const int64_t last_pos = first_pos + item.num_queries - 1;
  const int64_t* table = p.tables + item.seq * p.max_blocks;
  // Rows as pairs of bf16, read in place from q: (KV head h of the span, query i, head j).
  const uint32_t* qrows[QT * 64];  // rows <= QT * 64: checked by the caller
  for (int64_t h = 0; h < item.kv_heads; ++h) {
    for (int64_t i = 0; i < item.num_queries; ++i) {
      const c10::BFloat16* qtok = q + (p.starts[item.seq] + item.first_query + i) * p.q_token_stride;
      for (int64_t j = 0; j < G; ++j) {
        qrows[h * per_head + i * G + j] =
            reinterpret_cast<const uint32_t*>(qtok + ((item.kv_head + h) * G + j) * p.q_head_stride);
      }
    }
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * D, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + rows, NEG_INF);
  std::fill(sc.l.begin(), sc.l.begin() + rows, 0.0f);
  int64_t offsets[KT];
  __m512 regs[16];

  // A whole decode (all KV heads: rows of a token contiguous) reads its keys from the staged copy.
  const bool staging = item.kv_heads == p.num_kv_heads && item.num_queries == 1;
  StagedKv* staged = staging ? &staged_kv() : nullptr;
  const int64_t row = p.num_kv_heads * D;
  const c10::BFloat16* k_base = k_cache;
  const c10::BFloat16* v_base = v_cache;
  int64_t stage_first = 0, stage_end = 0;  // tokens [stage_first, stage_end) are staged

  const int64_t start = key_lo(p, first_pos);
  for (int64_t k0 = start; k0 <= last_pos; k0 += KT) {
    const int64_t n = std::min<int64_t>(KT, last_pos + 1 - k0);
    const int groups = n > 16 ? 2 : 1;
    if (staging) {
      if (k0 >= stage_end) {  // KT divides STAGE_TOKENS: a tile never straddles two chunks
        stage_first = k0;
        stage_end = std::min(k0 + STAGE_TOKENS, last_pos + 1);
        stage_tokens(p, table, stage_first, stage_end - stage_first, k_cache, v_cache, *staged);
        k_base = staged->k.data();
        v_base = staged->v.data();
      }
      for (int64_t u = 0; u < n; ++u) offsets[u] = (k0 - stage_first + u) * row;
    } else {
      token_offsets(p, table, k0, n, item.kv_head, offsets);
      for (int64_t ahead = k0 + KT; ahead < k0 + 2 * KT; ahead += 16) {  // the next tile, from memory
        prefetch_tokens(p, table, ahead, last_pos + 1 - ahead, item.kv_head, item.kv_heads, k_cache, v_cache);
      }
    }
    const int64_t token_pairs = (n + 1) / 2;
    for (int64_t h = 0; h < item.kv_heads; ++h) {
      const int64_t head = h * D, r0 = h * per_head;
      // K as pairs along D, transposed per group of 16 keys: kp[g][c][t] = (k[16g + t][2c], ...[2c + 1]).
      for (int g = 0; g < groups; ++g) {
        for (int64_t c = 0; c < pairs; c += 16) {
          for (int t = 0; t < 16; ++t) {
            const int64_t key = 16 * g + t;
            regs[t] = key < n ? _mm512_loadu_ps(k_base + offsets[key] + head + 2 * c) : _mm512_setzero_ps();
          }
          transpose16(regs);
          for (int t = 0; t < 16; ++t) {
            _mm512_storeu_ps(reinterpret_cast<float*>(sc.kp.data() + (g * pairs + c + t) * 16), regs[t]);
          }
        }
      }
      pack_v_pairs(v_base, offsets, head, n, D, sc.vp.data());
      float* scores = sc.scores.data() + r0 * KT;
      float* acc = sc.acc.data() + r0 * D;
      if (groups == 2) {
        qk_pairs_block<2>(qrows + r0, sc.kp.data(), scores, per_head, pairs);
      } else {
        qk_pairs_block<1>(qrows + r0, sc.kp.data(), scores, per_head, pairs);
      }
      const bool full = n == KT;
      for (int64_t r = 0; r < per_head; ++r) {
        const int64_t pos = first_pos + r / G, lo_key = key_lo(p, pos);
        float* sr = scores + r * KT;
        if (!(full && k0 >= lo_key && k0 + KT - 1 <= pos)) {
          for (int t = 0; t < KT; ++t) {
            const int64_t key = k0 + t;
            if (t >= n || key > pos || key < lo_key) sr[t] = NEG_INF;
          }
        }
        uint32_t* pb = sc.pb.data() + (r0 + r) * (KT / 2);
        if (!softmax_row32(sr, groups, p.scale, sc.m[r0 + r], sc.l[r0 + r], acc + r * D, D, pb)) {
          std::fill(pb, pb + KT / 2, 0u);  // no key of this tile: adds nothing
        }
      }
      pv_pairs_block(acc, sc.pb.data() + r0 * (KT / 2), KT / 2, 1, sc.vp.data(), token_pairs, per_head, D);
    }
  }
  write_out(p, item, sc.acc.data(), sc.l.data(), out);
}

// ---------------------------------------------------------------------------------------------------
// Prompt tiles with the rows in vector lanes (AVX512-BF16). A prompt item has QT queries x G heads =
// 16 * QT * G / 16 rows, a multiple of 16 for any G, so its rows fill whole vectors: scores are
// computed transposed (st[key][row]), which makes every softmax step vertical (a row's max over the
// tile's keys is 31 vector maxes for 16 rows, not a horizontal reduction per row) and lets Q be
// packed once per item (qp[pair][row]) while each key's K pairs are broadcast straight from its
// cache row: no per-tile transpose of K. The PV product is the row-at-a-time one above, reading the
// probabilities as pairs from pb[key pair][row].

constexpr int LANE_KEYS = 8;  // keys of one QK register block: 8 x (up to) 3 row vectors of accumulators

// 2^y on 16 lanes for y <= 0; -inf (a masked key), and anything below -126, gives exactly 0. A
// degree-5 polynomial for 2^f on [-0.5, 0.5] (relative error 2.2e-7; fitted on Chebyshev nodes)
// times 2^n by scalef: 9 operations against exp_nonpositive's 17, for probabilities that are
// rounded to bf16 (8 bits) next.
inline __m512 exp2_nonpositive(__m512 y) {
  const __mmask16 keep = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.3266970636e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6754599362e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507425219e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022121727e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314694405e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192e+0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// st[t][r] = q[r] . k[t] for keys t < LANE_KEYS, rows r < 16 * RV: qp[c][r] holds row r's pair c of
// D, krows[t] key t's row as pairs; `rp` is the row stride of qp and st.
template <int RV>
inline void qk_lanes(const uint32_t* qp, const uint32_t* const* krows, float* st, int64_t rp, int64_t pairs) {
  __m512 s[LANE_KEYS][RV];
  for (int t = 0; t < LANE_KEYS; ++t)
    for (int v = 0; v < RV; ++v) s[t][v] = _mm512_setzero_ps();
  for (int64_t c = 0; c < pairs; ++c) {
    __m512bh q[RV];
    for (int v = 0; v < RV; ++v) q[v] = as_bh(_mm512_loadu_si512(qp + c * rp + v * 16));
#pragma GCC unroll 8
    for (int t = 0; t < LANE_KEYS; ++t) {
      const __m512bh k = as_bh(_mm512_set1_epi32(static_cast<int>(krows[t][c])));
      for (int v = 0; v < RV; ++v) s[t][v] = _mm512_dpbf16_ps(s[t][v], q[v], k);
    }
  }
  for (int t = 0; t < LANE_KEYS; ++t)
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(st + t * rp + v * 16, s[t][v]);
}

struct LaneScratch {
  std::vector<uint32_t> qp, vp, pb;
  std::vector<float> st, acc, m, l;
  std::vector<int32_t> pos, lo;
  LaneScratch(int64_t rows, int64_t D)
      : qp(D / 2 * rows), vp(KT / 2 * D), pb(KT / 2 * rows), st(KT * rows), acc(rows * D), m(rows), l(rows),
        pos(rows), lo(rows) {}
};

// Rows of an item in lanes: num_queries * G rounded up to whole vectors.
inline int64_t lane_rows(const Problem& p, const Item& item) { return (item.num_queries * p.group + 15) / 16 * 16; }

void attend_lanes_bf16(const Problem& p, const Item& item, const c10::BFloat16* q, const c10::BFloat16* k_cache,
                       const c10::BFloat16* v_cache, c10::BFloat16* out, LaneScratch& sc) {
  const int64_t D = p.head_dim, G = p.group, pairs = D / 2;
  const int64_t rows = item.num_queries * G, rp = lane_rows(p, item), vectors = rp / 16;
  const int64_t q_len = p.starts[item.seq + 1] - p.starts[item.seq];
  const int64_t first_pos = p.seq_lens[item.seq] - q_len + item.first_query;
  const int64_t last_pos = first_pos + item.num_queries - 1;
  const int64_t* table = p.tables + item.seq * p.max_blocks;
  // Q as pairs, rows in lanes; the padding rows (past `rows`) get zeros and the last row's range.
  for (int64_t r = 0; r < rp; ++r) {
    const int64_t i = std::min(r, rows - 1) / G, j = std::min(r, rows - 1) % G;
    const uint32_t* row = reinterpret_cast<const uint32_t*>(
        q + (p.starts[item.seq] + item.first_query + i) * p.q_token_stride + (item.kv_head * G + j) * p.q_head_stride);
    for (int64_t c = 0; c < pairs; ++c) sc.qp[c * rp + r] = r < rows ? row[c] : 0u;
    sc.pos[r] = static_cast<int32_t>(first_pos + i);
    sc.lo[r] = static_cast<int32_t>(key_lo(p, first_pos + i));
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * D, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + rp, NEG_INF);
  std::fill(sc.l.begin(), sc.l.begin() + rp, 0.0f);
  // Interleaves two vectors of bf16 (16 each, as cvtne2ps packs them) into 16 pairs.
  alignas(64) static const uint16_t pair_idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(pair_idx);
  const __m512 neg_inf = _mm512_set1_ps(NEG_INF), one = _mm512_set1_ps(1.0f);
  // e^(scale * x) = 2^(scale * log2(e) * x)
  const __m512 scale = _mm512_set1_ps(p.scale * 1.44269504088896341f);
  int64_t offsets[KT];
  const uint32_t* krows[KT];
  alignas(64) float alpha[16];

  const int64_t start = key_lo(p, first_pos);
  for (int64_t k0 = start; k0 <= last_pos; k0 += KT) {
    const int64_t n = std::min<int64_t>(KT, last_pos + 1 - k0);
    token_offsets(p, table, k0, n, item.kv_head, offsets);
    for (int64_t t = 0; t < KT; ++t) {  // keys past n point at key 0 (their scores are masked)
      krows[t] = reinterpret_cast<const uint32_t*>(k_cache + offsets[t < n ? t : 0]);
    }
    pack_v_pairs(v_cache, offsets, 0, n, D, sc.vp.data());
    const int64_t key_blocks = (n + LANE_KEYS - 1) / LANE_KEYS;
    for (int64_t v0 = 0; v0 < vectors; v0 += 3) {  // up to 3 row vectors share each key broadcast
      const int64_t rv = std::min<int64_t>(3, vectors - v0);
      for (int64_t b = 0; b < key_blocks; ++b) {
        const uint32_t* qp = sc.qp.data() + v0 * 16;
        float* st = sc.st.data() + b * LANE_KEYS * rp + v0 * 16;
        if (rv == 3) qk_lanes<3>(qp, krows + b * LANE_KEYS, st, rp, pairs);
        else if (rv == 2) qk_lanes<2>(qp, krows + b * LANE_KEYS, st, rp, pairs);
        else qk_lanes<1>(qp, krows + b * LANE_KEYS, st, rp, pairs);
      }
    }
    // Every key of the tile is in range for every row: no masking.
    const bool full = n == KT && k0 + KT - 1 <= first_pos && k0 >= key_lo(p, last_pos);
    const int64_t keys = key_blocks * LANE_KEYS;  // scores computed (past n: masked)
    for (int64_t v = 0; v < vectors; ++v) {
      const __m512i pos = _mm512_loadu_si512(sc.pos.data() + v * 16), lo = _mm512_loadu_si512(sc.lo.data() + v * 16);
      float* st = sc.st.data() + v * 16;
      __m512 mx = neg_inf;
      for (int64_t t = 0; t < keys; ++t) {
        __m512 x = _mm512_loadu_ps(st + t * rp);
        if (!full) {
          const __m512i key = _mm512_set1_epi32(static_cast<int>(k0 + t));
          __mmask16 in = _mm512_cmple_epi32_mask(key, pos) & _mm512_cmpge_epi32_mask(key, lo);
          if (t >= n) in = 0;
          x = _mm512_mask_mov_ps(neg_inf, in, x);
          _mm512_storeu_ps(st + t * rp, x);
        }
        mx = _mm512_max_ps(mx, x);
      }
      const __m512 m_old = _mm512_loadu_ps(sc.m.data() + v * 16);
      const __m512 m_new = _mm512_max_ps(m_old, mx);
      // A row with no key yet keeps m = -inf; 0 in its place keeps exp's arguments free of NaN.
      const __m512 m_safe = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
      const __m512 a = exp2_nonpositive(_mm512_mul_ps(scale, _mm512_sub_ps(m_old, m_safe)));
      __m512 l = _mm512_mul_ps(_mm512_loadu_ps(sc.l.data() + v * 16), a);
      _mm512_storeu_ps(sc.m.data() + v * 16, m_new);
      // Rescale the accumulators of rows whose max grew and that have any (m_old > -inf).
      __mmask16 grew = _mm512_cmp_ps_mask(a, one, _CMP_LT_OQ) & _mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_OQ);
      if (grew) {
        _mm512_store_ps(alpha, a);
        for (; grew; grew &= grew - 1) {
          const int64_t r = v * 16 + __builtin_ctz(grew);
          if (r >= rows) break;
          const __m512 ar = _mm512_set1_ps(alpha[r - v * 16]);
          for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(sc.acc.data() + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(sc.acc.data() + r * D + d), ar));
        }
      }
      const __m512 shift = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), scale), m_safe);
      for (int64_t t = 0; t < keys; t += 2) {  // LANE_KEYS is even: t + 1 < keys
        const __m512 p0 = exp2_nonpositive(_mm512_fmadd_ps(_mm512_loadu_ps(st + t * rp), scale, shift));
        const __m512 p1 = exp2_nonpositive(_mm512_fmadd_ps(_mm512_loadu_ps(st + (t + 1) * rp), scale, shift));
        l = _mm512_add_ps(l, _mm512_add_ps(p0, p1));
        // Rounded to bf16 as the row-at-a-time path does, then (p0[r], p1[r]) pairs in lane r.
        const __m512i packed = bh_bits(_mm512_cvtne2ps_pbh(p1, p0));
        _mm512_storeu_si512(sc.pb.data() + (t / 2) * rp + v * 16, _mm512_permutexvar_epi16(interleave, packed));
      }
      _mm512_storeu_ps(sc.l.data() + v * 16, l);
    }
    pv_pairs_block(sc.acc.data(), sc.pb.data(), 1, rp, sc.vp.data(), (n + 1) / 2, rows, D);
  }
  write_out(p, item, sc.acc.data(), sc.l.data(), out);
}
#endif

// ---------------------------------------------------------------------------------------------------
// Dispatch.

std::vector<Item> work_items(const Problem& p, int64_t num_seqs) {
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

// Rows of scratch an item can need: a tile of queries of one KV head, or one query of them all.
inline int64_t max_rows(const Problem& p) { return std::max(QT * p.group, p.num_heads); }

template <class V, typename cache_t, typename q_t>
void run(const Problem& p, int64_t num_seqs, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, at::Tensor& out) {
  const std::vector<Item> items = work_items(p, num_seqs);
  const q_t* qp = q.const_data_ptr<q_t>();
  const cache_t* kc = k_cache.const_data_ptr<cache_t>();
  const cache_t* vc = v_cache.const_data_ptr<cache_t>();
  q_t* op = out.mutable_data_ptr<q_t>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch<V> sc(max_rows(p), p.head_dim);
    for (int64_t i = begin; i < end; ++i) attend_fp32<V, cache_t, q_t>(p, items[i], qp, kc, vc, op, sc);
  });
}

template <typename cache_t, typename q_t>
void run_best(const Problem& p, int64_t num_seqs, const at::Tensor& q, const at::Tensor& k_cache,
              const at::Tensor& v_cache, at::Tensor& out) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<cache_t, c10::BFloat16> && std::is_same_v<q_t, c10::BFloat16>) {
    if (p.head_dim % 32 == 0) {
      const std::vector<Item> items = work_items(p, num_seqs);
      const c10::BFloat16* qp = q.const_data_ptr<c10::BFloat16>();
      const c10::BFloat16* kc = k_cache.const_data_ptr<c10::BFloat16>();
      const c10::BFloat16* vc = v_cache.const_data_ptr<c10::BFloat16>();
      c10::BFloat16* op = out.mutable_data_ptr<c10::BFloat16>();
      at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
        Bf16Scratch sc(max_rows(p), p.head_dim);
        std::unique_ptr<LaneScratch> lanes;  // made by the first prompt item
        for (int64_t i = begin; i < end; ++i) {
          const Item& item = items[i];
          // Rows in lanes when they fill a vector (a chunk's last few queries and per-head decodes:
          // the row-at-a-time kernel).
          if (item.kv_heads == 1 && item.num_queries * p.group >= 16) {
            if (!lanes) lanes = std::make_unique<LaneScratch>((QT * p.group + 15) / 16 * 16, p.head_dim);
            attend_lanes_bf16(p, item, qp, kc, vc, op, *lanes);
          } else {
            attend_bf16(p, item, qp, kc, vc, op, sc);
          }
        }
      });
      return;
    }
  }
#endif
#if defined(__AVX512F__)
  if (p.head_dim % Avx512::W == 0) return run<Avx512, cache_t, q_t>(p, num_seqs, q, k_cache, v_cache, out);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (p.head_dim % Avx2::W == 0) return run<Avx2, cache_t, q_t>(p, num_seqs, q, k_cache, v_cache, out);
#endif
  run<Scalar, cache_t, q_t>(p, num_seqs, q, k_cache, v_cache, out);
}

at::Tensor paged_attention(const at::Tensor& q,                // [T, H, D] (rows may be strided)
                           const at::Tensor& k_cache,          // [NB, BS, KVH, D]
                           const at::Tensor& v_cache,          // [NB, BS, KVH, D]
                           const at::Tensor& block_tables,     // [S, MB] int64
                           const at::Tensor& seq_lens,         // [S] int64: tokens in the cache, new included
                           const at::Tensor& query_start_loc,  // [S + 1] int64: rows of each sequence in q
                           double scale, int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with contiguous heads, got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [NB, BS, KVH, D]");
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_attention is a CPU kernel, got a tensor on ", t->device());
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16,
              "the KV cache must be float32 or bfloat16");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV caches must be contiguous");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "block tables, lengths and starts: contiguous int64");
  }
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S && query_start_loc.numel() == S + 1,
              "one block table row and one start per sequence (plus the end)");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0 = none)");

  Problem p{};
  p.num_heads = q.size(1);
  p.head_dim = q.size(2);
  p.block_size = k_cache.size(1);
  p.num_kv_heads = k_cache.size(2);
  p.max_blocks = block_tables.size(1);
  p.window = sliding_window;
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.scale = static_cast<float>(scale);
  p.tables = block_tables.const_data_ptr<int64_t>();
  p.seq_lens = seq_lens.const_data_ptr<int64_t>();
  p.starts = query_start_loc.const_data_ptr<int64_t>();
  TORCH_CHECK(k_cache.size(3) == p.head_dim, "head_dim of q != the cache's");
  TORCH_CHECK(p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0, "query heads must be a multiple of KV heads");
  p.group = p.num_heads / p.num_kv_heads;
  TORCH_CHECK(p.group <= 64 && p.num_heads <= QT * 64, "at most 64 query heads per KV head and ", QT * 64, " in all");

  // Every length, start and block the kernel will touch, checked first (O(S * MB)): a bad one would
  // read outside the cache or the batch.
  TORCH_CHECK(p.starts[0] == 0 && p.starts[S] == q.size(0), "query_start_loc must run from 0 to T = ", q.size(0));
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = p.starts[s + 1] - p.starts[s], len = p.seq_lens[s];
    TORCH_CHECK(q_len >= 0 && q_len <= len && len <= p.max_blocks * p.block_size, "sequence ", s, ": ", q_len,
                " queries, ", len, " tokens, room for ", p.max_blocks * p.block_size);
    if (q_len == 0) continue;
    const int64_t first = key_lo(p, len - q_len);
    for (int64_t b = first / p.block_size; b < (len + p.block_size - 1) / p.block_size; ++b) {
      const int64_t id = p.tables[s * p.max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", s, ", ", b, "] = ", id, " is outside [0, ", num_blocks, ")");
    }
  }

  at::Tensor out = at::empty({q.size(0), p.num_heads, p.head_dim}, q.options());
  if (q.size(0) == 0) return out;
  const bool bf16_cache = k_cache.scalar_type() == at::kBFloat16, bf16_q = q.scalar_type() == at::kBFloat16;
  if (bf16_cache && bf16_q) {
    run_best<c10::BFloat16, c10::BFloat16>(p, S, q, k_cache, v_cache, out);
  } else if (bf16_cache) {
    run_best<c10::BFloat16, float>(p, S, q, k_cache, v_cache, out);
  } else if (bf16_q) {
    run_best<float, c10::BFloat16>(p, S, q, k_cache, v_cache, out);
  } else {
    run_best<float, float>(p, S, q, k_cache, v_cache, out);
  }
  return out;
}

// The instruction set this library was built for (-march=native on the machine that built it).
std::string kernel_isa() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("kernel_isa() -> str", &kernel_isa);
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, int sliding_window) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_attention", &paged_attention); }
