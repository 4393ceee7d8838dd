// cuda/quant_ops_cuda.h — internal: the CUDA implementations behind pagedllm/quant_ops.h (built
// with PAGEDLLM_WITH_CUDA). The launchers (cpp/src/quant_ops.cpp) have validated every argument.
#pragma once

#include <cstdint>

#include "pagedllm/tensor_view.h"

namespace pagedllm::cuda {

void fp8_gemv(const TensorView& out, const TensorView& x, const TensorView& weight, const TensorView& scale,
              const TensorView* bias, std::uintptr_t stream);

void int4_dequantize(const TensorView& out, const TensorView& nibbles, const TensorView& scale_zero,
                     int64_t group_size, std::uintptr_t stream);

}  // namespace pagedllm::cuda
