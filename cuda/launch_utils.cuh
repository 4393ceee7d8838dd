// cuda/launch_utils.cuh — internal host helpers shared by the CUDA kernel launchers: dispatch
// on head size and on the tensor-core dtype, the resident-CTA count of a kernel (occupancy x SMs),
// a checked launch that first raises the kernel's dynamic shared-memory limit, and a checked
// launch as a programmatic dependent of the previous kernel on the stream (PDL, sm_90).
// Include from .cu files only (kernel launches).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "attention_launch.h"
#include "cuda_check.h"
#include "pagedllm/cuda_runtime.h"

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

/// Device side of programmatic dependent launch (sm_90; no-ops elsewhere and in a kernel not
/// launched as a dependent). pdl_wait(): block this thread until every prerequisite grid has
/// completed and its memory operations are visible. pdl_launch_dependents(): allow the next
/// kernel, if launched by launch_pdl, to start once every CTA of this grid has called it (or
/// exited); it does not make this grid's writes visible (the dependent's pdl_wait does).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/// Whether programmatic dependent launch is used on the current device: compute capability >= 9
/// (read once, for the first device asked), the environment variable PAGEDLLM_NO_PDL unset and
/// not turned off at run time (pagedllm::cuda::set_pdl_enabled, cuda_runtime.h).
inline bool pdl_enabled() {
  static const bool enabled = [] {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
      return false;
    return major >= 9 && std::getenv("PAGEDLLM_NO_PDL") == nullptr;
  }();
  return enabled && ::pagedllm::cuda::pdl_enabled();
}

/// kernel<<<grid, block, smem, stream>>>(args...) through cudaLaunchKernelEx; when `pdl` (and
/// pdl_enabled()), as a programmatic dependent of the kernel before it on the stream
/// (cudaLaunchAttributeProgrammaticStreamSerialization; CUDA Programming Guide, "Programmatic
/// Dependent Launch and Synchronization"). Such a kernel may start once every CTA of the previous
/// kernel has called pdl_launch_dependents() (or exited), i.e. while that kernel still
/// runs: it must execute pdl_wait() before reading anything the
/// previous kernel writes, and before writing anything the previous kernel reads. Captured into
/// CUDA graphs as a programmatic edge. `raised`: as launch_checked. The launch is checked.
template <typename... KArgs, typename... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                std::atomic<uint64_t>& raised, bool pdl, Args&&... args) {
  set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, raised);
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl && pdl_enabled() ? 1 : 0;
  PAGEDLLM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  PAGEDLLM_CUDA_CHECK_LAUNCH();
}

}  // namespace pagedllm::cuda::detail
