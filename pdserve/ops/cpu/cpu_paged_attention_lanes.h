// Prompt items of the fp32 paged-attention kernel with the rows in vector lanes (AVX2 and AVX-512;
// included by cpu_paged_attention.cpp, which chooses it for a prompt item whose rows fill a vector).
//
// An item's rows (its queries x the G query heads of one KV head) are laid out across the lanes:
// Q packed once per item as qp[d][row], the scores of a tile of keys as st[key][row], the output
// accumulated transposed as acc[d][row]. Both products are then the same register-blocked
// outer product, an element of K or V broadcast against vectors of rows:
//   st[t][r] = sum_d k[t][d] * qp[d][r]     (keys t of a block of IB, RV row vectors)
//   acc[d][r] += sum_t v[t][d] * st[t][r]   (columns d of a block of IB, RV row vectors)
// with IB x RV accumulators in registers, K and V read in place from their cache rows (no per-tile
// transpose, no copy), and the whole online softmax vertical: a row's max over the tile is a vector
// max per key, rescaling the accumulators of rows whose max grew is a vector multiply per column.
// The row-at-a-time kernel pays per row what this pays per W rows: a horizontal max and sum and
// a scalar rescale of D columns per tile of W keys, and K transposed per tile for every item.

#pragma once

#include "cpu_paged_attention.h"

