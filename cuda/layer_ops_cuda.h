// cuda/layer_ops_cuda.h — internal: the CUDA implementations behind pagedllm/layer_ops.h (only in a
// build with PAGEDLLM_WITH_CUDA). Not installed, not public.
//
// The launchers (cpp/src/layer_ops.cpp) have ALREADY validated every argument: one float dtype
// (float32 / bfloat16 / float16), one CUDA device, shapes and strides as documented in
// pagedllm/layer_ops.h, num_tokens > 0. The implementations launch on `stream`, never
// synchronize, and check every launch (cuda_check.h).
#pragma once

#include <cstdint>

#include "pagedllm/attention.h"
#include "pagedllm/tensor_view.h"

namespace pagedllm::cuda {

/// residual == nullptr: out = rms_norm(input) * weight. Otherwise (out == input, in place):
/// residual += input; input = rms_norm(residual) * weight. fp8_out (uint8 [T, N]) and fp8_scale
/// (float32 [T]), both or neither: also the per-token FP8 codes of the output.
void rms_norm(const TensorView& out, const TensorView& input, const TensorView* residual,
              const TensorView& weight, float eps, std::uintptr_t stream, const TensorView* fp8_out = nullptr,
              const TensorView* fp8_scale = nullptr);

void silu_and_mul(const TensorView& out, const TensorView& input, std::uintptr_t stream, bool paired_rows);

/// out uint8 [T, K] (e4m3 bits), scale float32 [T] <- input [T, K] (contiguous), per row.
void scaled_fp8_quant(const TensorView& out, const TensorView& scale, const TensorView& input, std::uintptr_t stream);

/// query_out == nullptr: rotate query and key in place (value, caches and slot_mapping unused,
/// nullptr). Otherwise: rotated query -> query_out; rotated key and value -> the caches, query and
/// key read in the paired-rows order when paired_rows (fused form only).
void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView* value, const TensorView& cos_cache, const TensorView& sin_cache,
                      const TensorView* query_out, const TensorView* key_cache,
                      const TensorView* value_cache, const TensorView* slot_mapping,
                      std::uintptr_t stream, bool paired_rows = false, const KVCacheScales* scales = nullptr);

}  // namespace pagedllm::cuda
