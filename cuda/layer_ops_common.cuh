// cuda/layer_ops_common.cuh — internal device helpers of the layer kernels (rms_norm.cu,
// activation.cu, rotary_embedding.cu): float conversions for every supported dtype, rounding to
// the tensor dtype (to reproduce where PyTorch rounds), a block-wide sum, and the device guard.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_check.h"
#include "device_guard.h"

namespace pagedllm::cuda::layer_ops {

template <typename T>
struct Convert;
template <>
struct Convert<float> {
  __device__ __forceinline__ static float to_float(float v) { return v; }
  __device__ __forceinline__ static float from_float(float v) { return v; }
};
template <>
struct Convert<__nv_bfloat16> {
  __device__ __forceinline__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Convert<__half> {
  __device__ __forceinline__ static float to_float(__half v) { return __half2float(v); }
  __device__ __forceinline__ static __half from_float(float v) { return __float2half_rn(v); }
};

template <typename T>
__device__ __forceinline__ float to_float(T v) { return Convert<T>::to_float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v) { return Convert<T>::from_float(v); }
/// v rounded to T and read back as float: the value a PyTorch op with a T output would produce.
template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_float<T>(from_float<T>(v)); }

/// One GPT-NeoX rotary pair: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), each product rounded to T
/// before the add, as PyTorch's q * cos + rotate_half(q) * sin in dtype T (no fused multiply-add).
/// Shared by the rotary kernel (rotary_embedding.cu) and the GEMV's rope epilogue (gemv.cu).
template <typename T>
__device__ __forceinline__ void rotate_pair(T x1, T x2, float c, float s, T& y1, T& y2) {
  const float a = to_float(x1), b = to_float(x2);
  y1 = from_float<T>(__fadd_rn(round_to<T>(__fmul_rn(a, c)), -round_to<T>(__fmul_rn(b, s))));
  y2 = from_float<T>(__fadd_rn(round_to<T>(__fmul_rn(b, c)), round_to<T>(__fmul_rn(a, s))));
}

/// VEC elements of T loaded / stored as one access (16 bytes when VEC * sizeof(T) == 16).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

/// op-reduction of v over the block (blockDim.x a multiple of 32, at most 1024; `identity` fills
/// the absent warps); every thread gets it. `shared` holds 32 floats. Call once per buffer (no
/// trailing barrier for reuse).
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float* shared, Op op, float identity) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int num_warps = blockDim.x / 32;
    v = lane < num_warps ? shared[lane] : identity;
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}

/// Sum of v over the block (block_reduce's conditions).
__device__ __forceinline__ float block_sum(float v, float* shared) { return block_reduce(v, shared, SumOp{}, 0.f); }

/// max over the block of v >= 0 (block_reduce's conditions).
__device__ __forceinline__ float block_max(float v, float* shared) { return block_reduce(v, shared, MaxOp{}, 0.f); }

/// 16 bytes at p, streamed: not kept in L1 (read once), L2 fetches 256-byte blocks — the GEMVs'
/// weight loads.
__device__ __forceinline__ uint4 ld_weight16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

using detail::DeviceGuard;  // device_guard.h

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

inline int round_up_warps(int64_t threads, int lo, int hi) {
  int64_t t = (threads + 31) / 32 * 32;
  if (t < lo) t = lo;
  if (t > hi) t = hi;
  return static_cast<int>(t);
}

/// The per-token FP8 scale of a row whose max |x| is amax: max(amax * float(1/448), FLT_MIN)
/// (PyTorch divides by a scalar as a product with its reciprocal).
__device__ __forceinline__ float fp8_row_scale(float amax) { return fmaxf(amax * (1.f / 448.f), 1.17549435e-38f); }

/// e4m3 bits of clamp(v / s, -448, 448), round to nearest even (an IEEE division, whatever the
/// build's --use_fast_math).
__device__ __forceinline__ uint8_t to_e4m3(float v, float s) {
  const float q = fminf(fmaxf(__fdiv_rn(v, s), -448.f), 448.f);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace pagedllm::cuda::layer_ops
