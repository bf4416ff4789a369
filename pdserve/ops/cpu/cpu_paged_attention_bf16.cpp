// The AVX512-BF16 paged-attention kernels (see cpu_paged_attention.cpp's head comment): products on
// pairs of bf16 with VDPBF16PS and fp32 accumulation; decodes and short items row at a time
// (attend_bf16), prompt items whose rows fill vectors with the rows in lanes (attend_lanes_bf16).

#include "cpu_paged_attention.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)

#include <memory>

namespace pdserve_paged {
namespace {

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

constexpr int LANE_KEYS = 8;
// Keys of one prompt tile in lanes: 4x the row-at-a-time kernel's KT, so each tile's fixed work
// (accumulators loaded and stored around PV, the running max and sum, V packed) is spread over more
// keys. A layer of a 2048-token prefill (benchmarks/prefill_attention.py, one thread): 34.1-34.5 ms
// with 32-key tiles, 31.3-34.8 with 64, 30.5-31.1 with 128, 29.9-31.3 with 256.
constexpr int64_t LKT = 128;  // keys of one QK register block: 8 x (up to) 3 row vectors of accumulators

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
      : qp(D / 2 * rows), vp(LKT / 2 * D), pb(LKT / 2 * rows), st(LKT * rows), acc(rows * D), m(rows), l(rows),
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
  int64_t offsets[LKT];
  const uint32_t* krows[LKT];
  alignas(64) float alpha[16];

  const int64_t start = key_lo(p, first_pos);
  for (int64_t k0 = start; k0 <= last_pos; k0 += LKT) {
    const int64_t n = std::min<int64_t>(LKT, last_pos + 1 - k0);
    token_offsets(p, table, k0, n, item.kv_head, offsets);
    for (int64_t t = 0; t < LKT; ++t) {  // keys past n point at key 0 (their scores are masked)
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
    const bool full = n == LKT && k0 + LKT - 1 <= first_pos && k0 >= key_lo(p, last_pos);
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

}  // namespace

void run_bf16(const Problem& p, int64_t num_seqs, const at::Tensor& q, const at::Tensor& k_cache,
              const at::Tensor& v_cache, at::Tensor& out) {
  const std::vector<Item> items = work_items(p, num_seqs);
  const c10::BFloat16* qp = q.const_data_ptr<c10::BFloat16>();
  const c10::BFloat16* kc = k_cache.const_data_ptr<c10::BFloat16>();
  const c10::BFloat16* vc = v_cache.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.mutable_data_ptr<c10::BFloat16>();
  struct ThreadScratch {
    Bf16Scratch sc;
    std::unique_ptr<LaneScratch> lanes;  // made by the first prompt item
  };
  pdserve_parallel::for_each_taken(
      item_order(p, items), [&] { return ThreadScratch{Bf16Scratch(max_rows(p), p.head_dim), nullptr}; },
      [&](int64_t i, ThreadScratch& own) {
        const Item& item = items[i];
        // Rows in lanes when they fill a vector (a chunk's last few queries and per-head decodes:
        // the row-at-a-time kernel).
        if (item.kv_heads == 1 && item.num_queries * p.group >= 16) {
          if (!own.lanes) own.lanes = std::make_unique<LaneScratch>((QT * p.group + 15) / 16 * 16, p.head_dim);
          attend_lanes_bf16(p, item, qp, kc, vc, op, *own.lanes);
        } else {
          attend_bf16(p, item, qp, kc, vc, op, own.sc);
        }
      });
}

}  // namespace pdserve_paged

#endif
