// pagedllm/layer_ops.h — the elementwise parts of a Llama-family decoder layer, each one fused
// kernel instead of a chain of framework ops (vLLM's layernorm / activation / pos_encoding ops):
//
//   rms_norm            out = RMSNorm(input) * weight                   (Zhang & Sennrich 2019)
//   fused_add_rms_norm  residual += input; input = RMSNorm(residual) * weight   (in place)
//   silu_and_mul        out = SiLU(input[:, :I]) * input[:, I:]          (SwiGLU, Shazeer 2020)
//   rotary_embedding    query, key rotated in place by their positions    (RoFormer, Su et al.
//                       2021, section 3.4; GPT-NeoX "rotate half" layout, as HF Llama)
//   rotary_embedding_and_cache  the rotation fused with reshape_and_cache (cache_ops.h): rotated
//                       query to a new tensor, rotated key and the value into the paged caches
//
// Numerics: math in float32, results rounded to the tensor dtype at the points where Hugging Face
// transformers' eager modules round (LlamaRMSNorm: normalise in fp32, cast, then multiply by the
// weight in the model dtype; the residual add and SiLU(gate) are rounded before use; RoPE rounds
// q*cos and rotate_half(q)*sin before adding them). With fp32 tensors the only difference from
// HF is the summation order of the mean of squares; no multiply-add is contracted.
//
// Devices and dtypes (every tensor of one call has the same dtype; positions and slots: int64):
//   CPU  (cpp/src/cpu_layer_ops.cpp): float32, bfloat16; rms_norm, fused_add_rms_norm,
//        silu_and_mul, rotary_embedding. Rows of a [T, N] input may have any row stride (e.g. a
//        slice of a fused projection); the last dimension must be contiguous.
//   CUDA (cuda/rms_norm.cu, activation.cu, rotary_embedding.cu; a CUDA build): float32,
//        bfloat16, float16; rms_norm, fused_add_rms_norm, silu_and_mul on contiguous tensors, and
//        rotary_embedding_and_cache. Values inside device tensors (positions, slots) are not
//        checked on CUDA (that would synchronize the stream).
// An op called on a device it has no kernel for raises InvalidArgument saying so. Launchers
// validate every argument and throw InvalidArgument naming the bad value; `stream` is a
// cudaStream_t as an integer (0 = legacy default stream), ignored on the CPU. The CUDA kernels
// never synchronize, so CUDA graphs can capture them.
#pragma once

#include <cstdint>

#include "pagedllm/attention.h"
#include "pagedllm/tensor_view.h"

namespace pagedllm {

/// Whether this build has the CUDA kernels of this header.
bool layer_ops_built_with_cuda();

/// out [T, N] = input [T, N] / sqrt(mean(input^2, -1) + eps) * weight [N]. On CUDA, out and input
/// must not overlap.
/// fp8_out, fp8_scale (CUDA only; both or neither): also write scaled_fp8_quant(out) into them
/// (uint8 [T, N] e4m3 bits, float32 [T]), the bytes that kernel would give, in the same pass.
void rms_norm(const TensorView& out, const TensorView& input, const TensorView& weight, double eps,
              std::uintptr_t stream = 0, const TensorView* fp8_out = nullptr, const TensorView* fp8_scale = nullptr);

/// In place, per row: residual [T, N] = residual + input; input [T, N] = rms_norm(residual) * weight.
/// (vLLM's fused_add_rms_norm: the residual stream and the next sublayer's input in one pass.)
void fused_add_rms_norm(const TensorView& input, const TensorView& residual, const TensorView& weight,
                        double eps, std::uintptr_t stream = 0, const TensorView* fp8_out = nullptr,
                        const TensorView* fp8_scale = nullptr);

/// out [T, I] = SiLU(input[:, :I]) * input[:, I:] for input [T, 2I]; SiLU(x) = x / (1 + e^-x).
/// paired_rows (CUDA only; I % 8 == 0): input's columns are in the gate_up_paired_row order (the
/// output of a gate_up projection whose weight rows were so permuted), out in the standard order.
void silu_and_mul(const TensorView& out, const TensorView& input, std::uintptr_t stream = 0,
                  bool paired_rows = false);

/// Per-token dynamic FP8 quantization (CUDA only): scale[t] = max(max_k |input[t, k]| * float(1 / 448),
/// FLT_MIN), out[t, k] = e4m3(clamp(input[t, k] / scale[t], -448, 448)) (round to nearest even;
/// IEEE divisions). input bfloat16 / float16 / float32 [T, K] contiguous; out uint8 [T, K] (the
/// e4m3 bits: a float8_e4m3fn tensor viewed as uint8), contiguous; scale float32 [T] contiguous.
/// For quantization="fp8" (python/pagedllm/model_executor/quantization/fp8.py).
void scaled_fp8_quant(const TensorView& out, const TensorView& scale, const TensorView& input,
                      std::uintptr_t stream = 0);

/// Rotate query [T, Hq, D] and key [T, Hkv, D] in place (any token and head strides, contiguous
/// last dim) by positions int64 [T]: with R = cos_sin_cache.size(1) (rotary dims, even, <= D) and
/// cos = cos_sin_cache[p, :R/2], sin = cos_sin_cache[p, R/2:], for i < R/2
///   x[i]       = x[i] * cos[i] - x[i + R/2] * sin[i]
///   x[i + R/2] = x[i + R/2] * cos[i] + x[i] * sin[i]
/// and features >= R untouched. cos_sin_cache [max_position, R], contiguous, the dtype of query.
/// A position outside [0, max_position) is an error. CPU only so far (on CUDA:
/// rotary_embedding_and_cache).
void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin_cache, std::uintptr_t stream = 0);

