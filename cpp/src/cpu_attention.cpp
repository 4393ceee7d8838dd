// CPU paged attention: decode (with flash-decoding split-K) and varlen causal prefill.
//
// Both kernels run one routine, attend_blocks(): a tile of R query rows — all G = Hq / Hkv query
// heads of one KV head (GQA), times a few query tokens for prefill — walks the (block, kv head)
// tiles of its context once, so each contiguous K/V tile is read from memory once per tile of
// rows and reused from L1 by every row. Scores use the online softmax of FlashAttention
// (Dao et al. 2022, section 3.1; running max m, running sum l, rescaled accumulator), in fp32.
// Split-K (flash-decoding) partitions a sequence's context; the partial (m, l, acc) triples are
// combined by a log-sum-exp reduction. Work items are spread over OpenMP threads.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_qk_pv.h"
#include "cpu_vec.h"

namespace pagedllm::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
/// Launches with less work than this (multiply-adds of QK^T per query head group) run on the
/// calling thread only.
constexpr int64_t kMinParallelElements = 1 << 16;

/// Geometry shared by every work item of one launch.
template <typename T>
struct Context {
  const T* key_cache;
  const T* value_cache;
  const int32_t* block_tables;
  int64_t max_blocks;  // M, row length of block_tables
  int64_t num_kv_heads;
  int block_size;
  int32_t sliding_window;
  float soft_cap;
};

/// Per-thread scratch, sized for up to `rows` query rows (rounded up to 16 for the row-tiled
/// prefill path, whose transposed query qt, probabilities pt and fp32 K chunk kf live here too).
struct Workspace {
  std::vector<float> q, acc, m, l, s, vf, qt, pt, kf;
  std::vector<bf16> qb;
  std::vector<int32_t> pos;
  Workspace(int rows, int head_size, int block_size) {
    const size_t r16 = (size_t(rows) + 15) / 16 * 16, d = head_size;
    q.resize(r16 * d);
    acc.resize(r16 * d);
    m.resize(r16);
    l.resize(r16);
    s.resize(r16 * block_size);
    vf.resize(size_t(block_size) * d);
    qb.resize(r16 * d);
    pos.resize(r16);
    if (rows >= 16) {
      qt.resize(r16 * d);
      pt.resize(16 * 16);
      kf.resize(16 * d);
    }
  }
};

