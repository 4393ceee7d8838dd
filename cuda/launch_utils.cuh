// cuda/launch_utils.cuh — internal host helpers shared by the CUDA attention launchers: dispatch
// on head size and on the tensor-core dtype, the resident-CTA count of a kernel (occupancy x SMs),
// and a checked launch that first raises the kernel's dynamic shared-memory limit.
// Include from .cu files only (kernel launches).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "attention_launch.h"
#include "cuda_check.h"

namespace pagedllm::cuda::detail {

template <int D>
using HeadSize = std::integral_constant<int, D>;

template <typename T>
struct TypeTag {
  using type = T;
};

/// Returns f(HeadSize<D>{}) for head_size == D, D in {64, 80, 96, 128, 256} and D <= MaxD;
/// any other head size is a std::runtime_error naming `what` and the head size.
template <int MaxD = 256, typename F>
auto dispatch_head_size(int head_size, const char* what, F&& f) {
  if (head_size == 64) return f(HeadSize<64>{});
  if (head_size == 80) return f(HeadSize<80>{});
  if (head_size == 96) return f(HeadSize<96>{});
  if (head_size == 128) return f(HeadSize<128>{});
  if constexpr (MaxD >= 256) {
    if (head_size == 256) return f(HeadSize<256>{});
  }
  throw std::runtime_error(std::string(what) + ": unsupported head size " + std::to_string(head_size));
}

/// Returns f(TypeTag<T>{}) with T = __nv_bfloat16 or __half (the tensor-core dtypes); any other
/// dtype is a std::runtime_error naming `what` and the dtype.
template <typename F>
auto dispatch_mma_dtype(DType dtype, const char* what, F&& f) {
  if (dtype == DType::kBFloat16) return f(TypeTag<__nv_bfloat16>{});
  if (dtype == DType::kFloat16) return f(TypeTag<__half>{});
  throw std::runtime_error(std::string(what) + ": unsupported dtype " + dtype_name(dtype));
}

/// CTAs of `kernel` resident on the whole current device at once (occupancy per SM x SMs, at
/// least one per SM) with `threads` threads and `smem` bytes of dynamic shared memory; computed
/// once into `cache` (after raising the shared-memory limit, tracked in `raised`).
template <typename Kernel>
int resident_ctas(std::atomic<int>& cache, Kernel kernel, int threads, size_t smem,
                  std::atomic<uint64_t>& raised) {
  if (cache.load() > 0) return cache.load();
  set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, raised);
  int per_sm = 0, sms = 0, dev = 0;
  PAGEDLLM_CUDA_CHECK(cudaGetDevice(&dev));
  PAGEDLLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  PAGEDLLM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cache.store(std::max(1, per_sm) * sms);
  return cache.load();
}

/// kernel<<<grid, block, smem, stream>>>(args...) after raising its dynamic shared-memory limit
/// to `smem` (once per device, tracked in `raised`); the launch is checked.
template <typename... KArgs, typename... Args>
void launch_checked(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                    std::atomic<uint64_t>& raised, Args&&... args) {
  set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, raised);
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
  PAGEDLLM_CUDA_CHECK_LAUNCH();
}

}  // namespace pagedllm::cuda::detail
