// pagedllm/quant_ops.h — CUDA kernels of the quantized linear methods
// (python/pagedllm/model_executor/quantization/fp8.py, woq_cuda.py).
//
//   fp8_gemv          out [M, N] = x [M, K] @ (e4m3 weight [N, K] * scale[n])^T + bias   (M <= 8)
//                     the weight-only decode path of quantization="fp8": bf16/fp16 activations as
//                     they are (no activation quantization), fp32 accumulation, one rounding
//   int4_dequantize   out [N, K] = (q[n, k] - 8) * scale[k / g, n] + zero[k / g, n]   (bfloat16)
//                     the dequantizing path of 4-bit weights for large steps (then one cuBLAS GEMM)
//
// Why: a decode step reads every weight once, so its time is the weight bytes over the memory
// bandwidth; cuBLASLt's FP8 GEMM at a handful of rows reads them at ~1.8 TB/s of the H200's
// ~4.8 (measured: 27.7 us per 4096 x 4096-class GEMM at M = 1), and PyTorch's elementwise
// dequantization of 4 bits wrote float32 temporaries eight times the int4 weight's size.
//
// dtypes and layouts: x bfloat16 / float16 [M, K] contiguous rows (any row stride), K % 16 == 0;
// weight uint8 [N, K] contiguous (float8_e4m3fn bits); scale float32 [N]; bias nullptr or x's
// dtype [N]; out x's dtype [M, N] contiguous rows. int4: nibbles uint8 [N, K / 2] contiguous, input
// 2j in the high nibble and 2j + 1 in the low one; scale_zero bfloat16 [K / g, N, 2] contiguous;
// out bfloat16 [N, K] contiguous; g a multiple of 16 dividing K. CUDA only; launchers validate
// and throw InvalidArgument naming the bad value.
#pragma once

#include <cstdint>

#include "pagedllm/tensor_view.h"

namespace pagedllm {

/// Rows of x fp8_gemv takes at most.
constexpr int64_t kFp8GemvMaxTokens = 8;

void fp8_gemv(const TensorView& out, const TensorView& x, const TensorView& weight, const TensorView& scale,
              const TensorView* bias, std::uintptr_t stream = 0);

void int4_dequantize(const TensorView& out, const TensorView& nibbles, const TensorView& scale_zero,
                     int64_t group_size, std::uintptr_t stream = 0);

}  // namespace pagedllm
