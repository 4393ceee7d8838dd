// cuda/gemv_cuda.h — internal: the CUDA implementation behind pagedllm/gemv.h (only in a build
// with PAGEDLLM_WITH_CUDA). The launcher (cpp/src/gemv.cpp) has ALREADY validated every argument:
// bfloat16 / float16, one CUDA device, 1 <= M <= kGemvMaxTokens, N, K > 0, weight and out
// contiguous, input rows with stride(1) == 1, config fields in range.
#pragma once

#include <cstdint>

#include "pagedllm/gemv.h"
#include "pagedllm/tensor_view.h"

namespace pagedllm::cuda {

/// silu == false: out = input @ weight^T (+ bias). silu == true: input is [M, 2K] and the product
/// uses SiLU(input[:, :K]) * input[:, K:] rounded as silu_and_mul rounds.
void gemv(const TensorView& out, const TensorView& input, const TensorView& weight, const TensorView* bias,
          bool silu, const GemvConfig& config, std::uintptr_t stream);

/// cp.async.bulk.prefetch.L2 over [data, data + bytes) (16-byte aligned pieces inside it).
void l2_prefetch(const void* data, int64_t bytes, std::uintptr_t stream);

}  // namespace pagedllm::cuda