/// Online-softmax attention of R query rows (w.q: [R][D] fp32, already multiplied by `scale`;
/// for bf16 also w.qb: the unscaled bf16 rows; w.pos[r]: the row's position) over the context
/// tokens [lo, hi) of one sequence (`table`: its block-table row) and KV head `kvh`, updating
/// w.m, w.l, w.acc ([R][D]). Row r sees token j iff j <= pos[r] and (no window or
/// j > pos[r] - window).
template <typename T, int D>
void attend_blocks(const Context<T>& c, const int32_t* table, int64_t kvh, int64_t lo, int64_t hi,
                   int R, float scale, Workspace& w) {
  const int bs = c.block_size;
  const float* q = w.q.data();
  const bf16* qb = w.qb.data();
  const int32_t* pos = w.pos.data();
  float* m = w.m.data();
  float* l = w.l.data();
  float* acc = w.acc.data();
  float* s = w.s.data();
  const float cap = c.soft_cap;
  const int32_t window = c.sliding_window;
  for (int64_t blk = lo / bs; blk * bs < hi; ++blk) {
    const int64_t base = blk * bs;  // position of row 0 of this block
    const int t0 = static_cast<int>(std::max<int64_t>(lo, base) - base);
    const int t1 = static_cast<int>(std::min<int64_t>(hi, base + bs) - base);
    const int64_t tile = (static_cast<int64_t>(table[blk]) * c.num_kv_heads + kvh) * bs * D;
    const T* kt = c.key_cache + tile;
    if ((blk + 1) * bs < hi) {
      // Blocks are scattered, so the hardware prefetcher cannot run ahead across tiles: fetch
      // the next (block, kv head) K and V tiles while this one is computed.
      const int64_t next = (static_cast<int64_t>(table[blk + 1]) * c.num_kv_heads + kvh) * bs * D;
      const char* nk = reinterpret_cast<const char*>(c.key_cache + next);
      const char* nv = reinterpret_cast<const char*>(c.value_cache + next);
      for (size_t off = 0; off < size_t(bs) * D * sizeof(T); off += 64) {
        __builtin_prefetch(nk + off);
        __builtin_prefetch(nv + off);
      }
    }
    const float* vp;
    if constexpr (std::is_same_v<T, float>) {
      vp = c.value_cache + tile;
    } else {
      to_float_row(c.value_cache + tile + t0 * D, w.vf.data() + t0 * D, (t1 - t0) * D);
      vp = w.vf.data();
    }
    // Scores S = Q K^T for this block, 16 tokens at a time (bs is a multiple of 16); a chunk's
    // K rows stay in L1 for all R rows. Rows outside [t0, t1) are computed but never used.
    for (int c16 = t0 - t0 % 16; c16 < t1; c16 += 16)
      for (int r = 0; r < R; ++r)
        qk_chunk16<T, D>(q + r * D, qb + r * D, scale, kt + c16 * D, s + r * bs + c16);
    for (int r = 0; r < R; ++r) {
      float* sr = s + r * bs;
      if (cap > 0.0f) {
        const float inv = 1.0f / cap;
#pragma omp simd
        for (int t = t0; t < t1; ++t) sr[t] = cap * tanh_vec(sr[t] * inv);
      }
      // Causal and sliding-window mask, only where the block crosses a boundary of this row.
      const int64_t p = pos[r];
      const bool crosses_causal = base + t1 - 1 > p;
      const bool crosses_window = window > 0 && base + t0 <= p - window;
      if (crosses_causal || crosses_window) {
        const int64_t wlo = window > 0 ? p - window : std::numeric_limits<int64_t>::min();
#pragma omp simd
        for (int t = t0; t < t1; ++t) {
          const int64_t j = base + t;
          sr[t] = (j <= p && j > wlo) ? sr[t] : kNegInf;
        }
      }
      float mx = kNegInf;
#pragma omp simd reduction(max : mx)
      for (int t = t0; t < t1; ++t) mx = std::max(mx, sr[t]);
      if (mx == kNegInf) continue;  // nothing visible to this row in this block
      const float m_new = std::max(m[r], mx);
      const float corr = exp_neg(m[r] - m_new);  // m[r] = -inf -> ~0, and acc, l are 0 then
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int t = t0; t < t1; ++t) {
        const float e = exp_neg(sr[t] - m_new);
        const float pr = sr[t] == kNegInf ? 0.0f : e;
        sr[t] = pr;
        sum += pr;
      }
      m[r] = m_new;
      l[r] = l[r] * corr + sum;
      pv_row<D>(acc + r * D, corr, sr, vp, t0, t1);
    }
  }
}

