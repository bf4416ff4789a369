// Decode attention over the paged KV cache on CPU: one query token per sequence, K/V read in place
// from their blocks (no gather into a padded copy), GQA handled by attending all G = H / KVH query
// heads of one KV head together so every K/V row is streamed from memory once per group.
//
// Parallel over sequences x KV heads (all KV heads of a sequence in one work item when there are
// enough sequences, see decode_kernel). The context is walked in tiles of TILE tokens with an online
// (streaming) softmax: a running max m, denominator l and fp32 accumulator acc per query head; each
// tile's scores are computed first, then one rescale of acc per tile (not per token), then the
// weighted V rows are accumulated. bf16 rows are widened to fp32 once per row into an L1 buffer.
//
// With AVX2 + FMA (gcc -march=native on such a machine) and D % 8 == 0, the two matrix products of a
// tile use intrinsics (8 dot products per horizontal reduction, acc held in registers). Otherwise
// plain C++ loops over D with `omp simd`, which gcc -O3 vectorizes for whatever the machine has
// without -ffast-math. exp is a vectorizable polynomial (glibc's expf does not vectorize without
// -ffast-math).
//
// Built and loaded at run time by cpu/kernels.py; registered as torch.ops.pdserve.paged_decode_attention.

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
#include <vector>

#include "cpu_parallel.h"
#include "cpu_vec.h"

namespace {

using namespace pdserve_vec;

// Tokens per tile (a multiple of 8, see qk_tile_avx2): enough to amortize the per-tile softmax
// bookkeeping, small enough that a tile's K/V rows stay in L1 while the G heads reuse them.
constexpr int64_t TILE = 16;

// e^x for x <= 0 (all this kernel needs: scores minus their running max), Cephes' expf polynomial,
// ~1 ulp. Branch-free so that it vectorizes; x below -87 flushes to ~1e-38 instead of 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * LOG2E + 0.5f);  // round(x / ln 2)
  // 2^n, n >= -126: a normal float
  return exp_reduced(x, n) * from_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scale_inplace(float* __restrict y, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// A cache row as fp32: fp32 rows are used in place, bf16 rows widened into `buf` (a bf16 is the top
// half of an fp32, so widening is a 16-bit shift, which vectorizes).
inline const float* row_f32(const float* row, float* /*buf*/, int64_t /*n*/) { return row; }

inline const float* row_f32(const c10::BFloat16* row, float* __restrict buf, int64_t n) {
  const uint16_t* __restrict src = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    buf[i] = f;
  }
  return buf;
}

// scores[g * TILE + t] = qf[g] . krows[t] for the G query heads and the n (<= TILE) rows of a tile.
void qk_tile_generic(const float* qf, const float* const* krows, int64_t n, int64_t G, int64_t D, float* scores) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < G; ++g) scores[g * TILE + t] = dot(qf + g * D, krows[t], D);
  }
}

// acc[g] += sum_t scores[g * TILE + t] * vrows[t] for the G query heads.
void pv_tile_generic(float* acc, const float* scores, const float* const* vrows, int64_t n, int64_t G, int64_t D) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < G; ++g) axpy(acc + g * D, scores[g * TILE + t], vrows[t], D);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// AVX2 versions for D % 8 == 0. The generic loops above vectorize, but each dot ends in a horizontal
// sum and each axpy round-trips acc through memory; here 8 dots share one horizontal reduction and
// acc stays in registers across the tile.

// [sum(a0), ..., sum(a7)] in one vector.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // lanes: 0-3 | 0-3
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));  // lanes: 4-7 | 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

void qk_tile_avx2(const float* qf, const float* const* krows, int64_t n, int64_t G, int64_t D, float* scores) {
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const float* r[8];  // 8 rows at a time; a short last group repeats its last row (result unused)
    for (int j = 0; j < 8; ++j) r[j] = krows[std::min<int64_t>(t0 + j, n - 1)];
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + c);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[0] + c), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[1] + c), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[2] + c), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[3] + c), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[4] + c), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[5] + c), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[6] + c), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[7] + c), a7);
      }
      // TILE is a multiple of 8: lanes past n land in the tile's unused slots.
      _mm256_storeu_ps(scores + g * TILE + t0, hsum8(a0, a1, a2, a3, a4, a5, a6, a7));
    }
  }
}

