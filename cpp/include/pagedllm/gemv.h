// pagedllm/gemv.h — matrix-vector products for decode steps with few tokens (CUDA only):
//
//   gemv               out [M, N] = input [M, K] @ weight [N, K]^T (+ bias [N])
//   silu_and_mul_gemv  out [M, N] = (SiLU(input[:, :K]) * input[:, K:]) @ weight [N, K]^T (+ bias)
//                      (layer_ops.h's silu_and_mul fused into the product: a Llama MLP's
//                      down projection reads the gate_up output directly)
//   gemv with a GemvFusion: any of
//     prologue  x = RMSNorm(input) = T(T(input * rsqrt(mean(input^2) + eps)) * norm_weight) per
//               token row (layer_ops.h's rms_norm fused in: a decoder layer's input norm before
//               the qkv / gate_up projection, the final norm before the LM head), or
//               x = SiLU(gate) * up as silu_and_mul_gemv;
//     epilogue  out = T(T(x @ weight^T + bias) + residual [M, N]); residual may be out itself
//               (in-place update of the residual stream after the o / down projection: the
//               residual add of fused_add_rms_norm fused in).
//   The prologues stage x in shared memory once per CTA (every CTA recomputes the row's sum of
//   squares; no cross-CTA dependency); when M x K does not fit, K is split over more cluster CTAs.
//   rope      (GemvRope) out is a fused qkv projection [M, (Hq + 2 Hkv) * D]; after it, the
//             rotary embedding and the paged KV-cache write of layer_ops.h's
//             rotary_embedding_and_cache run in the same kernel: the CTA that finishes the last
//             row tile of a head (a per-head arrival counter) rotates that head for every token
//             into query_out or the key cache, or copies it to the value cache (out keeps the
//             unrotated qkv). Same roundings as rotary_embedding_and_cache: bit for bit. Saves that
//             kernel and its boundary (~3.8 us per decode layer at batch 1 on the H200).
//             With paired_rows the weight's query and key rows come in layer_ops.h's
//             rotary_paired_row order, which puts both features of every rotary pair in one lane's
//             accumulators: each CTA rotates its own rows and writes query_out and the caches in
//             the standard order — no counters, no cross-CTA step (out keeps the unrotated qkv in
//             the paired order). Bit for bit equal to the standard order with the unpermuted
//             weight. Needs full rotary (rotary_dim == head_size).
//   silu_paired_rows  weight (and bias) rows of a fused gate_up projection in layer_ops.h's
//             gate_up_paired_row order (16-row tiles of 8 gate rows and their 8 up rows): out is
//             [M, N / 2] = SiLU(gate) * up, computed by each CTA from its own rows (layer_ops.h's
//             silu_and_mul fused in as an epilogue, no cross-CTA step). Rounds as gemv on the
//             standard-order weight followed by silu_and_mul: bit for bit. N % 16 == 0.
//
// M (tokens) is 1..kGemvMaxTokens. At these sizes a linear layer only streams its weight once, so
// the kernel is built for memory bandwidth: 16-byte weight loads, several in flight per thread,
// that skip L1; the product on the tensor cores (mma.sync m16n8k16, fp32 accumulation) with the
// tokens as the n = 8 dimension; K split across the warps of a CTA and, when N is small, across
// the CTAs of a thread-block cluster (sm_90) reduced through distributed shared memory. On sm_90
// the kernel is launched as a programmatic dependent (cuda_runtime.h: pdl_enabled): it requests
// its first weights while the previous kernel finishes, then waits for its input.
//
// Numerics: products and sums in float32 (the summation order differs from cuBLAS), bias added in
// float32, one rounding to the output dtype — as F.linear / cuBLAS round. silu_and_mul_gemv rounds
// SiLU(gate) and SiLU(gate) * up to the dtype exactly as silu_and_mul does, so it equals
// silu_and_mul followed by gemv (same config) bit for bit. The residual epilogue rounds as gemv
// followed by fused_add_rms_norm's add: bit for bit. The RMSNorm prologue rounds as rms_norm, but
// sums the squares in another order, so inv (fp32) can differ in the last bit and a normalised
// element by one ulp of the dtype where its rounding was a near tie: within the dtype's rounding
// of rms_norm + gemv, equal in the vast majority of elements.
//
// Arguments (launchers validate all, throwing InvalidArgument naming the bad value):
//   input   [M, K] (silu_and_mul_gemv: [M, 2K]) bfloat16 or float16 (float32 is refused: use
//           F.linear), on a CUDA device; rows may be strided (stride(1) == 1)
//   weight  [N, K], contiguous, same dtype and device
//   bias    nullptr or [N], contiguous, same dtype and device
//   out     [M, N], contiguous, same dtype and device, not overlapping input, weight, bias or
//           norm_weight; or float32: each element rounded to the input dtype, then stored as
//           float32 (= the dtype's out followed by .float(), without that kernel; an LM head's
//           logits), not with a residual or rope
//   fusion.norm_weight  nullptr or [K], contiguous, same dtype and device (not with silu_and_mul);
//           fusion.eps >= 0, finite
//   fusion.residual     nullptr or [M, N], contiguous, same dtype and device; either exactly out
//           (same data and shape) or not overlapping it
//   fusion.silu_paired_rows  out [M, N / 2] in the input's dtype; N % 16 == 0; not with a
//           residual, rope, silu_and_mul or a float32 out
//   fusion.rope         nullptr, or every field as rotary_embedding_and_cache takes it with query,
//           key and value the three parts of out, plus counters int32 [>= Hq + 2 Hkv] on the device,
//           all zero (every call leaves them zero; one call at a time per counters tensor; not
//           needed with paired_rows); head_size a multiple of 32; not with a residual
//   stream  a cudaStream_t as an integer (0 = legacy default stream); never synchronizes, so
//           CUDA graphs can capture it.
// K and N may be any positive size; rows whose byte size is a multiple of 16 (K % 8 == 0) with
// 16-byte aligned pointers take the vector path, others a slower element-wise path.
#pragma once

