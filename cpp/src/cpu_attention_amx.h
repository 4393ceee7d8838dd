// cpp/src/cpu_attention_amx.h — attend_blocks on Intel AMX tiles (bf16 caches, head size 64 or
// 128, up to 64 query rows per call in groups of 16). Used by cpu_attention.cpp for decode and
// prefill when amx_available() (cpu_amx.h) and PAGEDLLM_CPU_ATTENTION_AMX is not 0.
//
// The context [lo, hi) is taken in segments of kAmxSegment tokens, each in four passes:
//  1. scores: S^T[token][row] = K[token] . q[row] by TDPBF16PS, one 16 x 16 float32 tile per
//     16-token chunk and 16-row group: A = the chunk's K rows straight from the cache (16 rows x
//     32 d, row stride D), B = the group's Q^T in VNNI order (built once per call), so K is never
//     converted or transposed;
//  2. softmax per row on float32 vectors (a row's column of S^T gathered 16 tokens at a time):
//     scale, soft cap, causal / window / range mask, the segment maximum, P = exp(s - m) rounded to
//     bfloat16 and stored as the A operand P[row][token]; l sums the rounded P, so that
//     out = sum P V / sum P uses the same weights;
//  3. V in VNNI order (pairs of token rows interleaved, two VPERMT2W per 32 columns), once per
//     segment for all groups; tokens outside [lo, hi) as zero rows (the cache may hold NaN in
//     slots no sequence owns);
//  4. P V by TDPBF16PS into 16 x 16 float32 tiles, per group, 64 output columns at a time.
// A group skips the chunks after its last row's position (a prefill item's causal triangle). The
// segment's result merges into the caller's online-softmax state (m, l, acc) exactly as
// attend_blocks does per block (FlashAttention-2, Dao 2023). Against attend_blocks the only
// extra rounding is P in bfloat16 (as the CUDA kernels' mma.sync P operand).
#pragma once

#include <cstdlib>
#include <cstring>
#include <memory>

#include "cpu_amx.h"

namespace pagedllm::cpu::tiles {

/// The CPU attention kernels take the AMX path for bfloat16 caches of head size 64 or 128 when
/// amx_available() and PAGEDLLM_CPU_ATTENTION_AMX is not "0" (read once; "0" keeps the AVX-512
/// path, for benchmarking and testing both).
inline bool amx_attention_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("PAGEDLLM_CPU_ATTENTION_AMX");
    return amx_available() && !(v != nullptr && std::strcmp(v, "0") == 0);
  }();
  return on;
}

}  // namespace pagedllm::cpu::tiles

#if PAGEDLLM_HAVE_AMX
#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>

#include "cpu_attention_tiles.h"