// NV * 8 columns of one head's acc held in registers over the whole tile.
template <int NV>
inline void pv_columns(float* acc, const float* p, const float* const* vrows, int64_t n, int64_t col) {
  __m256 r[NV];
  for (int i = 0; i < NV; ++i) r[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    const float* v = vrows[t] + col;
    for (int i = 0; i < NV; ++i) r[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * i), r[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, r[i]);
}

void pv_tile_avx2(float* acc, const float* scores, const float* const* vrows, int64_t n, int64_t G, int64_t D) {
  for (int64_t g = 0; g < G; ++g) {
    float* ag = acc + g * D;
    const float* pg = scores + g * TILE;
    int64_t c = 0;
    for (; c + 64 <= D; c += 64) pv_columns<8>(ag + c, pg, vrows, n, c);  // 8 of the 16 ymm registers
    if (D - c >= 32) pv_columns<4>(ag + c, pg, vrows, n, c), c += 32;
    if (D - c >= 16) pv_columns<2>(ag + c, pg, vrows, n, c), c += 16;
    if (D - c >= 8) pv_columns<1>(ag + c, pg, vrows, n, c);
  }
}

// e^x for x <= 0, the same polynomial as exp_nonpositive; lanes below -87 (the -inf padding of a
// short tile) give exactly 0.
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 floor_x = _mm256_set1_ps(-87.0f);
  const __m256 keep = _mm256_cmp_ps(x, floor_x, _CMP_GE_OQ);
  x = _mm256_max_ps(x, floor_x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // round(x / ln 2)
  const __m256 p = exp_reduced(x, n);
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), keep);
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8_one(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
#endif

void qk_tile(const float* qf, const float* const* krows, int64_t n, int64_t G, int64_t D, float* scores) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) return qk_tile_avx2(qf, krows, n, G, D, scores);
#endif
  qk_tile_generic(qf, krows, n, G, D, scores);
}

void pv_tile(float* acc, const float* scores, const float* const* vrows, int64_t n, int64_t G, int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) return pv_tile_avx2(acc, scores, vrows, n, G, D);
#endif
  pv_tile_generic(acc, scores, vrows, n, G, D);
}

// One head's online-softmax step over a tile: raise the running max m to the tile's scores, rescale
// l and acc to the new max, turn the scores sg[0..n) into probabilities and add them to l.
inline void softmax_tile(float* sg, int64_t n, float& m, float& l, float* acc, int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  // Whole vectors: the lanes past n become -inf, so they neither raise the max nor add to the sum.
  for (int64_t t = n; t < TILE; ++t) sg[t] = -std::numeric_limits<float>::infinity();
  __m256 vmax = _mm256_loadu_ps(sg);
  for (int64_t t = 8; t < TILE; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sg + t));
  const float tile_max = hmax8(vmax);
#else
  float tile_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : tile_max)
  for (int64_t t = 0; t < n; ++t) tile_max = std::max(tile_max, sg[t]);
#endif
  const float m_new = std::max(m, tile_max);
  if (m_new > m) {
    // acc and l are 0 before the first tile (m = -inf): nothing to rescale.
    const float alpha = std::isinf(m) ? 0.0f : exp_nonpositive(m - m_new);
    scale_inplace(acc, alpha, D);
    l *= alpha;
    m = m_new;
  }
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 shift = _mm256_set1_ps(m_new);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t t = 0; t < TILE; t += 8) {
    const __m256 p = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), shift));
    _mm256_storeu_ps(sg + t, p);
    vsum = _mm256_add_ps(vsum, p);
  }
  l += hsum8_one(vsum);
#else
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    sg[t] = exp_nonpositive(sg[t] - m_new);
    sum += sg[t];
  }
  l += sum;
#endif
}

struct Shapes {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, group;
  int64_t num_blocks, block_size, max_blocks;
  int64_t q_seq_stride, q_head_stride;
  int64_t sliding_window;
  float scale;
};