#if defined(__AVX512F__)
/// attend_blocks for many rows (prefill tiles), transposed: query rows sit in the 16 lanes of a
/// vector, so S^T[t][rows] = sum_d K[t][d] * Q^T[d][rows] needs no horizontal reduction
/// (broadcast K element times a column of Q^T; a bf16 chunk is widened to fp32 once), and the online
/// softmax (max, exp, sum, mask) runs vertically over 16 rows at once. PV stays row-wise.
template <typename T, int D>
void attend_blocks_rows16(const Context<T>& c, const int32_t* table, int64_t kvh, int64_t lo,
                          int64_t hi, int R, float /*scale: already in w.q*/, Workspace& w) {
  const int bs = c.block_size;
  const int NG = (R + 15) / 16;
  for (int r = R; r < NG * 16; ++r) {  // padding rows: see nothing, never written back
    w.pos[r] = -1;
    w.m[r] = kNegInf;
    w.l[r] = 0.0f;
  }
  for (int r = 0; r < NG * 16; ++r)  // transpose the query tile once per work item
    for (int d = 0; d < D; ++d)
      w.qt[(size_t(r / 16) * D + d) * 16 + r % 16] = r < R ? w.q[size_t(r) * D + d] : 0.0f;
  const float cap = c.soft_cap;
  const int32_t window = c.sliding_window;
  float corr_lanes[16];
  for (int64_t blk = lo / bs; blk * bs < hi; ++blk) {
    const int64_t base = blk * bs;
    const int t0 = static_cast<int>(std::max<int64_t>(lo, base) - base);
    const int t1 = static_cast<int>(std::min<int64_t>(hi, base + bs) - base);
    const int64_t tile = (static_cast<int64_t>(table[blk]) * c.num_kv_heads + kvh) * bs * D;
    const T* kt = c.key_cache + tile;
    if ((blk + 1) * bs < hi) {
      const int64_t next = (static_cast<int64_t>(table[blk + 1]) * c.num_kv_heads + kvh) * bs * D;
      const char* nk = reinterpret_cast<const char*>(c.key_cache + next);
      const char* nv = reinterpret_cast<const char*>(c.value_cache + next);
      for (size_t off = 0; off < size_t(bs) * D * sizeof(T); off += 64) {
        __builtin_prefetch(nk + off);
        __builtin_prefetch(nv + off);
      }
    }
    const float* vp;
    if constexpr (std::is_same_v<T, float>) {
      vp = c.value_cache + tile;
    } else {
      to_float_row(c.value_cache + tile + t0 * D, w.vf.data() + t0 * D, (t1 - t0) * D);
      vp = w.vf.data();
    }
    for (int c16 = t0 - t0 % 16; c16 < t1; c16 += 16) {
      const int u0 = std::max(t0, c16) - c16, u1 = std::min(t1, c16 + 16) - c16;
      const float* kf16;  // the chunk's 16 K rows in fp32 (converted once for all row groups)
      if constexpr (std::is_same_v<T, float>) {
        kf16 = kt + size_t(c16) * D;
      } else {
        to_float_row(kt + size_t(c16) * D, w.kf.data(), 16 * D);
        kf16 = w.kf.data();
      }
      for (int g = 0; g < NG; ++g) {
        __m512 acc[16];
        for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
        {
          const float* kc16 = kf16;
          const float* qg = w.qt.data() + size_t(g) * D * 16;
          for (int d = 0; d < D; ++d) {
            const __m512 qv = _mm512_loadu_ps(qg + d * 16);
            for (int t = 0; t < 16; ++t)
              acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(kc16[t * D + d]), qv, acc[t]);
          }
        }
        if (cap > 0.0f) {
          const __m512 cv = _mm512_set1_ps(cap), inv = _mm512_set1_ps(1.0f / cap);
          for (int t = 0; t < 16; ++t) acc[t] = _mm512_mul_ps(cv, tanh512(_mm512_mul_ps(acc[t], inv)));
        }
        const __m512i posv = _mm512_loadu_si512(w.pos.data() + g * 16);
        const __m512i wlo = _mm512_sub_epi32(posv, _mm512_set1_epi32(window));
        const __m512 ninf = _mm512_set1_ps(kNegInf);
        __mmask16 valid[16];
        __mmask16 any = 0;
        __m512 mx = ninf;
        for (int t = 0; t < 16; ++t) {
          if (t < u0 || t >= u1) {
            valid[t] = 0;
            continue;
          }
          const __m512i j = _mm512_set1_epi32(static_cast<int32_t>(base + c16 + t));
          __mmask16 v = _mm512_cmp_epi32_mask(j, posv, _MM_CMPINT_LE);
          if (window > 0) v &= _mm512_cmp_epi32_mask(j, wlo, _MM_CMPINT_NLE);
          valid[t] = v;
          any |= v;
          mx = _mm512_max_ps(mx, _mm512_mask_mov_ps(ninf, v, acc[t]));
        }
        if (!any) continue;
        const __m512 mold = _mm512_loadu_ps(w.m.data() + g * 16);
        const __m512 mnew = _mm512_max_ps(mold, mx);
        const __mmask16 had = _mm512_cmp_ps_mask(mold, ninf, _CMP_NEQ_OQ);
        const __m512 msafe = _mm512_mask_mov_ps(_mm512_setzero_ps(), any | had, mnew);
        const __m512 corr = _mm512_maskz_mov_ps(had, exp512_neg(_mm512_sub_ps(mold, msafe)));
        __m512 sum = _mm512_setzero_ps();
        for (int t = u0; t < u1; ++t) {
          const __m512 p = _mm512_maskz_mov_ps(valid[t], exp512_neg(_mm512_sub_ps(acc[t], msafe)));
          _mm512_storeu_ps(w.pt.data() + t * 16, p);
          sum = _mm512_add_ps(sum, p);
        }
        _mm512_storeu_ps(w.m.data() + g * 16, mnew);
        _mm512_storeu_ps(w.l.data() + g * 16,
                         _mm512_fmadd_ps(_mm512_loadu_ps(w.l.data() + g * 16), corr, sum));
        _mm512_storeu_ps(corr_lanes, corr);
        for (int lane = 0; lane < 16 && g * 16 + lane < R; ++lane) {
          if (!((any >> lane) & 1)) continue;  // nothing visible: m, l, acc unchanged
          pv_row<D>(w.acc.data() + size_t(g * 16 + lane) * D, corr_lanes[lane], w.pt.data() + lane,
                    vp + size_t(c16) * D, u0, u1, 16);
        }
      }
    }
  }
}
#endif

