// cpu_fp8.h — internal: FP8 (OCP E4M3FN and E5M2) <-> float conversions of the CPU KV-cache
// kernels. Formats: "OCP 8-bit Floating Point Specification (OFP8)", 2023, as PyTorch's
// float8_e4m3fn (bias 7, 3 mantissa bits, no infinities, NaN = S.1111.111, max 448) and
// float8_e5m2 (bias 15, 2 mantissa bits, IEEE-like infinities and NaNs, max 57344).
//
//   encode: x -> code, round to nearest-even, saturated to +-max (infinities too); NaN -> NaN.
//           This is PyTorch's x.clamp(-max, max).to(float8_*) bit for bit, and CUDA's
//           __nv_cvt_float2_to_fp8x2(..., __NV_SATFINITE, ...).
//   decode: code -> exact float (every FP8 value is exact in float16, bfloat16 and float32).
//           Vectorized through float16: an E4M3 code's 7 low bits shifted into a float16's exponent
//           and mantissa give the value * 2^-8 (float16 subnormals cover E4M3's), an E5M2 code is
//           the top byte of its float16; VCVTPH2PS widens 16 of them at once.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu_vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedllm::cpu::fp8 {

/// The two formats (template tags), with their largest finite value.
enum class Kind : int { kE4M3 = 1, kE5M2 = 2 };

template <Kind K>
constexpr float kMax = K == Kind::kE4M3 ? 448.0f : 57344.0f;

/// float -> code (see the header comment).
template <Kind K>
inline uint8_t encode(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;  // NaN
  if constexpr (K == Kind::kE4M3) {
    if (a >= 0x43e00000u) return sign | 0x7eu;  // >= 448 (and inf): saturate
    if (a < 0x3c800000u) {                       // < 2^-6: subnormal codes, steps of 2^-9
      // exact scaling by 2^9, then round-half-even (the default rounding mode); 8 = 2^-6 is the
      // encoding of the smallest normal, so a carry is right too
      return sign | static_cast<uint8_t>(std::nearbyint(std::bit_cast<float>(a) * 512.0f));
    }
    const uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) & 0xfff00000u;  // 3 mantissa bits, RNE
    return sign | static_cast<uint8_t>((((r >> 23) - 120u) << 3) | ((r >> 20) & 7u));
  } else {
    if (a >= 0x47600000u) return sign | 0x7bu;  // >= 57344 (and inf): saturate
    if (a < 0x38800000u)                         // < 2^-14: subnormal codes, steps of 2^-16
      return sign | static_cast<uint8_t>(std::nearbyint(std::bit_cast<float>(a) * 65536.0f));
    const uint32_t r = (a + 0xfffffu + ((a >> 21) & 1u)) & 0xffe00000u;  // 2 mantissa bits, RNE
    return sign | static_cast<uint8_t>((((r >> 23) - 112u) << 2) | ((r >> 21) & 3u));
  }
}

/// code -> float, exact.
template <Kind K>
inline float decode(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t em = c & 0x7fu;
  float v;
  if constexpr (K == Kind::kE4M3) {
    if (em == 0x7fu) return std::numeric_limits<float>::quiet_NaN();
    v = em < 8 ? static_cast<float>(em) * (1.0f / 512.0f)
               : std::bit_cast<float>((((em >> 3) + 120u) << 23) | ((em & 7u) << 20));
  } else {
    if (em >= 0x7cu) return std::bit_cast<float>(sign | (em == 0x7cu ? 0x7f800000u : 0x7fc00000u));
    v = em < 4 ? static_cast<float>(em) * (1.0f / 65536.0f)
               : std::bit_cast<float>((((em >> 2) + 112u) << 23) | ((em & 3u) << 21));
  }
  return std::bit_cast<float>(std::bit_cast<uint32_t>(v) | sign);
}

#if defined(__AVX512F__)
/// 16 codes -> 16 floats (exact).
template <Kind K>
inline __m512 decode16(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if constexpr (K == Kind::kE4M3) {
    const __m512i h = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 8),
                                      _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), 7));
    const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)), _mm512_set1_ps(256.0f));
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), _mm512_set1_epi32(0x7f));
    return _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32(b, 8)));
  }
}
#endif

/// dst[0..n) = decode(src[0..n)) as float or bfloat16 (exact either way). n % 16 == 0 with AVX-512.
template <Kind K, typename T>
inline void decode_row(const uint8_t* __restrict src, T* __restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 v = decode16<K>(src + i);
    if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(dst + i, v);
    } else {  // exact in bfloat16: the top half of each float
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = from_float<T>(decode<K>(src[i]));
}

}  // namespace pagedllm::cpu::fp8