/// The rotation of rotary_embedding (same roundings) fused with reshape_and_cache: the rotated
/// query goes to query_out, the rotated key and the value go straight into the paged caches;
/// query, key and value are only read. CUDA only so far.
///
///   positions  int64 [T], each in [0, max_position) (not checked on CUDA)
///   query      [T, Hq, D]; key, value [T, Hkv, D]: any token stride (views into a fused QKV
///              output), heads and features contiguous (stride(1) == D, stride(2) == 1)
///   cos_cache, sin_cache  [max_position, R/2] each, contiguous, the query's dtype (the two
///              halves of rotary_embedding's cos_sin_cache as separate tables)
///   query_out  [T, Hq, D], contiguous, not overlapping query
///   key_cache, value_cache  [num_blocks, Hkv, block_size, D] (pagedllm/cache_ops.h): the query's
///              dtype, or FP8 (attention.h), storing key / k_scale and value / v_scale of `scales`
///   slot_mapping  int64 [T]: a slot < 0 or >= num_blocks * block_size writes nothing to the
///              caches for that token (its query is still rotated)
///   paired_rows  false: query and key heads in the standard order; true: in the paired-rows
///              order of rotary_paired_row (a qkv projection whose weight rows were permuted so that
///              the GEMV's rope epilogue rotates in registers, GemvRope::paired_rows); needs full
///              rotary (R == D) and D % 16 == 0. query_out and the caches are in the standard order
///              either way.
void rotary_embedding_and_cache(const TensorView& positions, const TensorView& query,
                                const TensorView& key, const TensorView& value,
                                const TensorView& cos_cache, const TensorView& sin_cache,
                                const TensorView& query_out, const TensorView& key_cache,
                                const TensorView& value_cache, const TensorView& slot_mapping,
                                std::uintptr_t stream = 0, bool paired_rows = false,
                                const KVCacheScales& scales = {});

#if defined(__CUDACC__)
#define PAGEDLLM_HOST_DEVICE __host__ __device__
#else
#define PAGEDLLM_HOST_DEVICE
#endif

/// The paired-rows order of a rotated head of D = 2 * rot_half features (rot_half % 8 == 0): the
/// row that holds feature `feature`. Rotary pairs (j, j + rot_half) lie 8 rows apart inside one
/// 16-row tile — features 8t..8t+7 at rows 16t..16t+7 and rot_half+8t..rot_half+8t+7 at rows
/// 16t+8..16t+15 — which is where one lane's two accumulator rows (g, g + 8) of an m16n8k16 MMA
/// fall, so the GEMV rotates its output without leaving registers. A permutation of [0, D).
PAGEDLLM_HOST_DEVICE constexpr int rotary_paired_row(int feature, int rot_half) {
  const int second = feature >= rot_half ? 1 : 0;
  const int i = feature - second * rot_half;
  return 16 * (i / 8) + i % 8 + 8 * second;
}

/// The paired gate/up order of a fused gate_up projection of 2 * intermediate rows
/// (intermediate % 8 == 0): row `row` of the paired weight is row gate_up_paired_row(row,
/// intermediate) of the standard [gate; up] weight. Every 16-row tile holds 8 gate rows followed
/// by the 8 matching up rows — one lane's two accumulator rows (g, g + 8) of an m16n8k16 MMA — so
/// a GEMV CTA has both inputs of each SiLU(gate) * up output of its tile and writes the activation
/// itself (GemvFusion::silu_paired_rows): no silu_and_mul kernel. Output column c comes from
/// paired rows 16 (c / 8) + c % 8 (gate) and that + 8 (up). A permutation of [0, 2 * intermediate).
PAGEDLLM_HOST_DEVICE constexpr int64_t gate_up_paired_row(int64_t row, int64_t intermediate) {
  return (row % 16 < 8 ? 0 : intermediate) + 8 * (row / 16) + row % 8;
}

/// The paired gate/up order seen from the output: the paired row of output column `column`'s gate
/// (its up is that row + 8).
PAGEDLLM_HOST_DEVICE constexpr int64_t gate_up_paired_gate_row(int64_t column) {
  return 16 * (column / 8) + column % 8;
}

/// The output column of paired gate row `row` (row % 16 < 8): the inverse of gate_up_paired_gate_row.
PAGEDLLM_HOST_DEVICE constexpr int64_t gate_up_paired_column(int64_t row) { return 8 * (row / 16) + row % 8; }

}  // namespace pagedllm
