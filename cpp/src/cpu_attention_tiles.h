// cpu_attention_tiles.h — internal: the inner loop of the CPU attention kernels. A tile of
// query rows (all G = Hq / Hkv heads of one KV head, times a few query tokens for prefill) walks
// the (block, kv head) K/V tiles of its context [lo, hi) once with the online softmax of
// FlashAttention (Dao et al. 2022, section 3.1: running max m, running sum l, rescaled
// accumulator acc), in fp32. Two variants: attend_blocks (few rows: decode) and, with AVX-512,
// attend_blocks_rows16 (>= 16 rows: prefill tiles; rows in vector lanes for QK, softmax and PV). Used by cpu_attention.cpp only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_fp8.h"
#include "cpu_qk_pv.h"
#include "cpu_vec.h"

namespace pagedllm::cpu::tiles {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

/// How many (block, kv head) tiles ahead the decode loop prefetches (64 x 192 tokens, SmolLM2
/// shape, 30 layers from DRAM: 1 -> 2 tiles 10% faster; 3 and 4 slower than 2).
#ifndef PAGEDLLM_PREFETCH_TILES
#define PAGEDLLM_PREFETCH_TILES 2
#endif
constexpr int64_t kPrefetchTiles = PAGEDLLM_PREFETCH_TILES;

/// Geometry shared by every work item of one launch. T is the query's dtype; the cache holds T
/// (key_cache / value_cache) or FP8 codes (key8 / value8, fp8 = 1 for E4M3, 2 for E5M2), decoded
/// tile by tile into the workspace (tile_rows) — the same element offsets either way.
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
  const uint8_t* key8 = nullptr;
  const uint8_t* value8 = nullptr;
  int fp8 = 0;

  /// Address of element `off` of the key (kv = 0) or value (kv = 1) cache, and an element's bytes.
  const char* bytes(int kv, int64_t off) const {
    if (fp8) return reinterpret_cast<const char*>((kv ? value8 : key8) + off);
    return reinterpret_cast<const char*>((kv ? value_cache : key_cache) + off);
  }
  size_t elem_bytes() const { return fp8 ? 1 : sizeof(T); }
};

/// Prefetch the K and V tiles (bs x D elements) at element offset `tile` into the cache.
template <typename T>
inline void prefetch_tile(const Context<T>& c, int64_t tile, int D) {
  const char* nk = c.bytes(0, tile);
  const char* nv = c.bytes(1, tile);
  for (size_t off = 0; off < size_t(c.block_size) * D * c.elem_bytes(); off += 64) {
    __builtin_prefetch(nk + off);
    __builtin_prefetch(nv + off);
  }
}

/// Per-thread scratch, sized for up to `rows` query rows (rounded up to 16 for the row-tiled
/// prefill path, whose transposed query qt, probabilities pt and fp32 K chunk kf live here too).
struct Workspace {
  std::vector<float> q, acc, m, l, corr, s, vf, qt, pt, kf, acct;
  std::vector<float> conv;  // FP8 caches only: one decoded K and one V tile (float, or bf16 in the first half)
  std::vector<bf16> qb;
  std::vector<int32_t> pos;
  Workspace(int rows, int head_size, int block_size, bool fp8 = false) {
    const size_t r16 = (size_t(rows) + 15) / 16 * 16, d = head_size;
    q.resize(r16 * d);
    acc.resize(r16 * d);
    m.resize(r16);
    l.resize(r16);
    corr.resize(r16);
    s.resize(r16 * block_size);
    vf.resize(size_t(block_size) * d);
    qb.resize(r16 * d);
    pos.resize(r16);
    if (fp8) conv.resize(2 * size_t(block_size) * d);
    if (rows >= 16) {
      qt.resize(r16 * d);
      pt.resize(16 * 16);
      kf.resize(16 * d);
      acct.resize(r16 * d);
    }
  }
};

