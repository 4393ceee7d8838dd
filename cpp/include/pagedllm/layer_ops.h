// pagedllm/layer_ops.h — the elementwise parts of a Llama-family decoder layer, each one fused
// kernel instead of a chain of framework ops (vLLM's layernorm / activation / pos_encoding ops):
//
//   rms_norm            out = RMSNorm(input) * weight                   (Zhang & Sennrich 2019)
//   fused_add_rms_norm  residual += input; input = RMSNorm(residual) * weight   (in place)
//   silu_and_mul        out = SiLU(input[:, :I]) * input[:, I:]          (SwiGLU, Shazeer 2020)
//   rotary_embedding    query, key rotated in place by their positions    (RoFormer, Su et al.
//                       2021, section 3.4; GPT-NeoX "rotate half" layout, as HF Llama)
//
// Numerics: math in float32, results rounded to the tensor dtype at the points where Hugging Face
// transformers' eager modules round (LlamaRMSNorm: normalise in fp32, cast, then multiply by the
// weight in the model dtype; the residual add and SiLU(gate) are rounded before use; RoPE rounds
// q*cos and rotate_half(q)*sin before adding them). With fp32 tensors the only difference from
// HF is the summation order of the mean of squares; no multiply-add is contracted.
//
// dtypes: float32 and bfloat16 on the CPU; every tensor of one call has the same dtype (positions:
// int64). Rows: a [T, N] input may have any row stride (e.g. a slice of a fused projection); the
// last dimension must be contiguous. Launchers validate every argument and throw InvalidArgument
// naming the bad value; `stream` is a cudaStream_t as an integer, ignored on the CPU. CUDA
// versions are not implemented yet: a CUDA tensor raises InvalidArgument.
#pragma once

#include <cstdint>

#include "pagedllm/tensor_view.h"

namespace pagedllm {

/// out [T, N] = input [T, N] / sqrt(mean(input^2, -1) + eps) * weight [N].
void rms_norm(const TensorView& out, const TensorView& input, const TensorView& weight, double eps,
              std::uintptr_t stream = 0);

/// In place, per row: residual [T, N] = residual + input; input [T, N] = rms_norm(residual) * weight.
/// (vLLM's fused_add_rms_norm: the residual stream and the next sublayer's input in one pass.)
void fused_add_rms_norm(const TensorView& input, const TensorView& residual, const TensorView& weight,
                        double eps, std::uintptr_t stream = 0);

/// out [T, I] = SiLU(input[:, :I]) * input[:, I:] for input [T, 2I]; SiLU(x) = x / (1 + e^-x).
void silu_and_mul(const TensorView& out, const TensorView& input, std::uintptr_t stream = 0);

/// Rotate query [T, Hq, D] and key [T, Hkv, D] in place (any token and head strides, contiguous
/// last dim) by positions int64 [T]: with R = cos_sin_cache.size(1) (rotary dims, even, <= D) and
/// cos = cos_sin_cache[p, :R/2], sin = cos_sin_cache[p, R/2:], for i < R/2
///   x[i]       = x[i] * cos[i] - x[i + R/2] * sin[i]
///   x[i + R/2] = x[i + R/2] * cos[i] + x[i] * sin[i]
/// and features >= R untouched. cos_sin_cache [max_position, R], contiguous, the dtype of query.
/// A position outside [0, max_position) is an error.
void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin_cache, std::uintptr_t stream = 0);

}  // namespace pagedllm
