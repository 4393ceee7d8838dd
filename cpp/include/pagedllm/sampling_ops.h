// pagedllm/sampling_ops.h — kernels of the sampler's hot path.
//
//   argmax_rows  out[r] = the index of the largest of logits[r, :vocab] (the first one on a tie,
//                as torch.argmax); unlike torch.argmax, NaN is never chosen over a number (a
//                row of NaN only gives 0).
//   fill_placeholder_ids  input_ids[t] = sampled[prev_rows[t]] where prev_rows[t] >= 0: the
//                token ids that async scheduling left as placeholders (SchedulerOutput::
//                prev_sample_rows), taken from the previous step's sampled ids on the device.
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

/// input_ids int32 [T] (in place), prev_rows int32 [T], sampled int64 [R], contiguous, one device:
/// input_ids[t] = sampled[prev_rows[t]] for every prev_rows[t] >= 0. On the CPU a row >= R throws
/// InvalidArgument; on CUDA (no host read of prev_rows) such an entry is left unchanged.
void fill_placeholder_ids(const TensorView& input_ids, const TensorView& prev_rows, const TensorView& sampled,
                          std::uintptr_t stream = 0);

}  // namespace pagedllm