/// Rows [r0, r1) of the K (kv = 0) or V (kv = 1) tile at element offset `tile`, as T: the cache's
/// own memory, or for an FP8 cache those rows decoded into w.conv (exact). Returns the tile's row 0.
template <typename T, int D>
inline const T* tile_rows(const Context<T>& c, int kv, int64_t tile, int r0, int r1, Workspace& w) {
  if (c.fp8 == 0) return (kv ? c.value_cache : c.key_cache) + tile;
  T* dst = reinterpret_cast<T*>(w.conv.data()) + size_t(kv) * c.block_size * D;
  const uint8_t* src = (kv ? c.value8 : c.key8) + tile;
  if (c.fp8 == 1)
    fp8::decode_row<fp8::Kind::kE4M3>(src + size_t(r0) * D, dst + size_t(r0) * D, int64_t(r1 - r0) * D);
  else
    fp8::decode_row<fp8::Kind::kE5M2>(src + size_t(r0) * D, dst + size_t(r0) * D, int64_t(r1 - r0) * D);
  return dst;
}

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
    // Blocks are scattered, so the hardware prefetcher cannot run ahead across tiles: fetch the
    // (block, kv head) K and V tiles kPrefetchTiles ahead while this one is computed (the first
    // iteration also fetches the ones in between).
    for (int64_t ahead = (blk * bs == (lo / bs) * bs) ? 1 : kPrefetchTiles; ahead <= kPrefetchTiles; ++ahead) {
      if ((blk + ahead) * bs >= hi) break;
      prefetch_tile(c, (static_cast<int64_t>(table[blk + ahead]) * c.num_kv_heads + kvh) * bs * D, D);
    }
    // the 16-token chunks that [t0, t1) touches (an FP8 tile is decoded only there)
    const int r0 = t0 - t0 % 16, r1 = std::min(bs, (t1 + 15) / 16 * 16);
    const T* kt = tile_rows<T, D>(c, 0, tile, r0, r1, w);
    // Scores S = Q K^T for this block, 16 tokens at a time (bs is a multiple of 16); a chunk's
    // K rows stay in L1 for all R rows. Rows outside [t0, t1) are computed but never used.
    for (int c16 = t0 - t0 % 16; c16 < t1; c16 += 16)
      for (int r = 0; r < R; ++r)
        qk_chunk16<T, D>(q + r * D, qb + r * D, scale, kt + c16 * D, s + r * bs + c16);
    for (int r = 0; r < R; ++r) {
      float* sr = s + r * bs;
      const int64_t p = pos[r];
      float m_new, corr, sum;
#if defined(__AVX512F__)
      // Vectorized over 16-token chunks: lanes outside [t0, t1), after the row's position or
      // before its window are masked to probability 0.
      {
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 ninf = _mm512_set1_ps(kNegInf);
        __mmask16 valid[4];  // bs <= 64
        __m512 mxv = ninf;
        const int nc = (t1 + 15) / 16;
        for (int ci = (t0 / 16); ci < nc; ++ci) {
          const __m512i t = _mm512_add_epi32(lane, _mm512_set1_epi32(ci * 16));
          __mmask16 v = _mm512_cmp_epi32_mask(t, _mm512_set1_epi32(t0), _MM_CMPINT_NLT) &
                        _mm512_cmp_epi32_mask(t, _mm512_set1_epi32(t1), _MM_CMPINT_LT);
          // j = base + t <= p  <=>  t <= p - base (and j > p - window <=> t > p - window - base)
          v &= _mm512_cmp_epi32_mask(
              t, _mm512_set1_epi32(static_cast<int32_t>(std::min<int64_t>(p - base, 1 << 20))),
              _MM_CMPINT_LE);
          if (window > 0)
            v &= _mm512_cmp_epi32_mask(
                t, _mm512_set1_epi32(static_cast<int32_t>(std::max<int64_t>(-1, p - window - base))),
                _MM_CMPINT_NLE);
          valid[ci] = v;
          __m512 x = _mm512_loadu_ps(sr + ci * 16);
          if (cap > 0.0f)
            x = _mm512_mul_ps(_mm512_set1_ps(cap), tanh512(_mm512_mul_ps(x, _mm512_set1_ps(1.0f / cap))));
          x = _mm512_mask_mov_ps(ninf, v, x);
          _mm512_storeu_ps(sr + ci * 16, x);
          mxv = _mm512_max_ps(mxv, x);
        }
        const float mx = _mm512_reduce_max_ps(mxv);
        if (mx == kNegInf) {  // nothing visible to this row in this block: p = 0, corr = 1 leaves
          std::fill(sr + t0, sr + t1, 0.0f);  // acc unchanged (V in [t0, t1) is owned, finite)
          w.corr[r] = 1.0f;
          continue;
        }
        m_new = std::max(m[r], mx);
        corr = exp_neg(m[r] - m_new);  // m[r] = -inf -> ~0, and acc, l are 0 then
        __m512 sv = _mm512_setzero_ps();
        const __m512 mn = _mm512_set1_ps(m_new);
        for (int ci = (t0 / 16); ci < nc; ++ci) {
          const __m512 e = _mm512_maskz_mov_ps(
              valid[ci], exp512_neg(_mm512_sub_ps(_mm512_loadu_ps(sr + ci * 16), mn)));
          _mm512_storeu_ps(sr + ci * 16, e);
          sv = _mm512_add_ps(sv, e);
        }
        sum = _mm512_reduce_add_ps(sv);
      }
#else
      if (cap > 0.0f) {
        const float inv = 1.0f / cap;
#pragma omp simd
        for (int t = t0; t < t1; ++t) sr[t] = cap * tanh_vec(sr[t] * inv);
      }
      // Causal and sliding-window mask, only where the block crosses a boundary of this row.
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
      if (mx == kNegInf) {  // nothing visible to this row in this block: p = 0, acc unchanged
        std::fill(sr + t0, sr + t1, 0.0f);
        w.corr[r] = 1.0f;
        continue;
      }
      m_new = std::max(m[r], mx);
      corr = exp_neg(m[r] - m_new);  // m[r] = -inf -> ~0, and acc, l are 0 then
      sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int t = t0; t < t1; ++t) {
        const float e = exp_neg(sr[t] - m_new);
        const float pr = sr[t] == kNegInf ? 0.0f : e;
        sr[t] = pr;
        sum += pr;
      }
