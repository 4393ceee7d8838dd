// cuda/sampling_ops.cu — argmax_rows on CUDA (pagedllm/sampling_ops.h), the greedy sampler's
// one kernel, and fill_placeholder_ids (one thread per token), async scheduling's input fix-up.
//
// Each thread scans 16-byte vectors (or single elements when the row is not 16-byte aligned)
// with several loads in flight, keeping its largest value and the smallest index holding it;
// then a warp-shuffle and a shared-memory merge take the larger value, the smaller index on a
// tie — torch.argmax's first-index rule. NaN is never chosen over a number (comparisons with
// NaN are false); a row of -inf only gives its first index, a row of NaN only gives 0 (as the
// CPU kernel). Many or short rows: one CTA of 1024 threads per row. A few long rows (a small
// decode batch's 32K-256K logits, already in L2 after the LM head): CTAs of 256 threads over
// chunks of ~4K columns write their best to a stream-ordered scratch (cudaMallocAsync), and a
// second kernel (a programmatic dependent) merges each row's chunks. torch.argmax reduces a single
// 128K row with few CTAs (~28 us on an H200); one CTA per row took ~9 us, 32 chunks ~3.7 us.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <stdexcept>

#include "cuda_check.h"
#include "device_guard.h"
#include "layer_ops_common.cuh"
#include "pdl.cuh"
#include "sampling_ops_cuda.h"