namespace pdserve_paged {

// Keys of one tile: enough that the softmax's per-tile work (the max, the rescale of every column)
// is spread over many keys, few enough that the scores st (FKT x rows fp32: 12 KiB for SmolLM2's
// 48 rows) stay in L1 with qp and acc.
constexpr int64_t FKT = 64;

// Keys (QK) or columns (PV) per register block: IB x RV accumulators, RV row vectors and a
// broadcast fit the register file (AVX2: 4 x 3 + 3 + 1 = 16 ymm; AVX-512: 8 x 3 + 3 + 1 of 32 zmm).
template <class V>
constexpr int lane_block() {
  return V::W == 8 ? 4 : 8;
}
constexpr int LANE_RV = 3;

struct LaneScratchF32 {
  std::vector<float> qp, st, acc, m, l, pos, lo;
  std::vector<int64_t> offsets;
  LaneScratchF32(int64_t rp, int64_t D)
      : qp(D * rp), st(FKT * rp), acc(D * rp), m(rp), l(rp), pos(rp), lo(rp), offsets(FKT) {}
};

// st[i][row vectors] = q . k for the IB keys of krows, RV row vectors from qp (row stride rp).
template <class V, int IB, int RV, typename cache_t>
inline void qk_lanes_f32(const float* qp, const cache_t* const* krows, float* st, int64_t rp, int64_t D) {
  constexpr int W = V::W;
  typename V::reg s[IB][RV];
  for (int i = 0; i < IB; ++i)
    for (int v = 0; v < RV; ++v) s[i][v] = V::zero();
  for (int64_t d = 0; d < D; ++d) {
    typename V::reg q[RV];
    for (int v = 0; v < RV; ++v) q[v] = V::load(qp + d * rp + v * W);
#pragma GCC unroll 8
    for (int i = 0; i < IB; ++i) {
      const typename V::reg k = V::set1(to_f(krows[i][d]));
      for (int v = 0; v < RV; ++v) s[i][v] = V::fma(k, q[v], s[i][v]);
    }
  }
  for (int i = 0; i < IB; ++i)
    for (int v = 0; v < RV; ++v) V::store(st + i * rp + v * W, s[i][v]);
}

// acc[i][row vectors] += sum_t v[t][d0 + i] * pt[t][row vectors] over the tile's n keys, for the IB
// columns from d0 (acc and pt point at the first row vector; row stride rp).
template <class V, int IB, int RV, typename cache_t>
inline void pv_lanes_f32(float* acc, const float* pt, const cache_t* const* vrows, int64_t d0, int64_t n, int64_t rp) {
  constexpr int W = V::W;
  typename V::reg a[IB][RV];
  for (int i = 0; i < IB; ++i)
    for (int v = 0; v < RV; ++v) a[i][v] = V::load(acc + i * rp + v * W);
  for (int64_t t = 0; t < n; ++t) {
    typename V::reg pr[RV];
    for (int v = 0; v < RV; ++v) pr[v] = V::load(pt + t * rp + v * W);
    const cache_t* vrow = vrows[t] + d0;
#pragma GCC unroll 8
    for (int i = 0; i < IB; ++i) {
      const typename V::reg x = V::set1(to_f(vrow[i]));
      for (int v = 0; v < RV; ++v) a[i][v] = V::fma(x, pr[v], a[i][v]);
    }
  }
  for (int i = 0; i < IB; ++i)
    for (int v = 0; v < RV; ++v) V::store(acc + i * rp + v * W, a[i][v]);
}

// The two products over every row vector, RV at a time and the remainder in one smaller block.
template <class V, typename cache_t>
inline void qk_tile(const float* qp, const cache_t* const* krows, float* st, int64_t keys, int64_t vectors,
                    int64_t rp, int64_t D) {
  constexpr int IB = lane_block<V>(), W = V::W;
  for (int64_t v0 = 0; v0 < vectors; v0 += LANE_RV) {
    const int64_t rv = std::min<int64_t>(LANE_RV, vectors - v0);
    for (int64_t b = 0; b < keys; b += IB) {
      const float* q = qp + v0 * W;
      float* s = st + b * rp + v0 * W;
      if (rv == 3) qk_lanes_f32<V, IB, 3>(q, krows + b, s, rp, D);
      else if (rv == 2) qk_lanes_f32<V, IB, 2>(q, krows + b, s, rp, D);
      else qk_lanes_f32<V, IB, 1>(q, krows + b, s, rp, D);
    }
  }
}

template <class V, typename cache_t>
inline void pv_tile(float* acc, const float* st, const cache_t* const* vrows, int64_t n, int64_t vectors, int64_t rp,
                    int64_t D) {
  constexpr int IB = lane_block<V>(), W = V::W;
  for (int64_t v0 = 0; v0 < vectors; v0 += LANE_RV) {
    const int64_t rv = std::min<int64_t>(LANE_RV, vectors - v0);
    for (int64_t d0 = 0; d0 < D; d0 += IB) {
      float* a = acc + d0 * rp + v0 * W;
      const float* pt = st + v0 * W;
      if (rv == 3) pv_lanes_f32<V, IB, 3>(a, pt, vrows, d0, n, rp);
      else if (rv == 2) pv_lanes_f32<V, IB, 2>(a, pt, vrows, d0, n, rp);
      else pv_lanes_f32<V, IB, 1>(a, pt, vrows, d0, n, rp);
    }
  }
}

// Rows of an item in lanes: num_queries * G rounded up to whole vectors.
template <class V>
inline int64_t lane_rows_f32(int64_t rows) {
  return (rows + V::W - 1) / V::W * V::W;
}

// One prompt item (one KV head, rows = num_queries * G >= W). D % W == 0 and D % IB == 0.
template <class V, typename cache_t, typename q_t>
void attend_lanes_f32(const Problem& p, const Item& item, const q_t* q, const cache_t* k_cache,
                      const cache_t* v_cache, q_t* out, LaneScratchF32& sc) {
  using reg = typename V::reg;
  constexpr int W = V::W, IB = lane_block<V>();
  const int64_t D = p.head_dim, G = p.group;
  const int64_t rows = item.num_queries * G, rp = lane_rows_f32<V>(rows), vectors = rp / W;
  const int64_t q_len = p.starts[item.seq + 1] - p.starts[item.seq];
  const int64_t first_pos = p.seq_lens[item.seq] - q_len + item.first_query;
  const int64_t last_pos = first_pos + item.num_queries - 1;
  const int64_t* table = p.tables + item.seq * p.max_blocks;
  // Q as fp32 with the rows in lanes; padding rows (past `rows`) get zeros and the last row's range.
  for (int64_t r = 0; r < rp; ++r) {
    const int64_t i = std::min(r, rows - 1) / G, j = std::min(r, rows - 1) % G;
    const q_t* row = q + (p.starts[item.seq] + item.first_query + i) * p.q_token_stride +
                     (item.kv_head * G + j) * p.q_head_stride;
    for (int64_t d = 0; d < D; ++d) sc.qp[d * rp + r] = r < rows ? to_f(row[d]) : 0.0f;
    // Positions as floats: exact below 2^24 tokens, far past any context here.
    sc.pos[r] = static_cast<float>(first_pos + i);
    sc.lo[r] = static_cast<float>(key_lo(p, first_pos + i));
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + D * rp, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + rp, NEG_INF);
  std::fill(sc.l.begin(), sc.l.begin() + rp, 0.0f);
  const reg neg_inf = V::set1(NEG_INF), scale = V::set1(p.scale);
  const cache_t* krows[FKT];
  const cache_t* vrows[FKT];

  const int64_t start = key_lo(p, first_pos);
  for (int64_t k0 = start; k0 <= last_pos; k0 += FKT) {
    const int64_t n = std::min<int64_t>(FKT, last_pos + 1 - k0);
    token_offsets(p, table, k0, n, item.kv_head, sc.offsets.data());
    for (int64_t t = 0; t < FKT; ++t) {  // keys past n point at key 0 (their scores are masked)
      krows[t] = k_cache + sc.offsets[t < n ? t : 0];
      vrows[t] = v_cache + sc.offsets[t < n ? t : 0];
    }
    for (int64_t ahead = k0 + FKT; ahead < std::min(k0 + 2 * FKT, last_pos + 1); ahead += 16) {  // the next tile
      prefetch_tokens(p, table, ahead, last_pos + 1 - ahead, item.kv_head, 1, k_cache, v_cache);
    }
    const int64_t keys = (n + IB - 1) / IB * IB;  // scores computed (past n: masked)
    qk_tile<V>(sc.qp.data(), krows, sc.st.data(), keys, vectors, rp, D);
    // Every key of the tile is in range for every row: no masking.
    const bool full = n == FKT && k0 + FKT - 1 <= first_pos && k0 >= key_lo(p, last_pos);
    for (int64_t v = 0; v < vectors; ++v) {
      float* st = sc.st.data() + v * W;
      const reg pos = V::load(sc.pos.data() + v * W), lo = V::load(sc.lo.data() + v * W);
      reg mx = neg_inf;
      for (int64_t t = 0; t < keys; ++t) {
        reg x = V::load(st + t * rp);
        if (!full) {
          x = t < n ? V::keep_in_range(x, V::set1(static_cast<float>(k0 + t)), lo, pos) : neg_inf;
          V::store(st + t * rp, x);
        }
        mx = V::max(mx, x);
      }
      const reg m_old = V::load(sc.m.data() + v * W), m_new = V::max(m_old, mx);
      const reg m_safe = V::finite_or_zero(m_new);
      // scale > 0, so the raw scores' max is the scaled scores' max. A row's first keys: m_old is
      // -inf and alpha 0, on an accumulator and sum that are 0.
      const reg alpha = V::exp_nonpositive(V::mul(scale, V::sub(m_old, m_safe)));
      reg l = V::mul(V::load(sc.l.data() + v * W), alpha);
      V::store(sc.m.data() + v * W, m_new);
      for (int64_t d = 0; d < D; ++d) {
        float* a = sc.acc.data() + d * rp + v * W;
        V::store(a, V::mul(V::load(a), alpha));
      }
      const reg shift = V::mul(V::sub(V::zero(), scale), m_safe);
      for (int64_t t = 0; t < keys; ++t) {
        const reg pr = V::exp_nonpositive(V::fma(V::load(st + t * rp), scale, shift));
        l = V::add(l, pr);
        V::store(st + t * rp, pr);
      }
      V::store(sc.l.data() + v * W, l);
    }
    pv_tile<V>(sc.acc.data(), sc.st.data(), vrows, n, vectors, rp, D);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / G, j = r % G;
    q_t* orow = out + (p.starts[item.seq] + item.first_query + i) * p.num_heads * D + (item.kv_head * G + j) * D;
    const float inv = 1.0f / sc.l[r];  // every query attends at least itself
    for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<q_t>(sc.acc[d * rp + r] * inv);
  }
}

}  // namespace pdserve_paged