/// Load query row `src` (D elements) into dst as fp32 times `scale`.
/// (and, for bf16, its unscaled bits into qb).
template <typename T, int D>
inline void load_query(const T* src, float scale, float* dst, bf16* qb) {
#pragma omp simd
  for (int d = 0; d < D; ++d) dst[d] = to_float(src[d]) * scale;
  if constexpr (std::is_same_v<T, bf16>) std::copy_n(src, D, qb);
}

/// out row = acc / l (a zero row when the row saw no token, l == 0).
template <typename T, int D>
inline void store_row(const float* acc, float l, T* dst) {
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma omp simd
  for (int d = 0; d < D; ++d) dst[d] = from_float<T>(acc[d] * inv);
}

inline void reset_rows(Workspace& w, int R, int D) {
  std::fill_n(w.m.begin(), R, kNegInf);
  std::fill_n(w.l.begin(), R, 0.0f);
  std::fill_n(w.acc.begin(), size_t(R) * D, 0.0f);
}

template <typename T>
Context<T> make_context(const TensorView& key_cache, const TensorView& value_cache,
                        const TensorView& block_tables, const AttentionOptions& o) {
  return Context<T>{key_cache.ptr<const T>(), value_cache.ptr<const T>(),
                    block_tables.ptr<const int32_t>(), block_tables.size(1), key_cache.size(1),
                    static_cast<int>(key_cache.size(2)), o.sliding_window, o.soft_cap};
}