namespace pagedllm::cuda {
namespace {

constexpr int kThreads = 1024;      // one CTA per row
constexpr int kChunkThreads = 256;  // one CTA per chunk of a long row
constexpr int kUnroll = 4;
// A few long rows are split into chunks of about kChunkColumns columns: as many per row as keep
// about one CTA per SM busy, at most kMaxChunks, at least kMinChunks (else one CTA per row). H200,
// 128,256 float32 logits: 1 row 9.0 us in one CTA, 3.7 us in 32 chunks; 256 rows 38 us in one CTA
// each, 58 us in 32 chunks each (bench/gpu_engine_notes.md, session 12).
constexpr int64_t kChunkColumns = 4096;
constexpr int64_t kMaxChunks = 64;
constexpr int64_t kMinChunks = 4;
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

struct Best {
  float value;
  int64_t index;
};

/// Multiprocessors of the current device (cached per device, up to 64 devices).
int64_t sm_count() {
  static std::atomic<int> cache[64] = {};
  int dev = 0;
  PAGEDLLM_CUDA_CHECK(cudaGetDevice(&dev));
  std::atomic<int>& slot = cache[dev < 64 ? dev : 63];
  int n = slot.load();
  if (n == 0) {
    PAGEDLLM_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    slot.store(n);
  }
  return n;
}

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

/// This thread's best over vectors v0, v0 + step, ... < v1 of `row` (VEC elements each; vector v
/// holds columns v * VEC ..), several loads in flight.
template <typename T, int VEC>
__device__ __forceinline__ void scan(Best& best, const T* row, int64_t v0, int64_t v1, int step) {
  using V = layer_ops::Vec<T, VEC>;
  const V* vecs = reinterpret_cast<const V*>(row);
  int64_t v = v0;
  for (; v + (kUnroll - 1) * step < v1; v += kUnroll * step) {
    V chunk[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) chunk[u] = vecs[v + u * step];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int j = 0; j < VEC; ++j) take(best, layer_ops::to_float(chunk[u].v[j]), (v + u * step) * VEC + j);
  }
  for (; v < v1; v += step) {
    const V chunk = vecs[v];
#pragma unroll
    for (int j = 0; j < VEC; ++j) take(best, layer_ops::to_float(chunk.v[j]), v * VEC + j);
  }
}

__device__ __forceinline__ Best warp_best(Best best) {
  for (int o = 16; o > 0; o >>= 1) {
    Best other{__shfl_xor_sync(0xffffffffu, best.value, o), __shfl_xor_sync(0xffffffffu, best.index, o)};
    best = merge(best, other);
  }
  return best;
}

/// The CTA's best (valid in thread 0); blockDim.x a multiple of 32, at most 1024.
__device__ __forceinline__ Best block_best(Best best) {
  __shared__ Best per_warp[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  best = warp_best(best);
  if (lane == 0) per_warp[warp] = best;
  __syncthreads();
  if (warp == 0) best = warp_best(lane < warps ? per_warp[lane] : Best{-INFINITY, kNone});
  return best;
}

/// One CTA per row (many or short rows): out[row] = its argmax over n columns.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) argmax_rows_kernel(int64_t* __restrict__ out,
                                                               const T* __restrict__ logits,
                                                               int64_t row_stride, int64_t n) {
  const T* row = logits + blockIdx.x * row_stride;
  Best best{-INFINITY, kNone};
  const int64_t num_vecs = n / VEC;
  scan<T, VEC>(best, row, threadIdx.x, num_vecs, kThreads);
  for (int64_t i = num_vecs * VEC + threadIdx.x; i < n; i += kThreads) take(best, layer_ops::to_float(row[i]), i);
  best = block_best(best);
  if (threadIdx.x == 0) out[blockIdx.x] = best.index == kNone ? 0 : best.index;
}

/// Long rows, first pass: CTA (row, c) of `chunks` per row takes columns [c * chunk, (c + 1) *
/// chunk) of [0, n) (chunk a multiple of 8, so of VEC) and writes its best to
/// partials[row * chunks + c].
template <typename T, int VEC>
__global__ void __launch_bounds__(kChunkThreads) argmax_chunks_kernel(Best* __restrict__ partials,
                                                                      const T* __restrict__ logits,
                                                                      int64_t row_stride, int64_t n, int chunks,
                                                                      int64_t chunk) {
  detail::pdl_launch_dependents();  // the merge kernel may be scheduled now; it waits for this grid
  const int64_t r = blockIdx.x / chunks, c = blockIdx.x % chunks;
  const T* row = logits + r * row_stride;
  const int64_t begin = min(n, c * chunk), end = min(n, begin + chunk);
  Best best{-INFINITY, kNone};
  const int64_t v_end = end / VEC;  // whole vectors; the row's tail (n % VEC columns) element-wise
  scan<T, VEC>(best, row, begin / VEC + threadIdx.x, v_end, kChunkThreads);
  for (int64_t i = max(begin, v_end * VEC) + threadIdx.x; i < end; i += kChunkThreads)
    take(best, layer_ops::to_float(row[i]), i);
  best = block_best(best);
  if (threadIdx.x == 0) partials[blockIdx.x] = best;
}

/// Long rows, second pass (a programmatic dependent of the first): one warp per row merges the
/// row's `chunks` partials (ties: the smaller index, whichever lane holds it).
__global__ void __launch_bounds__(32) argmax_merge_kernel(int64_t* __restrict__ out,
                                                          const Best* __restrict__ partials, int chunks) {
  detail::pdl_wait();
  Best best{-INFINITY, kNone};
  for (int c = threadIdx.x; c < chunks; c += 32) best = merge(best, partials[blockIdx.x * chunks + c]);
  best = warp_best(best);
  if (threadIdx.x == 0) out[blockIdx.x] = best.index == kNone ? 0 : best.index;
}

template <typename T>
void launch(const TensorView& out, const TensorView& logits, int64_t n, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t rows = logits.size(0);
  const int64_t stride = logits.stride(0);
  const bool aligned = reinterpret_cast<std::uintptr_t>(logits.data) % 16 == 0 &&
                       (rows == 1 || (stride * static_cast<int64_t>(sizeof(T))) % 16 == 0);
  int64_t* ids = out.ptr<int64_t>();
  const T* x = logits.ptr<const T>();
  const int chunks = static_cast<int>(
      std::min({kMaxChunks, (n + kChunkColumns - 1) / kChunkColumns, std::max<int64_t>(1, sm_count() / rows)}));
  if (chunks < kMinChunks) {  // one CTA per row
    const dim3 grid(static_cast<unsigned>(rows));
    if (aligned) argmax_rows_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(ids, x, stride, n);
    else argmax_rows_kernel<T, 1><<<grid, kThreads, 0, stream>>>(ids, x, stride, n);
    PAGEDLLM_CUDA_CHECK_LAUNCH();
    return;
  }
  const int64_t chunk = ((n + chunks - 1) / chunks + 7) / 8 * 8;
  void* scratch = nullptr;  // stream-ordered: no synchronization, capturable in a CUDA graph
  detail::keep_pool_memory(stream);
  PAGEDLLM_CUDA_CHECK(cudaMallocAsync(&scratch, static_cast<size_t>(rows) * chunks * sizeof(Best), stream));
  auto* partials = static_cast<Best*>(scratch);
  const dim3 grid(static_cast<unsigned>(rows * chunks));
  if (aligned) argmax_chunks_kernel<T, kVec><<<grid, kChunkThreads, 0, stream>>>(partials, x, stride, n, chunks, chunk);
  else argmax_chunks_kernel<T, 1><<<grid, kChunkThreads, 0, stream>>>(partials, x, stride, n, chunks, chunk);
  PAGEDLLM_CUDA_CHECK_LAUNCH();
  detail::launch_dependent(argmax_merge_kernel, dim3(static_cast<unsigned>(rows)), dim3(32), 0, stream, ids,
                           static_cast<const Best*>(partials), chunks);
  PAGEDLLM_CUDA_CHECK(cudaFreeAsync(scratch, stream));
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
