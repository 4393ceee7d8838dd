// cuda/gemv_cuda.h — internal: the CUDA implementation behind pagedllm/gemv.h (only in a build
// with PAGEDLLM_WITH_CUDA). The launcher (cpp/src/gemv.cpp) has ALREADY validated every argument:
// bfloat16 / float16, one CUDA device, 1 <= M <= kGemvMaxTokens, N, K > 0, weight and out
// contiguous, input rows with stride(1) == 1, config fields in range.
#pragma once

#include <cstdint>

#include "pagedllm/gemv.h"
#include "pagedllm/tensor_view.h"

namespace pagedllm::cuda {

/// out = x @ weight^T (+ bias) (+ residual) with x = input, RMSNorm(input) or SiLU-and-mul of
/// input as `fusion` says (validated: not both prologues). Throws InvalidArgument when a staged
/// prologue does not fit the device's shared memory (see gemv_stage_fits).
void gemv(const TensorView& out, const TensorView& input, const TensorView& weight, const TensorView* bias,
          const GemvFusion& fusion, const GemvConfig& config, std::uintptr_t stream);

/// Whether a prologue fusion can stage M x K input elements of `elem_bytes` bytes in shared
/// memory on the current device (splitting K over up to 8 cluster CTAs on sm_90).
bool gemv_stage_fits(int64_t M, int64_t K, int elem_bytes);

}  // namespace pagedllm::cuda
