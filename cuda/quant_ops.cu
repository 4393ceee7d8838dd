// cuda/quant_ops.cu — scaled_fp8_quant (pagedllm/layer_ops.h): per-token dynamic FP8 (e4m3)
// quantization of activations, one kernel instead of PyTorch's five (abs, amax, div, clamp, cast).
//
// One block of 256 threads per row: a pass of 16-byte loads takes max |x| (warp shuffles, then
// one value per warp through shared memory), s = max(max|x| * float(1/448), FLT_MIN) goes to scale[row],
// a second pass (the row is in L1/L2) writes e4m3(clamp(x / s, -448, 448)), round to nearest
// even. x / s is an IEEE division (__fdiv_rn, not the build's --use_fast_math), so the bytes are
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

__device__ __forceinline__ uint8_t to_e4m3(float v, float s) {
  const float q = fminf(fmaxf(__fdiv_rn(v, s), -448.f), 448.f);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3));
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) scaled_fp8_quant_kernel(uint8_t* __restrict__ out,
                                                                     float* __restrict__ scale,
                                                                     const T* __restrict__ input, int k) {
  detail::pdl_launch_dependents();  // cuda/pdl.cuh
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
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  __shared__ float warp_max[kThreads / 32];
  __shared__ float row_scale;
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = warp_max[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
    const float s = fmaxf(m * (1.f / 448.f), FLT_MIN);  // PyTorch's division by a scalar: times its reciprocal
    row_scale = s;
    scale[row] = s;
  }
  __syncthreads();
  const float s = row_scale;
  uint8_t* y = out + row * k;
  for (int i = threadIdx.x; i < nvec; i += kThreads) {
    const V v = reinterpret_cast<const V*>(x)[i];
    uint8_t q[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) q[j] = to_e4m3(to_float(v.v[j]), s);
#pragma unroll
    for (int j = 0; j < VEC; ++j) y[i * VEC + j] = q[j];
  }
}

template <typename T>
void launch(const TensorView& out, const TensorView& scale, const TensorView& input, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int k = static_cast<int>(input.size(1));
  const dim3 grid(static_cast<unsigned>(input.size(0)));
  if (k % kVec == 0 && aligned16(input.data))
    detail::launch_dependent(scaled_fp8_quant_kernel<T, kVec>, grid, dim3(kThreads), 0, stream, out.ptr<uint8_t>(),
                             scale.ptr<float>(), static_cast<const T*>(input.ptr<T>()), k);
  else
    detail::launch_dependent(scaled_fp8_quant_kernel<T, 1>, grid, dim3(kThreads), 0, stream, out.ptr<uint8_t>(),
                             scale.ptr<float>(), static_cast<const T*>(input.ptr<T>()), k);
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