template <typename T, int D>
void decode(const TensorView& out, const TensorView& query, const TensorView& key_cache,
            const TensorView& value_cache, const TensorView& block_tables,
            const TensorView& seq_lens, float scale, const AttentionOptions& o, int nt) {
  const Context<T> c = make_context<T>(key_cache, value_cache, block_tables, o);
  const int64_t B = query.size(0), Hq = query.size(1), Hkv = key_cache.size(1);
  const int G = static_cast<int>(Hq / Hkv);
  const int32_t* sl = seq_lens.ptr<const int32_t>();
  const T* qp = query.ptr<const T>();
  T* op = out.ptr<T>();
  const int64_t max_len = *std::max_element(sl, sl + B);
  int64_t total_len = 0;
  for (int64_t b = 0; b < B; ++b) total_len += sl[b];
  // Below ~64K K elements (e.g. 1 sequence x 1K tokens x 1 KV head x d64) the work is a few
  // microseconds: waking other threads would cost more than it saves.
  if (total_len * Hkv * D < kMinParallelElements) nt = 1;
  const int S = decode_num_splits(B, Hkv, max_len, o.split_k, nt);
  // Split-K partials, [B][Hq][S] (m, l) and [B][Hq][S][D] (acc); unused when S == 1.
  std::vector<float> pm, pl, pacc;
  if (S > 1) {
    pm.resize(size_t(B) * Hq * S);
    pl.resize(pm.size());
    pacc.resize(pm.size() * D);
  }
  const int64_t items = B * Hkv * S;
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(nt, items)))
  {
    Workspace w(G, D, c.block_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / (Hkv * S);
      const int64_t kvh = (item / S) % Hkv;
      const int split = static_cast<int>(item % S);
      const int64_t len = sl[b];
      const int64_t p = len - 1;  // the query's position
      const int64_t start = (c.sliding_window > 0) ? std::max<int64_t>(0, p - c.sliding_window + 1) : 0;
      const int64_t span = std::max<int64_t>(0, len - start);
      const int64_t part = (span + S - 1) / S;
      const int64_t lo = start + split * part;
      const int64_t hi = std::min<int64_t>(len, lo + part);
      for (int g = 0; g < G; ++g) {
        load_query<T, D>(qp + (b * Hq + kvh * G + g) * D, scale, w.q.data() + g * D, w.qb.data() + g * D);
        w.pos[g] = static_cast<int32_t>(p);
      }
      reset_rows(w, G, D);
      if (lo < hi) attend_blocks<T, D>(c, c.block_tables + b * c.max_blocks, kvh, lo, hi, G, scale, w);
      for (int g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        if (S == 1) {
          store_row<T, D>(w.acc.data() + g * D, w.l[g], op + (b * Hq + h) * D);
        } else {
          const size_t idx = (size_t(b) * Hq + h) * S + split;
          pm[idx] = w.m[g];
          pl[idx] = w.l[g];
          std::copy_n(w.acc.data() + g * D, D, pacc.data() + idx * D);
        }
      }
    }
    // (implicit barrier) Flash-decoding reduction, in the same parallel region:
    // out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max_s m_s.
    if (S > 1) {
#pragma omp for schedule(static)
      for (int64_t row = 0; row < B * Hq; ++row) {
        const float* m = pm.data() + row * S;
        const float* l = pl.data() + row * S;
        float M = kNegInf;
        for (int s = 0; s < S; ++s) M = std::max(M, m[s]);
        float a[D] = {};
        float L = 0.0f;
        if (M != kNegInf) {
          for (int s = 0; s < S; ++s) {
            if (m[s] == kNegInf) continue;
            const float f = exp_neg(m[s] - M);
            L += f * l[s];
            const float* ps = pacc.data() + (size_t(row) * S + s) * D;
#pragma omp simd
            for (int d = 0; d < D; ++d) a[d] += f * ps[d];
          }
        }
        store_row<T, D>(a, L, op + row * D);
      }
    }
  }
}

/// One prefill work item: query rows [q0, q1) of sequence b, all heads of KV head kvh.
struct PrefillTile {
  int64_t b, q0, q1, cost;
};

