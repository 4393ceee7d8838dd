// cuda/pdl.cuh — internal: programmatic dependent launch (PDL, sm_90+) for the layer kernels and
// the GEMV: launch_dependent (launch_ex and the PDL switch live in launch_utils.cuh). Include from
// .cu files only.
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

// pdl_launch_dependents() / pdl_wait(): the device side, in launch_utils.cuh.
// pdl_enabled_for_current_device(), current_device_major() and launch_ex(): in launch_utils.cuh
// too (shared with the attention kernels' launch_pdl).

/// launch_ex with PDL when pdl_enabled_for_current_device(), no cluster.
template <typename... KArgs, typename... Args>
void launch_dependent(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      Args&&... args) {
  launch_ex(kernel, grid, block, smem, stream, pdl_enabled_for_current_device(), 1u, std::forward<Args>(args)...);
}

}  // namespace pagedllm::cuda::detail
