// cuda/rms_norm.cu — RMSNorm and the residual add fused with it (pagedllm/layer_ops.h).
//
// One CTA per token row. Pass 1 reads the row (and adds the residual, storing the rounded sum
// back into the residual), accumulating the sum of squares in float32; a block reduction gives
// inv = rsqrt(mean + eps); pass 2 re-reads the row (L1/L2-resident: each thread reads back what
// it wrote) and writes T(T(h * inv) * weight), HF's LlamaRMSNorm rounding. Rows whose size is a
// multiple of 16 bytes / sizeof(T) move as 16-byte vectors, others element by element.
// With an FP8 output (quantization="fp8"'s next projection) the kernel also takes the row's max |y|
// while writing y, and a third pass (each thread re-reading its own writes) stores
// e4m3(y / s) with s = max|y| / 448 — the bytes scaled_fp8_quant would give for y (cuda/quant_ops.cu)
// without its kernel (the re-read of y comes from L1/L2, the bf16 y is still written).
#include "layer_ops_common.cuh"
#include "layer_ops_cuda.h"
#include "pdl.cuh"

namespace pagedllm::cuda {
namespace {

using namespace layer_ops;

/// residual == nullptr: out = norm(input). Else out == input: residual += input; input = norm(residual).
template <typename T, int VEC, bool kResidual, bool kFp8>
__global__ void rms_norm_kernel(T* out, const T* input, T* residual, const T* __restrict__ weight,
                                int hidden, float eps, uint8_t* __restrict__ fp8_out, float* __restrict__ fp8_scale) {
  __shared__ float shared[32];
  __shared__ float shared_max[32];
  // Programmatic dependent launch (cuda/pdl.cuh): let the next kernel (a GEMV streaming its
  // weights) start now; wait for the previous kernel before touching the rows.
  detail::pdl_launch_dependents();
  detail::pdl_wait();
  using V = Vec<T, VEC>;
  const int64_t row = blockIdx.x;
  const int num_vecs = hidden / VEC;
  const V* in = reinterpret_cast<const V*>(input + row * hidden);
  V* res = kResidual ? reinterpret_cast<V*>(residual + row * hidden) : nullptr;
  float sumsq = 0.f;
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    V x = in[i];
    if constexpr (kResidual) {
      V r = res[i];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        r.v[j] = from_float<T>(to_float(x.v[j]) + to_float(r.v[j]));
        const float h = to_float(r.v[j]);
        sumsq += h * h;
      }
      res[i] = r;
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float h = to_float(x.v[j]);
        sumsq += h * h;
      }
    }
  }
  const float inv = rsqrtf(block_sum(sumsq, shared) / static_cast<float>(hidden) + eps);
  const V* src = kResidual ? res : in;
  const V* w = reinterpret_cast<const V*>(weight);
  V* dst = reinterpret_cast<V*>(out + row * hidden);
  float amax = 0.f;
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    const V x = src[i];
    const V wv = w[i];
    V y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      y.v[j] = from_float<T>(round_to<T>(to_float(x.v[j]) * inv) * to_float(wv.v[j]));
      if constexpr (kFp8) amax = fmaxf(amax, fabsf(to_float(y.v[j])));
    }
    dst[i] = y;
  }
  if constexpr (kFp8) {
    const float s = fp8_row_scale(block_max(amax, shared_max));
    if (threadIdx.x == 0) fp8_scale[row] = s;
    uint8_t* q = fp8_out + row * hidden;
    for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
      const V y = dst[i];  // this thread's own write
#pragma unroll
      for (int j = 0; j < VEC; ++j) q[i * VEC + j] = to_e4m3(to_float(y.v[j]), s);
    }
  }
}

template <typename T, int VEC, bool kFp8>
void launch_vec(const TensorView& out, const TensorView& input, const TensorView* residual,
                const TensorView& weight, float eps, cudaStream_t stream, uint8_t* fp8_out, float* fp8_scale) {
  const int hidden = static_cast<int>(input.size(1));
  const auto rows = static_cast<unsigned>(input.size(0));
  const int threads = round_up_warps(hidden / VEC, 32, 1024);
  if (residual != nullptr)
    detail::launch_dependent(rms_norm_kernel<T, VEC, true, kFp8>, dim3(rows), dim3(threads), 0, stream, out.ptr<T>(),
                       static_cast<const T*>(input.ptr<T>()), residual->ptr<T>(),
                       static_cast<const T*>(weight.ptr<T>()), hidden, eps, fp8_out, fp8_scale);
  else
    detail::launch_dependent(rms_norm_kernel<T, VEC, false, kFp8>, dim3(rows), dim3(threads), 0, stream, out.ptr<T>(),
                       static_cast<const T*>(input.ptr<T>()), static_cast<T*>(nullptr),
                       static_cast<const T*>(weight.ptr<T>()), hidden, eps, fp8_out, fp8_scale);
}

template <typename T, bool kFp8>
void launch(const TensorView& out, const TensorView& input, const TensorView* residual, const TensorView& weight,
            float eps, cudaStream_t stream, uint8_t* fp8_out, float* fp8_scale) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = input.size(1) % kVec == 0 && aligned16(out.data) && aligned16(input.data) &&
                   aligned16(weight.data) && (residual == nullptr || aligned16(residual->data));
  if (vec) launch_vec<T, kVec, kFp8>(out, input, residual, weight, eps, stream, fp8_out, fp8_scale);
  else launch_vec<T, 1, kFp8>(out, input, residual, weight, eps, stream, fp8_out, fp8_scale);
}

template <typename T>
void launch(const TensorView& out, const TensorView& input, const TensorView* residual, const TensorView& weight,
            float eps, cudaStream_t stream, const TensorView* fp8_out, const TensorView* fp8_scale) {
  if (fp8_out != nullptr)
    launch<T, true>(out, input, residual, weight, eps, stream, fp8_out->ptr<uint8_t>(), fp8_scale->ptr<float>());
  else
    launch<T, false>(out, input, residual, weight, eps, stream, nullptr, nullptr);
}

}  // namespace

void rms_norm(const TensorView& out, const TensorView& input, const TensorView* residual, const TensorView& weight,
              float eps, std::uintptr_t stream, const TensorView* fp8_out, const TensorView* fp8_scale) {
  layer_ops::DeviceGuard guard(input.device_index);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (input.dtype) {
    case DType::kFloat32: return launch<float>(out, input, residual, weight, eps, s, fp8_out, fp8_scale);
    case DType::kBFloat16: return launch<__nv_bfloat16>(out, input, residual, weight, eps, s, fp8_out, fp8_scale);
    case DType::kFloat16: return launch<__half>(out, input, residual, weight, eps, s, fp8_out, fp8_scale);
    default: throw std::runtime_error("CUDA rms_norm: unsupported dtype");
  }
}

}  // namespace pagedllm::cuda