#endif
      m[r] = m_new;
      l[r] = l[r] * corr + sum;
      w.corr[r] = corr;
    }
    pv_rows<T, D>(acc, w.corr.data(), s, bs, tile_rows<T, D>(c, 1, tile, t0, t1, w), t0, t1, R);
  }
}

#if defined(__AVX512F__)
/// attend_blocks for many rows (prefill tiles), transposed: query rows sit in the 16 lanes of a
/// vector, so S^T[t][rows] = sum_d K[t][d] * Q^T[d][rows] needs no horizontal reduction
/// (broadcast K element times a column of Q^T; a bf16 chunk is widened to fp32 once), and the online
/// softmax (max, exp, sum, mask) runs vertically over 16 rows at once. PV too, on a transposed accumulator
/// acc^T [D][16 rows] written back to w.acc at the end.
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
  std::fill_n(w.acct.begin(), size_t(NG) * D * 16, 0.0f);  // acc^T: [NG][D][16 rows]
  const float cap = c.soft_cap;
  const int32_t window = c.sliding_window;
  for (int64_t blk = lo / bs; blk * bs < hi; ++blk) {
    const int64_t base = blk * bs;
    const int t0 = static_cast<int>(std::max<int64_t>(lo, base) - base);
    const int t1 = static_cast<int>(std::min<int64_t>(hi, base + bs) - base);
    const int64_t tile = (static_cast<int64_t>(table[blk]) * c.num_kv_heads + kvh) * bs * D;
    if ((blk + 1) * bs < hi)
      prefetch_tile(c, (static_cast<int64_t>(table[blk + 1]) * c.num_kv_heads + kvh) * bs * D, D);
    const float* vp;  // V rows [t0, t1) in fp32
    if (c.fp8 == 1) {
      fp8::decode_row<fp8::Kind::kE4M3>(c.value8 + tile + t0 * D, w.vf.data() + t0 * D, int64_t(t1 - t0) * D);
      vp = w.vf.data();
    } else if (c.fp8 == 2) {
      fp8::decode_row<fp8::Kind::kE5M2>(c.value8 + tile + t0 * D, w.vf.data() + t0 * D, int64_t(t1 - t0) * D);
      vp = w.vf.data();
    } else if constexpr (std::is_same_v<T, float>) {
      vp = c.value_cache + tile;
    } else {
      to_float_row(c.value_cache + tile + t0 * D, w.vf.data() + t0 * D, (t1 - t0) * D);
      vp = w.vf.data();
    }
    for (int c16 = t0 - t0 % 16; c16 < t1; c16 += 16) {
      const int u0 = std::max(t0, c16) - c16, u1 = std::min(t1, c16 + 16) - c16;
      const float* kf16;  // the chunk's 16 K rows in fp32 (converted once for all row groups)
      if (c.fp8 == 1) {
        fp8::decode_row<fp8::Kind::kE4M3>(c.key8 + tile + size_t(c16) * D, w.kf.data(), 16 * D);
        kf16 = w.kf.data();
      } else if (c.fp8 == 2) {
        fp8::decode_row<fp8::Kind::kE5M2>(c.key8 + tile + size_t(c16) * D, w.kf.data(), 16 * D);
        kf16 = w.kf.data();
      } else if constexpr (std::is_same_v<T, float>) {
        kf16 = c.key_cache + tile + size_t(c16) * D;
      } else {
        to_float_row(c.key_cache + tile + size_t(c16) * D, w.kf.data(), 16 * D);
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
        // PV with the rows in the lanes too: acc^T[d][rows] = acc^T * corr + sum_t P^T[t][rows] *
        // V[t][d]; 16 independent accumulators per pass keep both FMA ports busy (one row at a
        // time was latency-bound). A lane that sees nothing has p = 0 and corr = 1 (or acc = 0).
        float* at = w.acct.data() + size_t(g) * D * 16;
        const float* vc = vp + size_t(c16) * D;
        for (int d0 = 0; d0 < D; d0 += 16) {
          __m512 a[16];
          for (int j = 0; j < 16; ++j) a[j] = _mm512_mul_ps(_mm512_loadu_ps(at + (d0 + j) * 16), corr);
          for (int t = u0; t < u1; ++t) {
            const __m512 pv = _mm512_loadu_ps(w.pt.data() + t * 16);
            const float* vt = vc + size_t(t) * D + d0;
            for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(pv, _mm512_set1_ps(vt[j]), a[j]);
          }
          for (int j = 0; j < 16; ++j) _mm512_storeu_ps(at + (d0 + j) * 16, a[j]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)  // acc^T back to the rows' [R][D] layout
    for (int d = 0; d < D; ++d) w.acc[size_t(r) * D + d] = w.acct[(size_t(r / 16) * D + d) * 16 + r % 16];
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

/// out row = acc * v_scale / l (a zero row when the row saw no token, l == 0); v_scale: an FP8
/// cache's value scale, 1 otherwise.
template <typename T, int D>
inline void store_row(const float* acc, float l, T* dst, float v_scale = 1.0f) {
  const float inv = l > 0.0f ? v_scale / l : 0.0f;
#pragma omp simd
  for (int d = 0; d < D; ++d) dst[d] = from_float<T>(acc[d] * inv);
}

inline void reset_rows(Workspace& w, int R, int D) {
  std::fill_n(w.m.begin(), R, kNegInf);
  std::fill_n(w.l.begin(), R, 0.0f);
  std::fill_n(w.acc.begin(), size_t(R) * D, 0.0f);
}

}  // namespace pagedllm::cpu::tiles