template <typename cache_t, typename q_t>
void decode_kernel(const Shapes& s, const q_t* q, const cache_t* k_cache, const cache_t* v_cache,
                   const int64_t* block_tables, const int64_t* seq_lens, q_t* out) {
  const int64_t D = s.head_dim, G = s.group, KVH = s.num_kv_heads, BS = s.block_size;
  const int64_t token_stride = KVH * D;  // elements between consecutive tokens of one KV head
  // A work item is one sequence and a run of `span` KV heads. With all KV heads in one item, a tile
  // reads whole token rows [KVH, D] (contiguous within a block) instead of a 1/KVH slice of each,
  // which streams from DRAM markedly faster; one KV head per item only when there are too few
  // sequences to keep the threads busy otherwise.
  const int64_t span = s.num_seqs >= 2 * at::get_num_threads() ? KVH : 1;
  const int64_t runs = KVH / span;
  const int64_t row_bytes = span * D * static_cast<int64_t>(sizeof(cache_t));

  // Per-thread scratch, reused across work items: state for the span * G query heads; kbuf/vbuf
  // hold one KV head's bf16 tile widened to fp32 (TILE * D floats each, L1-resident).
  const int64_t heads = span * G;
  struct ThreadScratch {
    std::vector<float> qf, acc, m, l, scores, kbuf, vbuf;
    std::vector<const float*> krows, vrows;
    std::vector<int64_t> offsets;
  };
  auto make_scratch = [&] {
    return ThreadScratch{std::vector<float>(heads * D), std::vector<float>(heads * D), std::vector<float>(heads),
                         std::vector<float>(heads), std::vector<float>(G * TILE), std::vector<float>(TILE * D),
                         std::vector<float>(TILE * D), std::vector<const float*>(TILE),
                         std::vector<const float*>(TILE), std::vector<int64_t>(TILE)};
  };
  // Threads take the items as they finish one, the longest contexts first (cpu_parallel.h).
  std::vector<double> keys(s.num_seqs * runs);
  for (int64_t item = 0; item < s.num_seqs * runs; ++item) {
    const int64_t len = seq_lens[item / runs];
    keys[item] = static_cast<double>(s.sliding_window > 0 ? std::min(len, s.sliding_window) : len);
  }
  pdserve_parallel::for_each_taken(
      pdserve_parallel::costliest_first(keys), make_scratch, [&](int64_t item, ThreadScratch& own) {
      std::vector<float>&qf = own.qf, &acc = own.acc, &m = own.m, &l = own.l, &scores = own.scores;
      std::vector<float>&kbuf = own.kbuf, &vbuf = own.vbuf;
      std::vector<const float*>&krows = own.krows, &vrows = own.vrows;
      std::vector<int64_t>& offsets = own.offsets;
      const int64_t b = item / runs, kvh0 = (item % runs) * span;
      const int64_t len = seq_lens[b];
      const int64_t* table = block_tables + b * s.max_blocks;
      // Same keys as the portable mask: positions j with j > pos - window, pos = len - 1.
      const int64_t first = s.sliding_window > 0 ? std::max<int64_t>(0, len - s.sliding_window) : 0;

      for (int64_t h = 0; h < heads; ++h) {  // q rows of these heads, pre-scaled: s = (scale * q) . k
        const q_t* qrow = q + b * s.q_seq_stride + (kvh0 * G + h) * s.q_head_stride;
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<float>(qrow[d]) * s.scale;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);

      int64_t block = first / BS, slot = first % BS;  // stepped, not divided, per row (idiv is slow)
      for (int64_t start = first; start < len; start += TILE) {
        const int64_t n = std::min(TILE, len - start);
        for (int64_t t = 0; t < n; ++t) {  // cache offset of each row's first KV head of the run
          offsets[t] = (table[block] * BS + slot) * token_stride + kvh0 * D;
          if (++slot == BS) slot = 0, ++block;
        }
        // Prefetch the next tile's rows: blocks are scattered, so the hardware prefetcher loses
        // the stream at every block boundary. `block`/`slot` already point at the next tile.
        for (int64_t t = 0, pb = block, ps = slot; t < std::min(TILE, len - start - n); ++t) {
          const int64_t offset = (table[pb] * BS + ps) * token_stride + kvh0 * D;
          const char* kp = reinterpret_cast<const char*>(k_cache + offset);
          const char* vp = reinterpret_cast<const char*>(v_cache + offset);
          for (int64_t byte = 0; byte < row_bytes; byte += 64) {
            __builtin_prefetch(kp + byte);
            __builtin_prefetch(vp + byte);
          }
          if (++ps == BS) ps = 0, ++pb;
        }

        for (int64_t r = 0; r < span; ++r) {  // each KV head of the run with its G query heads
          // The tile's K/V rows as fp32: in place for an fp32 cache, widened once for bf16.
          for (int64_t t = 0; t < n; ++t) {
            krows[t] = row_f32(k_cache + offsets[t] + r * D, kbuf.data() + t * D, D);
            vrows[t] = row_f32(v_cache + offsets[t] + r * D, vbuf.data() + t * D, D);
          }
          float* acc_r = acc.data() + r * G * D;
          // Scores: each K row loaded once for the G query heads; then the online softmax; then
          // the weighted V rows, each loaded once for the G heads.
          qk_tile(qf.data() + r * G * D, krows.data(), n, G, D, scores.data());
          for (int64_t g = 0; g < G; ++g) {
            softmax_tile(scores.data() + g * TILE, n, m[r * G + g], l[r * G + g], acc_r + g * D, D);
          }
          pv_tile(acc_r, scores.data(), vrows.data(), n, G, D);
        }
      }

      for (int64_t h = 0; h < heads; ++h) {  // out is contiguous [B, H, D]
        q_t* orow = out + (b * s.num_heads + kvh0 * G + h) * D;
        const float inv = 1.0f / l[h];
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<q_t>(acc[h * D + d] * inv);
      }
  });
}

