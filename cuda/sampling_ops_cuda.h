// cuda/sampling_ops_cuda.h — internal: the CUDA implementation behind pagedllm/sampling_ops.h
// (only in a build with PAGEDLLM_WITH_CUDA). Not installed, not public.
//
// The launcher (cpp/src/sampling_ops.cpp) has ALREADY validated the arguments: logits [R, V]
// float32 / bfloat16 / float16 on one CUDA device with a contiguous last dimension (any row
// stride), out int64 [R] contiguous on the same device, R > 0, 1 <= vocab <= V.
#pragma once

#include <cstdint>

#include "pagedllm/tensor_view.h"

namespace pagedllm::cuda {

/// out[r] = argmax(logits[r, :vocab]); launches on `stream`, never synchronizes.
void argmax_rows(const TensorView& out, const TensorView& logits, int64_t vocab, std::uintptr_t stream);

/// input_ids[t] = sampled[prev_rows[t]] where 0 <= prev_rows[t] < R (validated shapes and dtypes:
/// int32 [T], int32 [T], int64 [R], T > 0); launches on `stream`, never synchronizes.
void fill_placeholder_ids(const TensorView& input_ids, const TensorView& prev_rows, const TensorView& sampled,
                          std::uintptr_t stream);

}  // namespace pagedllm::cuda
