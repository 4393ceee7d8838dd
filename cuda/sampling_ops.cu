// cuda/sampling_ops.cu — argmax_rows on CUDA (pagedllm/sampling_ops.h), the greedy sampler's
// one kernel, and fill_placeholder_ids (one thread per token), async scheduling's input fix-up.
//
// One CTA of 1024 threads per row (a row is 32K-256K logits, already in L2 after the LM head):
// each thread scans 16-byte vectors (or single elements when the row is not 16-byte aligned)
// with several loads in flight, keeping its largest value and the smallest index holding it;
// then a warp-shuffle and a shared-memory merge take the larger value, the smaller index on a
// tie — torch.argmax's first-index rule. NaN is never chosen over a number (comparisons with
// NaN are false); a row of -inf only gives its first index, a row of NaN only gives 0 (as the
// CPU kernel). torch.argmax reduces a single 128K row with few CTAs (~28 us on an H200); this
// takes a few us.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <stdexcept>

#include "cuda_check.h"
#include "device_guard.h"
#include "layer_ops_common.cuh"
#include "sampling_ops_cuda.h"

namespace pagedllm::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kUnroll = 4;
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

struct Best {
  float value;
  int64_t index;
};

__device__ __forceinline__ void take(Best& b, float v, int64_t i) {
  // larger value, or the same value at a smaller index (-inf == -inf counts: a row of -inf
  // still yields its first index); NaN compares false both ways and is never taken.
  if (v > b.value || (v == b.value && i < b.index)) {
    b.value = v;
    b.index = i;
  }
}

__device__ __forceinline__ Best merge(Best a, Best b) {
  if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
  return a;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) argmax_rows_kernel(int64_t* __restrict__ out,
                                                               const T* __restrict__ logits,
                                                               int64_t row_stride, int64_t n) {
  using V = layer_ops::Vec<T, VEC>;
  const T* row = logits + blockIdx.x * row_stride;
  Best best{-INFINITY, kNone};
  const int64_t num_vecs = n / VEC;
  const V* vecs = reinterpret_cast<const V*>(row);
  int64_t v = threadIdx.x;
  for (; v + (kUnroll - 1) * kThreads < num_vecs; v += kUnroll * kThreads) {
    V chunk[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) chunk[u] = vecs[v + u * kThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        take(best, layer_ops::to_float(chunk[u].v[j]), (v + u * kThreads) * VEC + j);
  }
  for (; v < num_vecs; v += kThreads) {
    const V chunk = vecs[v];
#pragma unroll
    for (int j = 0; j < VEC; ++j) take(best, layer_ops::to_float(chunk.v[j]), v * VEC + j);
  }
  for (int64_t i = num_vecs * VEC + threadIdx.x; i < n; i += kThreads)
    take(best, layer_ops::to_float(row[i]), i);

  for (int o = 16; o > 0; o >>= 1) {
    Best other{__shfl_xor_sync(0xffffffffu, best.value, o), __shfl_xor_sync(0xffffffffu, best.index, o)};
    best = merge(best, other);
  }
  __shared__ Best warp_best[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (warp == 0) {
    best = warp_best[lane];  // kThreads / 32 == 32 warps
    for (int o = 16; o > 0; o >>= 1) {
      Best other{__shfl_xor_sync(0xffffffffu, best.value, o), __shfl_xor_sync(0xffffffffu, best.index, o)};
      best = merge(best, other);
    }
    if (lane == 0) out[blockIdx.x] = best.index == kNone ? 0 : best.index;
  }
}

template <typename T>
void launch(const TensorView& out, const TensorView& logits, int64_t n, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t rows = logits.size(0);
  const int64_t stride = logits.stride(0);
  const bool aligned = reinterpret_cast<std::uintptr_t>(logits.data) % 16 == 0 &&
                       (rows == 1 || (stride * static_cast<int64_t>(sizeof(T))) % 16 == 0);
  const dim3 grid(static_cast<unsigned>(rows));
  if (aligned)
    argmax_rows_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(out.ptr<int64_t>(), logits.ptr<const T>(), stride, n);
  else
    argmax_rows_kernel<T, 1><<<grid, kThreads, 0, stream>>>(out.ptr<int64_t>(), logits.ptr<const T>(), stride, n);
  PAGEDLLM_CUDA_CHECK_LAUNCH();
}

__global__ void fill_placeholder_ids_kernel(int32_t* __restrict__ ids, const int32_t* __restrict__ rows,
                                            const int64_t* __restrict__ sampled, int64_t n, int64_t num_sampled) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  const int32_t r = rows[t];
  if (r >= 0 && r < num_sampled) ids[t] = static_cast<int32_t>(sampled[r]);
}

}  // namespace

void fill_placeholder_ids(const TensorView& input_ids, const TensorView& prev_rows, const TensorView& sampled,
                          std::uintptr_t stream) {
  detail::DeviceGuard guard(input_ids.device_index);
  const int64_t n = input_ids.size(0);
  constexpr int kBlock = 128;
  const dim3 grid(static_cast<unsigned>((n + kBlock - 1) / kBlock));
  fill_placeholder_ids_kernel<<<grid, kBlock, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      input_ids.ptr<int32_t>(), prev_rows.ptr<const int32_t>(), sampled.ptr<const int64_t>(), n, sampled.size(0));
  PAGEDLLM_CUDA_CHECK_LAUNCH();
}

void argmax_rows(const TensorView& out, const TensorView& logits, int64_t vocab, std::uintptr_t stream) {
  detail::DeviceGuard guard(logits.device_index);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (logits.dtype) {
    case DType::kFloat32: return launch<float>(out, logits, vocab, s);
    case DType::kBFloat16: return launch<__nv_bfloat16>(out, logits, vocab, s);
    case DType::kFloat16: return launch<__half>(out, logits, vocab, s);
    default: throw std::runtime_error("CUDA argmax_rows: unsupported dtype");
  }
}

}  // namespace pagedllm::cuda
