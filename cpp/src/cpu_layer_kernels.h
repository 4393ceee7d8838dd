// cpu_layer_kernels.h — internal: the CPU implementations behind pagedllm/layer_ops.h
// (cpu_layer_ops.cpp). Arguments are already validated by the launchers in layer_ops.cpp.
#pragma once

#include "pagedllm/tensor_view.h"

namespace pagedllm::cpu {

void rms_norm(const TensorView& out, const TensorView& input, const TensorView& weight, float eps,
              int num_threads);

void fused_add_rms_norm(const TensorView& input, const TensorView& residual, const TensorView& weight,
                        float eps, int num_threads);

void silu_and_mul(const TensorView& out, const TensorView& input, int num_threads);

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin_cache, int num_threads);

}  // namespace pagedllm::cpu
