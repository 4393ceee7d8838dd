// pagedllm/sampling_ops.h — kernels of the sampler's hot path.
//
//   argmax_rows  out[r] = the index of the largest of logits[r, :vocab] (the first one on a tie,
//                as torch.argmax); unlike torch.argmax, NaN is never chosen over a number (a
//                row of NaN only gives 0).
//
// dtypes: logits float32 or bfloat16 on the CPU, also float16 on CUDA (any row stride, contiguous
// last dimension); out int64 [R], contiguous, on the logits' device. On CUDA the kernel runs on
// `stream` (a cudaStream_t as an integer) without synchronizing. Launchers validate and throw
// InvalidArgument naming the bad value.
#pragma once

#include <cstdint>

#include "pagedllm/tensor_view.h"

namespace pagedllm {

/// out int64 [R] = argmax(logits [R, V][:, :vocab], -1); vocab in [1, V] (0 = all of V).
void argmax_rows(const TensorView& out, const TensorView& logits, int64_t vocab = 0, std::uintptr_t stream = 0);

}  // namespace pagedllm
