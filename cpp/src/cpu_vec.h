// cpu_vec.h — internal: small numeric helpers for the CPU kernels, written so that GCC
// vectorizes them (-march=native; `#pragma omp simd` under -fopenmp) without -ffast-math:
// bfloat16 <-> float32 conversion, a vectorizable exp, dot products.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

namespace pagedllm::cpu {

/// bfloat16 storage: the high 16 bits of an IEEE float32.
struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.bits) << 16); }

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
/// Round to nearest even (NaN stays a quiet NaN), as torch's float -> bfloat16 conversion.
template <>
inline bf16 from_float<bf16>(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(rounded >> 16)};
}

/// dst[i] = float(src[i]) for i < n.
template <typename T>
inline void to_float_row(const T* __restrict src, float* __restrict dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

/// exp(x) for x in [-87.3, 88.7] (callers clamp), relative error ~2e-7: Cody-Waite reduction
/// x = n*ln2 + r, |r| <= ln2/2, degree-7 Taylor polynomial of e^r, then scaling by 2^n through
/// the exponent bits, in two halves so that n = 128 does not overflow the exponent field (each
/// half is a power of two, so the scaling is exact). Branch-free, so loops over it vectorize.
inline float exp_reduced(float x) {
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t n_int = static_cast<int32_t>(n);
  const int32_t h = n_int >> 1;
  const float s1 = std::bit_cast<float>((h + 127) << 23);
  const float s2 = std::bit_cast<float>((n_int - h + 127) << 23);
  return p * s1 * s2;
}

/// exp(x) for x <= 0 (softmax arguments), relative error ~2e-7; x < -87 gives ~0 (never NaN).
inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 0.0f ? 0.0f : x;
  return exp_reduced(x);
}

/// tanh(x) = 1 - 2 / (exp(2x) + 1), for the logit soft-cap; exact enough (~1e-7) for fp32.
inline float tanh_vec(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float e = exp_neg(-2.0f * ax);  // in (0, 1]
  const float t = (1.0f - e) / (1.0f + e);
  return x < 0.0f ? -t : t;
}

template <int D>
inline float dot(const float* __restrict a, const float* __restrict b) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

/// f.template operator()<R>() for a runtime row count rows = R in 1..8 (more than 8: R = 8): the
/// register-blocked kernels' tails, each a compile-time row count.
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    default: f.template operator()<8>(); break;
  }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/// acc + VPDPBUSD(u, s): per int32 lane, the four products of unsigned bytes of u and signed bytes of
/// s, summed exactly. In asm because with _mm512_dpbusd_epi32 GCC 12 copies each accumulator to a
/// fresh register and back around every VPDPBUSD, and with 16 accumulators live spills some to the
/// stack: a store-to-load chain per iteration (the VNNI kernels ran ~30% slower at 8 rows x 32 outputs).
inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

/// dpbusd(acc, u, the 4 bytes at s broadcast to every lane), the broadcast folded into the
/// instruction's memory operand (one instruction instead of a VPBROADCASTD and a VPDPBUSD).
inline __m512i dpbusd_bcast(__m512i acc, __m512i u, const void* s) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*static_cast<const int32_t*>(s)));
  return acc;
}
#endif

}  // namespace pagedllm::cpu
