// cuda/activation.cu — silu_and_mul, SwiGLU's gate (pagedllm/layer_ops.h).
//
// Grid (num_tokens, chunks of the row): each thread takes 16-byte vectors of the gate half and
// the matching vectors of the up half (element by element when d is not a multiple of the
// vector). out = T(T(silu(gate)) * up), as HF's act_fn(gate_proj(x)) * up_proj(x) rounds. With
// paired rows (layer_ops.h's gate_up_paired_row order) output column c reads input columns
// 16 (c / 8) + c % 8 (gate) and that + 8 (up): a vector of VEC <= 8 columns stays inside one
// 8-column run, so it is still one vector load of each.
#include <algorithm>

#include "layer_ops_common.cuh"
#include "layer_ops_cuda.h"
#include "pagedllm/layer_ops.h"
#include "pdl.cuh"

namespace pagedllm::cuda {
namespace {

using namespace layer_ops;

constexpr int kThreads = 256;

template <typename T, int VEC, bool PAIRED>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ input, int d) {
  static_assert(!PAIRED || 8 % VEC == 0, "a paired vector stays inside one 8-column run");
  detail::pdl_launch_dependents();  // cuda/pdl.cuh
  detail::pdl_wait();
  using V = Vec<T, VEC>;
  const int64_t token = blockIdx.x;
  const T* row = input + token * 2 * d;
  V* dst = reinterpret_cast<V*>(out + token * d);
  const int num_vecs = d / VEC;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < num_vecs; i += gridDim.y * blockDim.x) {
    const int c = i * VEC;  // first output column
    const int gate_col = PAIRED ? static_cast<int>(gate_up_paired_gate_row(c)) : c;
    const int up_col = PAIRED ? gate_col + 8 : c + d;
    const V g = *reinterpret_cast<const V*>(row + gate_col);
    const V u = *reinterpret_cast<const V*>(row + up_col);
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

template <typename T, int VEC, bool PAIRED>
void launch_vec(const TensorView& out, const TensorView& input, cudaStream_t stream) {
  const int d = static_cast<int>(out.size(1));
  const int num_vecs = d / VEC;
  const unsigned chunks = static_cast<unsigned>(std::min(65535, (num_vecs + kThreads - 1) / kThreads));
  const dim3 grid(static_cast<unsigned>(out.size(0)), chunks);
  detail::launch_dependent(silu_and_mul_kernel<T, VEC, PAIRED>, grid, dim3(kThreads), 0, stream, out.ptr<T>(),
                           static_cast<const T*>(input.ptr<T>()), d);
}

template <typename T, bool PAIRED>
void launch(const TensorView& out, const TensorView& input, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (out.size(1) % kVec == 0 && aligned16(out.data) && aligned16(input.data))
    launch_vec<T, kVec, PAIRED>(out, input, stream);
  else
    launch_vec<T, 1, PAIRED>(out, input, stream);
}

template <typename T>
void launch(const TensorView& out, const TensorView& input, cudaStream_t stream, bool paired_rows) {
  if (paired_rows) launch<T, true>(out, input, stream);
  else launch<T, false>(out, input, stream);
}

}  // namespace

void silu_and_mul(const TensorView& out, const TensorView& input, std::uintptr_t stream, bool paired_rows) {
  layer_ops::DeviceGuard guard(input.device_index);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (input.dtype) {
    case DType::kFloat32: return launch<float>(out, input, s, paired_rows);
    case DType::kBFloat16: return launch<__nv_bfloat16>(out, input, s, paired_rows);
    case DType::kFloat16: return launch<__half>(out, input, s, paired_rows);
    default: throw std::runtime_error("CUDA silu_and_mul: unsupported dtype");
  }
}

}  // namespace pagedllm::cuda
