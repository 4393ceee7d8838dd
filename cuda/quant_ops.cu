// cuda/quant_ops.cu — scaled_fp8_quant (pagedllm/layer_ops.h): per-token dynamic FP8 (e4m3)
// quantization of activations, one kernel instead of PyTorch's five (abs, amax, div, clamp, cast).
//
// One block of 256 threads per row. Rows of up to 256 x 8 16-byte vectors (16,384 bf16): each
// thread issues all of its loads at once and keeps the values in registers (a first version that
// loaded a vector at a time and read the row twice took ~25 us per call at 256 rows x 4-14k on the
// H200: latency-bound); longer rows loop, reading the row twice. max |x| by warp shuffles, then
// one value per warp through shared memory; s = max(max|x| * float(1/448), FLT_MIN) goes to
// scale[row]; the codes e4m3(clamp(x / s, -448, 448)), round to nearest even, are stored 8 at a time. x / s is an IEEE division (__fdiv_rn, not the build's --use_fast_math), so the bytes are
// those of PyTorch's quantize_fp8_rows (python/pagedllm/model_executor/quantization/fp8.py).
#include <cuda_fp8.h>

#include <cfloat>

#include "layer_ops_common.cuh"
#include "layer_ops_cuda.h"
#include "pagedllm/layer_ops.h"
#include "pdl.cuh"

namespace pagedllm::cuda {
namespace {

using namespace layer_ops;

constexpr int kThreads = 256;

/// The row's FP8 scale from each thread's max |x| (fp8_row_scale of the block's max); thread 0
/// also writes it to *scale.
__device__ __forceinline__ float row_scale(float amax, float* scale) {
  __shared__ float shared[32];
  const float s = fp8_row_scale(block_max(amax, shared));
  if (threadIdx.x == 0) *scale = s;
  return s;
}

template <int VEC>
__device__ __forceinline__ void store_codes(uint8_t* dst, const uint8_t (&q)[VEC]) {
  if constexpr (VEC == 8) {
    uint2 v;
    v.x = q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<uint32_t>(q[3]) << 24);
    v.y = q[4] | (q[5] << 8) | (q[6] << 16) | (static_cast<uint32_t>(q[7]) << 24);
    *reinterpret_cast<uint2*>(dst) = v;
  } else if constexpr (VEC == 4) {
    *reinterpret_cast<uint32_t*>(dst) = q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<uint32_t>(q[3]) << 24);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) dst[j] = q[j];
  }
}

/// Rows of at most kThreads * VEC * MAXV elements: each thread loads its MAXV vectors at once
/// (all in flight together), keeps them in registers for the second pass.
template <typename T, int VEC, int MAXV>
__global__ void __launch_bounds__(kThreads) scaled_fp8_quant_regs_kernel(uint8_t* __restrict__ out,
                                                                          float* __restrict__ scale,
                                                                          const T* __restrict__ input, int k) {
  detail::pdl_launch_dependents();  // cuda/pdl.cuh
  detail::pdl_wait();
  using V = Vec<T, VEC>;
  const int64_t row = blockIdx.x;
  const V* x = reinterpret_cast<const V*>(input + row * k);
  const int nvec = k / VEC;
  V vals[MAXV];
#pragma unroll
  for (int j = 0; j < MAXV; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < nvec) vals[j] = x[i];
  }
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < MAXV; ++j)
    if (threadIdx.x + j * kThreads < nvec)
#pragma unroll
      for (int e = 0; e < VEC; ++e) amax = fmaxf(amax, fabsf(to_float(vals[j].v[e])));
  const float s = row_scale(amax, scale + row);
  uint8_t* y = out + row * k;
#pragma unroll
  for (int j = 0; j < MAXV; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < nvec) {
      uint8_t q[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) q[e] = to_e4m3(to_float(vals[j].v[e]), s);
      store_codes<VEC>(y + static_cast<int64_t>(i) * VEC, q);
    }
  }
}

/// Any row length: two passes over the row (the second from L1/L2).
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) scaled_fp8_quant_kernel(uint8_t* __restrict__ out,
                                                                     float* __restrict__ scale,
                                                                     const T* __restrict__ input, int k) {
  detail::pdl_launch_dependents();
  detail::pdl_wait();
  using V = Vec<T, VEC>;
  const int64_t row = blockIdx.x;
  const T* x = input + row * k;
  const int nvec = k / VEC;
  float amax = 0.f;
  for (int i = threadIdx.x; i < nvec; i += kThreads) {
    const V v = reinterpret_cast<const V*>(x)[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(to_float(v.v[j])));
  }
  const float s = row_scale(amax, scale + row);
  uint8_t* y = out + row * k;
  for (int i = threadIdx.x; i < nvec; i += kThreads) {
    const V v = reinterpret_cast<const V*>(x)[i];
    uint8_t q[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) q[j] = to_e4m3(to_float(v.v[j]), s);
    store_codes<VEC>(y + static_cast<int64_t>(i) * VEC, q);
  }
}

template <typename T>
void launch(const TensorView& out, const TensorView& scale, const TensorView& input, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int k = static_cast<int>(input.size(1));
  const dim3 grid(static_cast<unsigned>(input.size(0)));
  const dim3 block(kThreads);
  uint8_t* o = out.ptr<uint8_t>();
  float* sc = scale.ptr<float>();
  const T* in = static_cast<const T*>(input.ptr<T>());
  if (k % kVec != 0 || !aligned16(input.data) || !aligned16(out.data)) {
    detail::launch_dependent(scaled_fp8_quant_kernel<T, 1>, grid, block, 0, stream, o, sc, in, k);
    return;
  }
  const int per_thread = (k / kVec + kThreads - 1) / kThreads;
  if (per_thread <= 1)
    detail::launch_dependent(scaled_fp8_quant_regs_kernel<T, kVec, 1>, grid, block, 0, stream, o, sc, in, k);
  else if (per_thread <= 2)
    detail::launch_dependent(scaled_fp8_quant_regs_kernel<T, kVec, 2>, grid, block, 0, stream, o, sc, in, k);
  else if (per_thread <= 4)
    detail::launch_dependent(scaled_fp8_quant_regs_kernel<T, kVec, 4>, grid, block, 0, stream, o, sc, in, k);
  else if (per_thread <= 8)
    detail::launch_dependent(scaled_fp8_quant_regs_kernel<T, kVec, 8>, grid, block, 0, stream, o, sc, in, k);
  else
    detail::launch_dependent(scaled_fp8_quant_kernel<T, kVec>, grid, block, 0, stream, o, sc, in, k);
}

}  // namespace

void scaled_fp8_quant(const TensorView& out, const TensorView& scale, const TensorView& input,
                      std::uintptr_t stream) {
  layer_ops::DeviceGuard guard(input.device_index);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  if (input.dtype == DType::kBFloat16)
    launch<__nv_bfloat16>(out, scale, input, s);
  else if (input.dtype == DType::kFloat16)
    launch<__half>(out, scale, input, s);
  else
    launch<float>(out, scale, input, s);
}

}  // namespace pagedllm::cuda