template <typename cache_t>
void dispatch_q(const Shapes& s, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const int64_t* tables, const int64_t* lens, at::Tensor& out) {
  const cache_t* k = k_cache.const_data_ptr<cache_t>();
  const cache_t* v = v_cache.const_data_ptr<cache_t>();
  if (q.scalar_type() == at::kFloat) {
    decode_kernel<cache_t, float>(s, q.const_data_ptr<float>(), k, v, tables, lens, out.mutable_data_ptr<float>());
  } else {
    decode_kernel<cache_t, c10::BFloat16>(s, q.const_data_ptr<c10::BFloat16>(), k, v, tables, lens,
                                          out.mutable_data_ptr<c10::BFloat16>());
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q,             // [B, H, D]
                                  const at::Tensor& k_cache,       // [NB, BS, KVH, D]
                                  const at::Tensor& v_cache,       // [NB, BS, KVH, D]
                                  const at::Tensor& block_tables,  // [B, MB] int64, padded
                                  const at::Tensor& seq_lens,      // [B] int64
                                  double scale, int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, KVH, D], got ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache ", v_cache.sizes(), " != k_cache ", k_cache.sizes());
  TORCH_CHECK(block_tables.dim() == 2, "block_tables must be [B, max_blocks], got ", block_tables.sizes());
  TORCH_CHECK(seq_lens.dim() == 1, "seq_lens must be [B], got ", seq_lens.sizes());
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &block_tables, &seq_lens}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention is a CPU kernel, got a tensor on ", t->device());
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "q must be float32 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16,
              "the KV cache must be float32 or bfloat16, got ", k_cache.scalar_type());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be contiguous");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");

  Shapes s{};
  s.num_seqs = q.size(0);
  s.num_heads = q.size(1);
  s.head_dim = q.size(2);
  s.num_blocks = k_cache.size(0);
  s.block_size = k_cache.size(1);
  s.num_kv_heads = k_cache.size(2);
  s.max_blocks = block_tables.size(1);
  s.q_seq_stride = q.stride(0);
  s.q_head_stride = q.stride(1);
  s.sliding_window = sliding_window;
  s.scale = static_cast<float>(scale);
  TORCH_CHECK(k_cache.size(3) == s.head_dim, "head_dim of q (", s.head_dim, ") != the cache's (",
              k_cache.size(3), ")");
  TORCH_CHECK(s.head_dim > 0 && s.num_kv_heads > 0 && s.block_size > 0, "empty head_dim, KV heads or block");
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0, "query heads (", s.num_heads, ") must be a multiple of KV heads (",
              s.num_kv_heads, ")");
  s.group = s.num_heads / s.num_kv_heads;
  TORCH_CHECK(block_tables.size(0) == s.num_seqs && seq_lens.size(0) == s.num_seqs,
              "block_tables and seq_lens must have one row per sequence of q (", s.num_seqs, ")");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0 = none), got ", sliding_window);

  // Check every block the kernel will read (O(B * MB), cheap next to the attention itself): an
  // out-of-range id would otherwise read outside the cache.
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = seq_lens.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < s.num_seqs; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= s.max_blocks * s.block_size, "seq_lens[", b, "] = ", lens[b],
                " is outside [1, max_blocks * block_size = ", s.max_blocks * s.block_size, "]");
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, lens[b] - sliding_window) : 0;
    for (int64_t i = first / s.block_size; i < (lens[b] + s.block_size - 1) / s.block_size; ++i) {
      const int64_t id = tables[b * s.max_blocks + i];
      TORCH_CHECK(id >= 0 && id < s.num_blocks, "block_tables[", b, ", ", i, "] = ", id, " is outside [0, ",
                  s.num_blocks, ")");
    }
  }

  at::Tensor out = at::empty({s.num_seqs, s.num_heads, s.head_dim}, q.options());
  if (s.num_seqs == 0) return out;
  if (k_cache.scalar_type() == at::kFloat) {
    dispatch_q<float>(s, q, k_cache, v_cache, tables, lens, out);
  } else {
    dispatch_q<c10::BFloat16>(s, q, k_cache, v_cache, tables, lens, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int sliding_window) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
