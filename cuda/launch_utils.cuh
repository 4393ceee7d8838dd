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

/// Returns f(HeadSize<D>{}) for head_size == D, D in {32, 64, 80, 96, 128, 256} and D <= MaxD;
/// any other head size is a std::runtime_error naming `what` and the head size.
template <int MaxD = 256, typename F>
auto dispatch_head_size(int head_size, const char* what, F&& f) {
  if (head_size == 32) return f(HeadSize<32>{});
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

/// Keep the current device's default memory pool from returning freed memory to the OS at
/// synchronizations (release threshold: unlimited), so stream-ordered scratch (cudaMallocAsync)
/// stays cheap; once per device, and not while `stream` captures a graph (then a later call does
/// it). Defined in paged_attention.cu.
void keep_pool_memory(cudaStream_t stream);

/// Whether launches on the current device should carry the PDL attribute: compute capability
/// >= 9, PAGEDLLM_NO_PDL unset, and not turned off by set_pdl_enabled(false) (cuda/pdl.cu).
bool pdl_enabled_for_current_device();

/// Compute capability major of the current device (cached per device; cuda/pdl.cu).
int current_device_major();

/// kernel<<<grid, block, smem, stream>>>(args...) through cudaLaunchKernelEx, with the PDL
/// attribute when `pdl` is true (see launch_pdl) and a (cluster_x, 1, 1) cluster when
/// cluster_x > 1; checked.
template <typename... KArgs, typename... Args>
void launch_ex(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
               unsigned cluster_x, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  unsigned n = 0;
  if (pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster_x > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = cluster_x;
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  config.attrs = attrs;
  config.numAttrs = n;
  PAGEDLLM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  PAGEDLLM_CUDA_CHECK_LAUNCH();
}

/// kernel<<<grid, block, smem, stream>>>(args...) after raising its dynamic shared-memory limit;
/// when `pdl` (and pdl_enabled_for_current_device()), as a programmatic dependent of the kernel
/// before it on the stream (cudaLaunchAttributeProgrammaticStreamSerialization; CUDA Programming
/// Guide, "Programmatic Dependent Launch and Synchronization"). Such a kernel may start once every
/// CTA of the previous kernel has called pdl_launch_dependents() (or exited), i.e. while that
/// kernel still runs: it must execute pdl_wait() before reading anything the previous kernel
/// writes, and before writing anything the previous kernel reads. Captured into CUDA graphs as a
/// programmatic edge. `raised`: as launch_checked. The launch is checked.
template <typename... KArgs, typename... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                std::atomic<uint64_t>& raised, bool pdl, Args&&... args) {
  set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, raised);
  launch_ex(kernel, grid, block, smem, stream, pdl && pdl_enabled_for_current_device(), 1u,
            std::forward<Args>(args)...);
}

}  // namespace pagedllm::cuda::detail
