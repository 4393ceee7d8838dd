// cpu_qk_pv.h — internal: the two inner products of the CPU attention kernels, on one chunk of
// a (block, kv head) K/V tile:
//   qk_chunk16: s[t] = q . k_t for the 16 tokens of a chunk (one query row),
//   pv_rows:    acc[r] = acc[r] * corr[r] + sum_t p[r][t] * v_t over tokens [t0, t1), for the R
//               query rows of a work item at once, over the cache's own V rows.
// AVX-512 versions (the build uses -march=native): QK accumulates 16 tokens in 16 registers and
// reduces them with one 16x16 transpose-add tree (45 shuffles/adds for 16 dot products instead of
// 16 horizontal reductions); bfloat16 K uses VDPBF16PS (exact bf16 products, fp32 sums) on the
// unscaled bf16 query. PV keeps the row's accumulator in registers. Portable loops otherwise.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu_vec.h"

#if defined(__AVX512F__)
// GCC 12 warns "__Y may be used uninitialized" inside its own unpack intrinsics (their unused
// pass-through operand is _mm512_undefined_ps()): a known false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#endif

namespace pagedllm::cpu {

#if defined(__AVX512F__)

/// lane i of the result = sum of the 16 lanes of v[i].
inline __m512 reduce16(const __m512 v[16]) {
  __m512 c[8];
  for (int i = 0; i < 8; ++i)
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 d[4];
  for (int i = 0; i < 4; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Each 128-bit lane L of d[i] now holds, for vectors 4i..4i+3, the partial sums of lane L.
  const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_f32x4(d[2], d[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(d[2], d[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e, f, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e, f, _MM_SHUFFLE(3, 1, 3, 1)));
}

/// 16-lane exp_neg (cpu_vec.h): exp(x) for x <= 0, ~2e-7 relative, x < -87 gives ~0.
inline __m512 exp512_neg(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_setzero_ps());
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/// 16-lane tanh = sign(x) (1 - e) / (1 + e), e = exp(-2|x|).
inline __m512 tanh512(__m512 x) {
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  const __m512i xi = _mm512_castps_si512(x);
  const __m512 ax = _mm512_castsi512_ps(_mm512_andnot_si512(sign_bit, xi));
  const __m512 e = exp512_neg(_mm512_mul_ps(ax, _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(sign_bit, xi)));
}

/// 16 bfloat16 values (the bits in h) widened to float32 (exact).
inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) { return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

#endif

/// s[t] = q . k[t*D .. t*D+D) for t in [0, 16). q: fp32 [D] (scaled) and, for bf16 K, qb: the
/// same row in bfloat16 UNSCALED with `scale` applied to the sums. k: 16 rows of D elements.
template <typename T, int D>
inline void qk_chunk16(const float* __restrict q, const bf16* __restrict qb, float scale,
                       const T* __restrict k, float* __restrict s) {
#if defined(__AVX512F__)
  static_assert(D % 16 == 0, "head sizes are multiples of 16");
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    // 32 bf16 per VDPBF16PS; a 16-element tail (D = 80, 96) uses a zero-masked load.
    for (int c = 0; c < D; c += 32) {
      const __mmask32 m = (D - c >= 32) ? 0xffffffffu : 0x0000ffffu;
      const __m512bh qc = (__m512bh)_mm512_maskz_loadu_epi16(m, qb + c);
      for (int t = 0; t < 16; ++t)
        acc[t] = _mm512_dpbf16_ps(acc[t], qc, (__m512bh)_mm512_maskz_loadu_epi16(m, k + t * D + c));
    }
    _mm512_storeu_ps(s, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
    return;
  }
#endif
  (void)qb;
  (void)scale;
  for (int c = 0; c < D; c += 16) {
    const __m512 qc = _mm512_loadu_ps(q + c);
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(qc, load16(k + t * D + c), acc[t]);
  }
  _mm512_storeu_ps(s, reduce16(acc));
#else
  (void)qb;
  (void)scale;
  for (int t = 0; t < 16; ++t) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int d = 0; d < D; ++d) sum += q[d] * to_float(k[t * D + d]);
    s[t] = sum;
  }
#endif
}

#if defined(__AVX512F__)
/// pv_rows for RG (<= 4) consecutive rows and d-chunks of W vectors: each V vector is loaded (and
/// widened from bf16) once per token for all RG rows.
template <typename T, int D, int W, int RG>
inline void pv_group(float* __restrict acc, const float* __restrict corr, const float* __restrict p,
                     int p_stride, const T* __restrict v, int t0, int t1) {
  constexpr int NV = D / 16;
  for (int c0 = 0; c0 < NV; c0 += W) {
    __m512 a[RG][W];
    for (int r = 0; r < RG; ++r) {
      const __m512 cr = _mm512_set1_ps(corr[r]);
      for (int c = 0; c < W; ++c) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * (c0 + c)), cr);
    }
    for (int t = t0; t < t1; ++t) {
      __m512 vv[W];
      for (int c = 0; c < W; ++c) vv[c] = load16(v + t * D + 16 * (c0 + c));
      for (int r = 0; r < RG; ++r) {
        const __m512 pt = _mm512_set1_ps(p[r * p_stride + t]);
        for (int c = 0; c < W; ++c) a[r][c] = _mm512_fmadd_ps(pt, vv[c], a[r][c]);
      }
    }
    for (int r = 0; r < RG; ++r)
      for (int c = 0; c < W; ++c) _mm512_storeu_ps(acc + r * D + 16 * (c0 + c), a[r][c]);
  }
}
#endif

