// cuda/pdl.cuh — internal: programmatic dependent launch (PDL, sm_90+) and a checked
// cudaLaunchKernelEx with optional cluster dimensions. Include from .cu files only.
//
// PDL (CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization"): a kernel
// launched with cudaLaunchAttributeProgrammaticStreamSerialization may start while the previous
// kernel in the stream is still running, once every CTA of that kernel has called
// pdl_launch_dependents() (or exited). The dependent must call pdl_wait() — which returns when the
// previous grid has completed and its memory is visible — before it reads anything the previous
// kernel writes and before it writes anything the previous kernel may still read. Work that
// depends on neither (loading or L2-prefetching weights) may come before it.
//
// Rules every PDL-launched kernel here keeps:
//   * every CTA executes pdl_wait() on every path (also CTAs with no work): the completion of a
//     grid then implies the completion of the grid before it, so ordering stays transitive along
//     a chain of PDL launches;
//   * all global writes, and all reads of data produced by earlier kernels, come after pdl_wait().
// Under stream capture the launch becomes a programmatic edge of the CUDA graph (CUDA >= 12.3).
// On devices below sm_90, or with PAGEDLLM_NO_PDL set in the environment, or after
// pagedllm::cuda::set_pdl_enabled(false), kernels are launched plainly (the device-side
// instructions are then no-ops).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda_check.h"
#include "launch_utils.cuh"

namespace pagedllm::cuda::detail {

// pdl_launch_dependents() / pdl_wait(): the device side, in launch_utils.cuh (shared with the
// attention kernels, whose launch_pdl also follows pagedllm::cuda::pdl_enabled()).

/// Whether launches on the current device should carry the PDL attribute: compute capability
/// >= 9, PAGEDLLM_NO_PDL unset, and not turned off by set_pdl_enabled(false) (cuda/pdl.cu).
bool pdl_enabled_for_current_device();

/// Compute capability major of the current device (cached per device).
int current_device_major();

/// kernel<<<grid, block, smem, stream>>>(args...) through cudaLaunchKernelEx, with the PDL
/// attribute when `pdl` is true and a (cluster_x, 1, 1) cluster when cluster_x > 1; checked.
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

/// launch_ex with PDL when pdl_enabled_for_current_device(), no cluster.
template <typename... KArgs, typename... Args>
void launch_dependent(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      Args&&... args) {
  launch_ex(kernel, grid, block, smem, stream, pdl_enabled_for_current_device(), 1u, std::forward<Args>(args)...);
}

}  // namespace pagedllm::cuda::detail
