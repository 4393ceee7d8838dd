// cuda/activation.cu — silu_and_mul, SwiGLU's gate (pagedllm/layer_ops.h).
//
// Grid (num_tokens, chunks of the row): each thread takes 16-byte vectors of the gate half and
// the matching vectors of the up half (element by element when d is not a multiple of the
// vector). out = T(T(silu(gate)) * up), as HF's act_fn(gate_proj(x)) * up_proj(x) rounds.
#include <algorithm>

#include "layer_ops_common.cuh"
#include "layer_ops_cuda.h"
#include "pdl.cuh"

namespace pagedllm::cuda {
namespace {

using namespace layer_ops;

constexpr int kThreads = 256;

template <typename T, int VEC>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ input, int d) {
  detail::pdl_launch_dependents();  // cuda/pdl.cuh
  detail::pdl_wait();
  using V = Vec<T, VEC>;
  const int64_t token = blockIdx.x;
  const V* gate = reinterpret_cast<const V*>(input + token * 2 * d);
  const V* up = reinterpret_cast<const V*>(input + token * 2 * d + d);
  V* dst = reinterpret_cast<V*>(out + token * d);
  const int num_vecs = d / VEC;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < num_vecs; i += gridDim.y * blockDim.x) {
    const V g = gate[i];
    const V u = up[i];
    V y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x = to_float(g.v[j]);
      const float silu = round_to<T>(x / (1.f + expf(-x)));
      y.v[j] = from_float<T>(silu * to_float(u.v[j]));
    }
    dst[i] = y;
  }
}

template <typename T, int VEC>
void launch_vec(const TensorView& out, const TensorView& input, cudaStream_t stream) {
  const int d = static_cast<int>(out.size(1));
  const int num_vecs = d / VEC;
  const unsigned chunks = static_cast<unsigned>(std::min(65535, (num_vecs + kThreads - 1) / kThreads));
  const dim3 grid(static_cast<unsigned>(out.size(0)), chunks);
  detail::launch_dependent(silu_and_mul_kernel<T, VEC>, grid, dim3(kThreads), 0, stream, out.ptr<T>(),
                     static_cast<const T*>(input.ptr<T>()), d);
}

template <typename T>
void launch(const TensorView& out, const TensorView& input, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (out.size(1) % kVec == 0 && aligned16(out.data) && aligned16(input.data))
    launch_vec<T, kVec>(out, input, stream);
  else
    launch_vec<T, 1>(out, input, stream);
}

}  // namespace

void silu_and_mul(const TensorView& out, const TensorView& input, std::uintptr_t stream) {
  layer_ops::DeviceGuard guard(input.device_index);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (input.dtype) {
    case DType::kFloat32: return launch<float>(out, input, s);
    case DType::kBFloat16: return launch<__nv_bfloat16>(out, input, s);
    case DType::kFloat16: return launch<__half>(out, input, s);
    default: throw std::runtime_error("CUDA silu_and_mul: unsupported dtype");
  }
}

}  // namespace pagedllm::cuda
