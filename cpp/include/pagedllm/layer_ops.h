// pagedllm/layer_ops.h — the elementwise pieces of a decoder layer as fused kernels: RMSNorm
// (alone and with the residual add), SiLU-and-mul, and rotary position embeddings (alone, or
// fused with the KV-cache write). The names and semantics are vLLM's custom ops.
//
// Launchers validate every argument (throwing InvalidArgument that names the bad value) and
// dispatch on the tensors' device. Only CUDA kernels exist today (float32, bfloat16, float16):
// CPU tensors raise InvalidArgument saying so (the CPU model path uses PyTorch for these steps).
// `stream` is a cudaStream_t passed as an integer (0 = legacy default stream). The CUDA kernels
// never synchronize, so CUDA graphs can capture them. Values inside device tensors (positions,
// slots) are NOT checked on CUDA (that would sync the stream): see each function.
//
// Numerics follow Hugging Face transformers' Llama modules in the tensors' dtype T: every value
// a PyTorch op would round to T is rounded to T here too; arithmetic is float32 in between.
#pragma once

#include <cstdint>

#include "pagedllm/tensor_view.h"

namespace pagedllm {

/// Whether this build has the CUDA kernels of this header (a CUDA build normally does).
bool layer_ops_built_with_cuda();

/// RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4):
///   out[t] = T(T(input[t] * rsqrt(mean(input[t]^2) + eps)) * weight)
///
///   out, input  [num_tokens, hidden_size], one dtype, contiguous, distinct memory
///   weight      [hidden_size], same dtype and device
///   eps         >= 0, finite
/// num_tokens = 0 is a no-op.
void rms_norm(const TensorView& out, const TensorView& input, const TensorView& weight, double eps,
              std::uintptr_t stream = 0);

/// Residual add fused with RMSNorm, in place (vLLM's fused_add_rms_norm):
///   residual = T(residual + input);  input = rms_norm(residual) * weight
///
///   input, residual  [num_tokens, hidden_size], one dtype, contiguous, distinct memory
///   weight, eps      as rms_norm
void fused_add_rms_norm(const TensorView& input, const TensorView& residual, const TensorView& weight,
                        double eps, std::uintptr_t stream = 0);

/// SwiGLU's gate (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6), vLLM's silu_and_mul:
///   out[t, i] = T(T(silu(input[t, i])) * input[t, d + i]),  silu(x) = x / (1 + exp(-x))
///
///   input  [num_tokens, 2 * d] (gate | up), contiguous
///   out    [num_tokens, d], same dtype and device, contiguous
void silu_and_mul(const TensorView& out, const TensorView& input, std::uintptr_t stream = 0);

/// Rotary position embeddings (Su et al. 2021, "RoFormer", section 3.4) in the GPT-NeoX
/// "rotate half" layout, in place on query and key. With r = rotary_dim / 2 and, for position
/// p = positions[t], c = cos_cache[p, i], s = sin_cache[p, i] (i < r), every head's
///   x[i]     <- T(T(x[i] * c) - T(x[i + r] * s))
///   x[i + r] <- T(T(x[i + r] * c) + T(x[i] * s))
/// (HF's q * cos + rotate_half(q) * sin); features from rotary_dim on are left as they are.
///
///   positions  int64 [num_tokens], each in [0, max_positions) (NOT checked on CUDA)
///   query      [num_tokens, num_heads, head_size]; key [num_tokens, num_kv_heads, head_size];
///              any token stride (e.g. views into a fused QKV output), heads and features
///              contiguous (stride(1) == head_size, stride(2) == 1)
///   cos_cache, sin_cache  [max_positions, rotary_dim / 2], the query's dtype, contiguous
///              (llama3 / linear scaling is already in the tables); rotary_dim <= head_size
void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_cache, const TensorView& sin_cache,
                      std::uintptr_t stream = 0);

/// rotary_embedding fused with reshape_and_cache (pagedllm/cache_ops.h): the rotated query goes
/// to query_out, the rotated key and the value go straight into the paged caches; query, key
/// and value are only read.
///
///   positions, query, key, cos_cache, sin_cache  as rotary_embedding
///   value      [num_tokens, num_kv_heads, head_size], same layout rules as key
///   query_out  [num_tokens, num_heads, head_size], contiguous, not overlapping query
///   key_cache, value_cache  [num_blocks, num_kv_heads, block_size, head_size] (cache_ops.h)
///   slot_mapping  int64 [num_tokens]: slot < 0 or >= num_blocks * block_size writes nothing to
///              the caches for that token (its query is still rotated)
void rotary_embedding_and_cache(const TensorView& positions, const TensorView& query,
                                const TensorView& key, const TensorView& value,
                                const TensorView& cos_cache, const TensorView& sin_cache,
                                const TensorView& query_out, const TensorView& key_cache,
                                const TensorView& value_cache, const TensorView& slot_mapping,
                                std::uintptr_t stream = 0);

}  // namespace pagedllm