namespace pagedllm::cpu::tiles {

constexpr int kAmxSegment = 256;               // tokens per segment (a multiple of 32)
constexpr int kAmxGroups = 4;                   // 16-row groups per call
constexpr int kAmxMaxRows = 16 * kAmxGroups;  // query rows per call

/// Per-thread scratch of attend_blocks_amx (~270 KB; allocate with new: 64-byte aligned).
struct alignas(64) AmxScratch {
  float st[kAmxGroups][kAmxSegment * 16];        // S^T per row group [token][16 rows]
  float x[kAmxMaxRows * kAmxSegment];            // masked, scaled scores [row][token]
  bf16 p[kAmxMaxRows * kAmxSegment];             // P [row][token], rows >= R zero (A operand)
  uint32_t bq[kAmxGroups][4 * 256];              // Q^T per row group, D / 32 VNNI tiles [d pair][row]
  uint32_t bv[kAmxSegment / 32][8 * 256];        // V per 32-token group, D / 16 VNNI tiles [token pair][16 columns]
  float o[kAmxMaxRows * 128];                    // the segment's P V [row][D]
  float corr[kAmxMaxRows];                       // per row: exp(m_old - m_new)
  // Rows >= bq_rows of every bq group and rows >= p_rows of p are zero (the operands' padding
  // rows); a call clears only what an earlier call with more rows left behind (everything, first).
  int bq_rows = kAmxMaxRows;
  int p_rows = kAmxMaxRows;
};

/// VPERMT2W index vectors for V's VNNI pairs: [0] takes a[k], b[k] for k < 16 (b = indices 32..63),
/// [1] takes a[16 + k], b[16 + k].
inline constexpr std::array<std::array<int16_t, 32>, 2> kInterleave = [] {
  std::array<std::array<int16_t, 32>, 2> t{};
  for (int k = 0; k < 16; ++k) {
    t[0][2 * k] = static_cast<int16_t>(k);
    t[0][2 * k + 1] = static_cast<int16_t>(32 + k);
    t[1][2 * k] = static_cast<int16_t>(16 + k);
    t[1][2 * k + 1] = static_cast<int16_t>(48 + k);
  }
  return t;
}();

/// One thread's AMX state for a parallel region: the tile configuration, loaded on construction
/// and released (TILERELEASE) on destruction, and the thread's scratch (allocated on the thread's
/// first use, kept for the thread's lifetime); inert when `on` is false.
struct AmxThread {
  AmxScratch* scratch = nullptr;
  explicit AmxThread(bool on) {
    if (!on) return;
    thread_local std::unique_ptr<AmxScratch> mine;
    if (!mine) mine.reset(new AmxScratch);
    scratch = mine.get();
    load_amx_tile_config();
  }
  ~AmxThread() {
    if (scratch != nullptr) _tile_release();
  }
  AmxThread(const AmxThread&) = delete;
  AmxThread& operator=(const AmxThread&) = delete;
};

/// attend_blocks (cpu_attention_tiles.h) for a bfloat16 cache on AMX: R <= kAmxMaxRows query rows
/// in groups of 16 (a group's A / C tiles), qb their unscaled bf16 values [R][D], pos their
/// positions; updates m, l ([R]) and acc ([R][D]). The segment's K tiles and V's VNNI tiles serve
/// every group; a group skips the chunks after its last row's position (the causal triangle of a
/// prefill item). prefetch_heads: the K / V rows of heads kvh + 1 .. kvh + prefetch_heads - 1 are
/// prefetched into L2 along with kvh's own (a caller that walks those heads next finds them
/// there). The calling thread must have loaded the tile configuration (AmxThread).
template <int D>
void attend_blocks_amx(const Context<bf16>& c, const int32_t* table, int64_t kvh, int64_t lo, int64_t hi, int R,
                       float scale, const bf16* qb, const int32_t* pos, float* m, float* l, float* acc,
                       AmxScratch& sc, int prefetch_heads = 1) {
  static_assert(D == 64 || D == 128, "AMX attention takes head sizes 64 and 128");
  constexpr int KC = D / 32;  // 32-column A / B tiles per score tile
  const int bs = c.block_size;
  const float cap = c.soft_cap;
  const int32_t window = c.sliding_window;
  const int NG = (R + 15) / 16;
  // Q^T in VNNI order per group: bq[g][kc][i][n] = (q[16 g + n][32 kc + 2 i], ...[32 kc + 2 i + 1]),
  // zero for rows >= R; gmax[g]: the group's last visible position.
  int64_t gmax[kAmxGroups];
  for (int g = 0; g < NG; ++g) gmax[g] = -1;
  if (sc.bq_rows > R) {  // zero the padding lanes (whole groups: rows < R are rewritten below)
    for (int g = R / 16; g < (sc.bq_rows + 15) / 16; ++g) std::memset(sc.bq[g], 0, sizeof(sc.bq[g]));
  }
  sc.bq_rows = R;
  for (int n = 0; n < R; ++n) {
    uint32_t row[D / 2];
    std::memcpy(row, qb + n * D, sizeof(row));
    for (int i = 0; i < D / 2; ++i) sc.bq[n / 16][i * 16 + n % 16] = row[i];  // (kc, i) = (i / 16, i % 16)
    gmax[n / 16] = std::max<int64_t>(gmax[n / 16], std::min<int64_t>(hi - 1, pos[n]));
  }
  // P rows >= R stay zero; rows < R are rewritten for every 32-token group a segment uses.
  if (sc.p_rows > R) std::memset(sc.p + R * kAmxSegment, 0, sizeof(bf16) * (sc.p_rows - R) * kAmxSegment);
  sc.p_rows = R;
  const int64_t kv_stride = static_cast<int64_t>(c.num_kv_heads) * bs * D;  // elements per block
  const int bs_shift = std::countr_zero(static_cast<unsigned>(bs));          // bs is a power of two
  auto kv_row = [&](int64_t token) {  // offset of `token`'s row of KV head kvh
    return static_cast<int64_t>(table[token >> bs_shift]) * kv_stride + (kvh * bs + (token & (bs - 1))) * D;
  };
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i column = _mm512_slli_epi32(lane, 4);  // S^T's column stride: 16 floats
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  // VPERMT2W indices interleaving a[0..15] with b[0..15] (lo) and a[16..31] with b[16..31] (hi).
  const __m512i idx_lo = _mm512_loadu_si512(kInterleave[0].data()), idx_hi = _mm512_loadu_si512(kInterleave[1].data());

  for (int64_t s0 = lo & ~int64_t{15}; s0 < hi; s0 += kAmxSegment) {
    const int64_t s1 = std::min<int64_t>(hi, s0 + kAmxSegment);
    const int nch = static_cast<int>((s1 - s0 + 15) / 16);  // 16-token chunks, each inside one block
    // Chunks and 32-token groups of this segment that group g needs (0 when it sees none).
    auto chunks_of = [&](int g) {
      return gmax[g] < s0 ? 0 : std::min<int>(nch, static_cast<int>((gmax[g] - s0) / 16) + 1);
    };
    // ---- 1. S^T, one tile per chunk and row group, two chunks at a time (tmm0 / tmm1: independent
    // chains, so one chunk's TDPBF16PS overlaps the other's). Prefetched meanwhile: the K of the
    // pair after next (the segment's first two pairs up front) and this pair's V, for pass 3.
    auto prefetch_chunk = [&](const bf16* cache, int ch) {
      if (ch >= nch) return;
      const char* a = reinterpret_cast<const char*>(cache + kv_row(s0 + 16 * ch));
      for (int off = 0; off < 16 * D * 2; off += 64) _mm_prefetch(a + off, _MM_HINT_T0);
      for (int h = 1; h < prefetch_heads; ++h)  // the heads walked later: to L2, not to L1
        for (int off = 0; off < 16 * D * 2; off += 64) _mm_prefetch(a + h * int64_t{bs} * D * 2 + off, _MM_HINT_T1);
    };
    for (int ch = 0; ch < 4; ++ch) prefetch_chunk(c.key_cache, ch);
    for (int ch = 0; ch < nch; ch += 2) {
      prefetch_chunk(c.key_cache, ch + 4);
      prefetch_chunk(c.key_cache, ch + 5);
      prefetch_chunk(c.value_cache, ch);
      prefetch_chunk(c.value_cache, ch + 1);
      const bf16* ka = c.key_cache + kv_row(s0 + 16 * ch);
      const bool two = ch + 1 < nch;
      const bf16* kb = two ? c.key_cache + kv_row(s0 + 16 * ch + 16) : ka;
      for (int g = 0; g < NG; ++g) {
        if (ch >= chunks_of(g)) continue;  // after every row of the group: masked in pass 2
        _tile_zero(0);
        _tile_zero(1);
        for (int kc = 0; kc < KC; ++kc) {
          _tile_loadd(4, sc.bq[g] + kc * 256, 64);
          _tile_loadd(2, ka + 32 * kc, D * 2);
          _tile_loadd(3, kb + 32 * kc, D * 2);
          _tile_dpbf16ps(0, 2, 4);
          _tile_dpbf16ps(1, 3, 4);
        }
        _tile_stored(0, sc.st[g] + ch * 256, 64);
        if (two) _tile_stored(1, sc.st[g] + (ch + 1) * 256, 64);
      }
    }
    // ---- 2. softmax per row over its group's chunks; P in bf16 (zero up to the group's last
    // 32-token group)
    for (int r = 0; r < R; ++r) {
      const int g = r / 16;
      const int nch_g = chunks_of(g);
      const int ngr_g = (nch_g + 1) / 2;
      const int64_t p = pos[r];
      const __m512i hi_v = _mm512_set1_epi32(static_cast<int32_t>(std::min<int64_t>(hi - 1, p)));
      const __m512i lo_v = _mm512_set1_epi32(static_cast<int32_t>(
          window > 0 ? std::max<int64_t>(lo, p - window + 1) : lo));
      float* xr = sc.x + r * kAmxSegment;
      bf16* pr = sc.p + r * kAmxSegment;
      __m512 mx = ninf;
      for (int ch = 0; ch < nch_g; ++ch) {
        const __m512i j = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(s0 + 16 * ch)));
        const __mmask16 valid = _mm512_cmp_epi32_mask(j, lo_v, _MM_CMPINT_NLT) &
                                _mm512_cmp_epi32_mask(j, hi_v, _MM_CMPINT_LE);
        __m512 x = _mm512_mul_ps(_mm512_i32gather_ps(column, sc.st[g] + ch * 256 + r % 16, 4),
                                 _mm512_set1_ps(scale));
        if (cap > 0.0f)
          x = _mm512_mul_ps(_mm512_set1_ps(cap), tanh512(_mm512_mul_ps(x, _mm512_set1_ps(1.0f / cap))));
        x = _mm512_mask_mov_ps(ninf, valid, x);
        _mm512_store_ps(xr + 16 * ch, x);
        mx = _mm512_max_ps(mx, x);
      }
      const float seg_max = _mm512_reduce_max_ps(mx);
      if (seg_max == kNegInf) {  // nothing visible in this segment: P = 0, state unchanged
        std::memset(pr, 0, sizeof(bf16) * 32 * ngr_g);
        sc.corr[r] = 1.0f;
        continue;
      }
      const float m_new = std::max(m[r], seg_max);
      const __m512 mn = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int ch = 0; ch < nch_g; ++ch) {
        const __m512 x = _mm512_load_ps(xr + 16 * ch);
        const __mmask16 seen = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
        const __m256i pb = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(seen, exp512_neg(_mm512_sub_ps(x, mn))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16 * ch), pb);
        sum = _mm512_add_ps(sum, widen16(pb));
      }
      if (nch_g % 2) std::memset(pr + 16 * nch_g, 0, sizeof(bf16) * 16);
      const float corr = exp_neg(m[r] - m_new);  // m[r] = -inf -> ~0, and acc, l are 0 then
      m[r] = m_new;
      l[r] = l[r] * corr + _mm512_reduce_add_ps(sum);
      sc.corr[r] = corr;
    }
    // ---- 3. V in VNNI order, once per segment for every group: B tile dc of 32-token group tg
    // holds columns 16 dc .. 16 dc + 15 as rows of token pairs; tokens outside [lo, hi) are zero.
    int ngr_all = 0;
    for (int g = 0; g < NG; ++g) ngr_all = std::max(ngr_all, (chunks_of(g) + 1) / 2);
    for (int tg = 0; tg < ngr_all; ++tg) {
      uint32_t* bvg = sc.bv[tg];
      for (int hc = 0; hc < 2; ++hc) {  // the group's two 16-token chunks, each inside one block
        const int64_t tc = s0 + 32 * tg + 16 * hc;
        const bool in = tc < hi;
        const bf16* vc = in ? c.value_cache + kv_row(tc) : nullptr;
        for (int jq = 0; jq < 8; ++jq) {  // token pair (t, t + 1) -> VNNI row jp
          const int jp = 8 * hc + jq;
          const int64_t t = tc + 2 * jq;
          const bool ua = in && t >= lo && t < hi, ub = in && t + 1 >= lo && t + 1 < hi;
          for (int sl = 0; sl < D / 32; ++sl) {
            const __m512i a = ua ? _mm512_loadu_si512(vc + 2 * jq * D + 32 * sl) : _mm512_setzero_si512();
            const __m512i b = ub ? _mm512_loadu_si512(vc + (2 * jq + 1) * D + 32 * sl) : _mm512_setzero_si512();
            _mm512_store_si512(bvg + (2 * sl) * 256 + jp * 16, _mm512_permutex2var_epi16(a, idx_lo, b));
            _mm512_store_si512(bvg + (2 * sl + 1) * 256 + jp * 16, _mm512_permutex2var_epi16(a, idx_hi, b));
          }
        }
      }
    }
    // ---- 4. O = P V per row group, 64 columns at a time (tiles 0-3), 32 tokens per step
    for (int g = 0; g < NG; ++g) {
      const int ngr_g = (chunks_of(g) + 1) / 2;
      const bf16* pg = sc.p + 16 * g * kAmxSegment;
      float* og = sc.o + 16 * g * D;
      for (int h = 0; h < D / 64; ++h) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int tg = 0; tg < ngr_g; ++tg) {
          const uint32_t* bvh = sc.bv[tg] + 4 * h * 256;
          _tile_loadd(4, pg + 32 * tg, kAmxSegment * 2);
          _tile_loadd(5, bvh, 64);
          _tile_loadd(6, bvh + 256, 64);
          _tile_loadd(7, bvh + 512, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_dpbf16ps(1, 4, 6);
          _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, bvh + 768, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, og + 64 * h, D * 4);
        _tile_stored(1, og + 64 * h + 16, D * 4);
        _tile_stored(2, og + 64 * h + 32, D * 4);
        _tile_stored(3, og + 64 * h + 48, D * 4);
      }
    }
    // ---- merge: acc = acc * corr + O
    for (int r = 0; r < R; ++r) {
      const __m512 cr = _mm512_set1_ps(sc.corr[r]);
      for (int d = 0; d < D; d += 16)
        _mm512_storeu_ps(acc + r * D + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + r * D + d), cr,
                                                          _mm512_load_ps(sc.o + r * D + d)));
    }
  }
}

}  // namespace pagedllm::cpu::tiles
#endif  // PAGEDLLM_HAVE_AMX
