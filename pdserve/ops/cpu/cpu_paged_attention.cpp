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
// cpu/kernels.py); a scalar version elsewhere. With AVX512-BF16 and a bf16 cache, the two products
// use VDPBF16PS on pairs of bf16 (K pairs transposed along D, V pairs interleaved along tokens, the
// probabilities rounded to bf16 as torch's own CPU flash attention does). exp is a branch-free
// polynomial (~1 ulp).
// Prompt items whose rows (QT queries x G heads) fill whole vectors take a kernel with the rows in
// vector lanes instead: the softmax is vertical, Q is packed once per item, K and V are broadcast
// from their cache rows (attend_lanes_bf16: 1.3x the row-at-a-time kernel on a 2048-token bf16
// prefill; attend_lanes_f32 in cpu_paged_attention_lanes.h for fp32, AVX2 and AVX-512).
//
// Registered as torch.ops.pdserve.paged_attention.

#include "cpu_paged_attention.h"
#include "cpu_paged_attention_lanes.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <type_traits>

namespace {

using namespace pdserve_paged;

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

// ---------------------------------------------------------------------------------------------------
// Dispatch.

template <class V, typename cache_t, typename q_t>
void run(const Problem& p, int64_t num_seqs, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, at::Tensor& out) {
  const std::vector<Item> items = work_items(p, num_seqs);
  const q_t* qp = q.const_data_ptr<q_t>();
  const cache_t* kc = k_cache.const_data_ptr<cache_t>();
  const cache_t* vc = v_cache.const_data_ptr<cache_t>();
  q_t* op = out.mutable_data_ptr<q_t>();
  struct ThreadScratch {
    Scratch<V> sc;
    std::unique_ptr<LaneScratchF32> lanes;  // made by the first prompt item
  };
  pdserve_parallel::for_each_taken(
      item_order(p, items), [&] { return ThreadScratch{Scratch<V>(max_rows(p), p.head_dim), nullptr}; },
      [&](int64_t i, ThreadScratch& own) {
        const Item& item = items[i];
        // Rows in lanes when they fill a vector (decodes, and a chunk's last few queries when G is
        // small: row at a time).
        if constexpr (V::W > 1) {
          if (item.kv_heads == 1 && item.num_queries * p.group >= V::W) {
            if (!own.lanes) own.lanes = std::make_unique<LaneScratchF32>(lane_rows_f32<V>(QT * p.group), p.head_dim);
            attend_lanes_f32<V, cache_t, q_t>(p, item, qp, kc, vc, op, *own.lanes);
            return;
          }
        }
        attend_fp32<V, cache_t, q_t>(p, item, qp, kc, vc, op, own.sc);
      });
}

template <typename cache_t, typename q_t>
void run_best(const Problem& p, int64_t num_seqs, const at::Tensor& q, const at::Tensor& k_cache,
              const at::Tensor& v_cache, at::Tensor& out) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<cache_t, c10::BFloat16> && std::is_same_v<q_t, c10::BFloat16>) {
    if (p.head_dim % 32 == 0) return run_bf16(p, num_seqs, q, k_cache, v_cache, out);
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