template <typename T, int D>
void prefill(const TensorView& out, const TensorView& query, const TensorView& key_cache,
             const TensorView& value_cache, const TensorView& block_tables,
             const TensorView& seq_lens, const TensorView& query_start_loc, float scale,
             const AttentionOptions& o, int nt) {
  const Context<T> c = make_context<T>(key_cache, value_cache, block_tables, o);
  const int64_t B = seq_lens.size(0), Hq = query.size(1), Hkv = key_cache.size(1);
  const int G = static_cast<int>(Hq / Hkv);
  const int32_t* sl = seq_lens.ptr<const int32_t>();
  const int32_t* qsl = query_start_loc.ptr<const int32_t>();
  const T* qp = query.ptr<const T>();
  T* op = out.ptr<T>();
  // Query tile: about 64 rows (query tokens x G heads) share each K/V tile.
  const int QT = std::max(1, 64 / G);
  std::vector<PrefillTile> tiles;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    for (int64_t q0 = 0; q0 < q_len; q0 += QT) {
      const int64_t q1 = std::min<int64_t>(q_len, q0 + QT);
      const int64_t hi = sl[b] - q_len + q1;  // one past the last position this tile sees
      const int64_t lo = o.sliding_window > 0
                             ? std::max<int64_t>(0, sl[b] - q_len + q0 - o.sliding_window + 1)
                             : 0;
      tiles.push_back({b, q0, q1, (hi - lo) * (q1 - q0)});
    }
  }
  // Most expensive first, so that dynamic scheduling balances the causal triangle.
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const PrefillTile& x, const PrefillTile& y) { return x.cost > y.cost; });
  const int64_t items = static_cast<int64_t>(tiles.size()) * Hkv;
  const int R = QT * G;
  int64_t work = 0;  // query rows x visible tokens per KV head, in tiles
  for (const PrefillTile& t : tiles) work += t.cost;
  if (work * Hkv * D < kMinParallelElements) nt = 1;
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(nt, std::max<int64_t>(items, 1))))
  {
    Workspace w(R, D, c.block_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const PrefillTile& tile = tiles[item / Hkv];
      const int64_t kvh = item % Hkv;
      const int64_t b = tile.b;
      const int64_t q_len = qsl[b + 1] - qsl[b];
      const int64_t first_pos = sl[b] - q_len;  // position of query row 0
      const int rows = static_cast<int>(tile.q1 - tile.q0) * G;
      for (int64_t i = tile.q0; i < tile.q1; ++i)
        for (int g = 0; g < G; ++g) {
          const int r = static_cast<int>(i - tile.q0) * G + g;
          load_query<T, D>(qp + ((qsl[b] + i) * Hq + kvh * G + g) * D, scale, w.q.data() + r * D,
                           w.qb.data() + r * D);
          w.pos[r] = static_cast<int32_t>(first_pos + i);
        }
      reset_rows(w, rows, D);
      const int64_t hi = first_pos + tile.q1;
      const int64_t lo = c.sliding_window > 0
                             ? std::max<int64_t>(0, first_pos + tile.q0 - c.sliding_window + 1)
                             : 0;
#if defined(__AVX512F__)
      if (rows >= 16)
        attend_blocks_rows16<T, D>(c, c.block_tables + b * c.max_blocks, kvh, lo, hi, rows, scale, w);
      else
#endif
        attend_blocks<T, D>(c, c.block_tables + b * c.max_blocks, kvh, lo, hi, rows, scale, w);
      for (int64_t i = tile.q0; i < tile.q1; ++i)
        for (int g = 0; g < G; ++g) {
          const int r = static_cast<int>(i - tile.q0) * G + g;
          store_row<T, D>(w.acc.data() + r * D, w.l[r], op + ((qsl[b] + i) * Hq + kvh * G + g) * D);
        }
    }
  }
}

/// Calls f.template operator()<T, D>() for the runtime dtype and head size.
template <typename F>
void dispatch(DType dtype, int64_t head_size, F&& f) {
  auto by_size = [&]<typename T>() {
    switch (head_size) {
      case 64: return f.template operator()<T, 64>();
      case 80: return f.template operator()<T, 80>();
      case 96: return f.template operator()<T, 96>();
      case 128: return f.template operator()<T, 128>();
      case 256: return f.template operator()<T, 256>();
    }
  };
  if (dtype == DType::kFloat32)
    by_size.template operator()<float>();
  else
    by_size.template operator()<bf16>();
}

}  // namespace

int decode_num_splits(int64_t batch, int64_t num_kv_heads, int64_t max_seq_len, int split_k,
                      int num_threads) {
  if (split_k > 0) return split_k;
  if (split_k == 0) return 1;
  // Auto: split only when the (sequence, kv head) items cannot keep every thread busy, into
  // partitions of at least 256 tokens; aim for ~8 items per thread to balance uneven lengths.
  const int64_t items = std::max<int64_t>(1, batch * num_kv_heads);
  if (items >= 8LL * num_threads) return 1;
  const int64_t want = (8LL * num_threads + items - 1) / items;
  const int64_t most = std::max<int64_t>(1, max_seq_len / 256);
  return static_cast<int>(std::max<int64_t>(1, std::min(want, most)));
}

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, float scale, const AttentionOptions& options,
                     int num_threads) {
  dispatch(key_cache.dtype, key_cache.size(3), [&]<typename T, int D>() {
    decode<T, D>(out, query, key_cache, value_cache, block_tables, seq_lens, scale, options,
                 num_threads);
  });
}

void paged_prefill_attention(const TensorView& out, const TensorView& query,
                             const TensorView& key_cache, const TensorView& value_cache,
                             const TensorView& block_tables, const TensorView& seq_lens,
                             const TensorView& query_start_loc, float scale,
                             const AttentionOptions& options, int num_threads) {
  dispatch(key_cache.dtype, key_cache.size(3), [&]<typename T, int D>() {
    prefill<T, D>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                  scale, options, num_threads);
  });
}

}  // namespace pagedllm::cpu