#include <cstdint>

#include "pagedllm/attention.h"
#include "pagedllm/tensor_view.h"

namespace pagedllm {

/// The most tokens (rows of input) the GEMV kernels take.
inline constexpr int kGemvMaxTokens = 8;

/// Tuning override for benchmarks; zero / negative fields mean "choose automatically".
struct GemvConfig {
  int variant = 0;   ///< 1: 16 rows per CTA, 4 chunks of 32 columns per group; 2: 32 rows, 2 chunks;
                     ///< 3: 16 rows, 2 chunks (fewer registers: more CTAs per SM); 0: automatic — 1,
                     ///< or 3 for short rows with many tiles and, with warps and splits automatic too,
                     ///< where 3 fits the row tiles in one wave and 1 does not (rows with K % 8 != 0
                     ///< always use 3)
  int warps = 0;     ///< warps per CTA (1..8); 0: automatic
  int splits = 0;    ///< CTAs (a cluster, sm_90 only) splitting K for one row tile (1, 2, 4, 8); 0: auto
  int prefetch = -1; ///< 1/0: do / don't prefetch the weight slice into L2 first; -1: automatic
};

/// The rotary + KV-cache epilogue of a fused qkv projection (see the header comment).
struct GemvRope {
  int num_heads = 0;                           ///< Hq; out has (Hq + 2 * Hkv) * head_size columns
  int num_kv_heads = 0;                        ///< Hkv (= key_cache.size(1)); head_size = key_cache.size(3)
  const TensorView* positions = nullptr;       ///< int64 [M]
  const TensorView* cos_cache = nullptr;       ///< [max_position, rotary_dim / 2], out's dtype
  const TensorView* sin_cache = nullptr;
  const TensorView* query_out = nullptr;       ///< [M, Hq, head_size], contiguous: the rotated query
  const TensorView* key_cache = nullptr;       ///< [num_blocks, Hkv, block_size, head_size]
  const TensorView* value_cache = nullptr;
  const TensorView* slot_mapping = nullptr;    ///< int64 [M]; a slot < 0 writes no key / value
  const TensorView* counters = nullptr;        ///< int32 [>= Hq + 2 * Hkv], zero before and after
                                               ///< (unused with paired_rows: may be nullptr)
  bool paired_rows = false;                    ///< weight rows of the query and key heads permuted
                                               ///< to layer_ops.h's rotary_paired_row order
  KVCacheScales kv_scales;                     ///< FP8 caches: key / k_scale, value / v_scale stored
};

/// What the GEMV does around the product (see the header comment); the defaults do nothing.
struct GemvFusion {
  const TensorView* norm_weight = nullptr;  ///< [K]: x = RMSNorm(input) * norm_weight
  float eps = 1e-6f;                        ///< RMSNorm epsilon (with norm_weight)
  bool silu_and_mul = false;                ///< input [M, 2K]: x = SiLU(input[:, :K]) * input[:, K:]
  const TensorView* residual = nullptr;     ///< [M, N]: out = T(T(x @ W^T + bias) + residual)
  const GemvRope* rope = nullptr;           ///< rotary + KV-cache write of a qkv projection
  bool silu_paired_rows = false;            ///< weight in gate_up_paired_row order: out [M, N / 2] =
                                            ///< SiLU(gate) * up (the SiLU-and-mul epilogue)
};

/// Whether this build has the GEMV kernels (a CUDA build).
bool gemv_built_with_cuda();

/// Whether a prologue fusion (norm_weight or silu_and_mul) fits the current CUDA device's shared
/// memory for `tokens` rows of `in_features` elements of `dtype` (false without CUDA).
bool gemv_fusion_fits(int64_t tokens, int64_t in_features, DType dtype);

/// out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]) (+ residual), x = input or the prologue
/// of `fusion` applied to it; see the header comment.
void gemv(const TensorView& out, const TensorView& input, const TensorView& weight, const TensorView* bias,
          std::uintptr_t stream = 0, const GemvConfig* config = nullptr, const GemvFusion* fusion = nullptr);

/// out [M, N] = (SiLU(input[:, :K]) * input[:, K:]) @ weight [N, K]^T (+ bias [N]) for input [M, 2K].
void silu_and_mul_gemv(const TensorView& out, const TensorView& input, const TensorView& weight,
                       const TensorView* bias, std::uintptr_t stream = 0, const GemvConfig* config = nullptr);

}  // namespace pagedllm
