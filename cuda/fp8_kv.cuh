// cuda/fp8_kv.cuh — internal: FP8 KV-cache element conversions shared by the CUDA cache writers
// (reshape_and_cache, the rotary + cache kernel, the GEMV's rope epilogue) and the attention
// kernels. The formats and rounding are pagedllm/attention.h's: a stored code is x / scale
// rounded to nearest-even and saturated to the largest finite value (cvt.rn.satfinite), read back
// exactly as float16 (cvt.rn.f16x2.e4m3x2 / .e5m2x2 on sm_89+; cuda_fp8.h emulates it elsewhere).
// Kind: 1 = float8_e4m3fn, 2 = float8_e5m2 (0 = not an FP8 cache).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "pagedllm/tensor_view.h"

namespace pagedllm::cuda::fp8 {

/// 1 (E4M3), 2 (E5M2) or 0 for a cache dtype.
inline int kind_of(DType dtype) {
  return dtype == DType::kFloat8E4M3FN ? 1 : dtype == DType::kFloat8E5M2 ? 2 : 0;
}

/// A KVCacheScales view's device pointer (nullptr: 1.0).
inline const float* scale_ptr(const TensorView& t) { return t.data == nullptr ? nullptr : t.ptr<const float>(); }

__device__ __forceinline__ float load_scale(const float* p) { return p == nullptr ? 1.f : __ldg(p); }

/// x / scale as a saturated code of `kind` (1 or 2); IEEE division whatever the compiler flags.
__device__ __forceinline__ uint8_t encode(float x, float scale, int kind) {
  const float v = __fdiv_rn(x, scale);
  return kind == 1 ? __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)
                   : __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
}

/// Two codes (the low byte first) as a float16 pair in one register (the low half first), exact.
template <int KIND>
__device__ __forceinline__ uint32_t decode2_half(uint16_t codes) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes), KIND == 1 ? __NV_E4M3 : __NV_E5M2);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

/// Two codes of `word` — the bytes that __byte_perm selector `sel` puts into bytes 1 and 3 (its
/// nibbles 0 and 2 are 4: zero) — as a float16 pair of their exact values: an E5M2 code is the top
/// byte of its float16, so the byte permute alone; E4M3 by the permute into the low 16 bits and one
/// cvt.rn.f16x2.e4m3x2 (on the H200 a 64 x 4,096 decode took 160.6 us this way against 189.5 us with an
/// integer E4M3 decode: permute, sign kept, exponent and mantissa one bit lower, value x 2^-8).
template <int KIND>
__device__ __forceinline__ uint32_t codes_to_half2_exact(uint32_t word, uint32_t sel) {
  if constexpr (KIND == 2) {
    return __byte_perm(word, 0u, sel);
  } else {  // the two codes into the low 16 bits: selector nibbles 1 and 3 into nibbles 0 and 1
    const uint32_t lo = __byte_perm(word, 0u, ((sel >> 4) & 0xfu) | ((sel >> 8) & 0xf0u) | 0x4400u);
    return decode2_half<KIND>(static_cast<uint16_t>(lo));
  }
}

/// 16 codes (a uint4) -> 16 float16 values (two uint4), exact.
template <int KIND>
__device__ __forceinline__ void decode16_half(const uint4& in, uint4& lo, uint4& hi) {
  lo.x = decode2_half<KIND>(static_cast<uint16_t>(in.x));
  lo.y = decode2_half<KIND>(static_cast<uint16_t>(in.x >> 16));
  lo.z = decode2_half<KIND>(static_cast<uint16_t>(in.y));
  lo.w = decode2_half<KIND>(static_cast<uint16_t>(in.y >> 16));
  hi.x = decode2_half<KIND>(static_cast<uint16_t>(in.z));
  hi.y = decode2_half<KIND>(static_cast<uint16_t>(in.z >> 16));
  hi.z = decode2_half<KIND>(static_cast<uint16_t>(in.w));
  hi.w = decode2_half<KIND>(static_cast<uint16_t>(in.w >> 16));
}

}  // namespace pagedllm::cuda::fp8