/// For each of R rows: acc[r][0..D) = acc[r] * corr[r] + sum_{t in [t0, t1)} p[r * p_stride + t] *
/// v[t*D ..], with v the tile's rows in the cache dtype (bf16 widened to fp32 exactly). With
/// AVX-512 rows go in groups of up to 4 that share each loaded V vector (the decode loop's GQA
/// group: one V read from L1 per token instead of one per row, and no fp32 copy of V); each row's
/// arithmetic is the per-row loop's (acc * corr, then one FMA per token in order). A row with
/// p = 0 and corr = 1 keeps its acc as long as V is finite in [t0, t1) (tokens the sequence owns).
template <typename T, int D>
inline void pv_rows(float* __restrict acc, const float* __restrict corr, const float* __restrict p,
                    int p_stride, const T* __restrict v, int t0, int t1, int R) {
#if defined(__AVX512F__)
  constexpr int NV = D / 16;
  constexpr int W = NV % 4 == 0 ? 4 : (NV % 5 == 0 ? 5 : (NV % 3 == 0 ? 3 : 1));
  int r = 0;
  for (; r + 4 <= R; r += 4) pv_group<T, D, W, 4>(acc + r * D, corr + r, p + r * p_stride, p_stride, v, t0, t1);
  switch (R - r) {
    case 3: pv_group<T, D, W, 3>(acc + r * D, corr + r, p + r * p_stride, p_stride, v, t0, t1); break;
    case 2: pv_group<T, D, W, 2>(acc + r * D, corr + r, p + r * p_stride, p_stride, v, t0, t1); break;
    case 1: pv_group<T, D, W, 1>(acc + r * D, corr + r, p + r * p_stride, p_stride, v, t0, t1); break;
    default: break;
  }
#else
  for (int r = 0; r < R; ++r) {
    float* a = acc + r * D;
    const float* pr = p + r * p_stride;
#pragma omp simd
    for (int d = 0; d < D; ++d) a[d] *= corr[r];
    for (int t = t0; t < t1; ++t) {
      const float pt = pr[t];
#pragma omp simd
      for (int d = 0; d < D; ++d) a[d] += pt * to_float(v[t * D + d]);
    }
  }
#endif
}

}  // namespace pagedllm::cpu

#if defined(__AVX512F__)
#pragma GCC diagnostic pop
#endif
