// pagedllm/cpu_decoder.h — a Llama-family decoder stack run natively on the CPU, one call per
// step for all its layers: the same kernels the Python model calls one by one (layer_ops.h,
// cpu_linear.h, cache_ops.h, attention.h), in the same order and with the same roundings, without
// the interpreter between them. On a 2-core machine the Python glue between ~12 kernel calls per
// layer (building tensor views, allocating outputs, module calls) took ~15% of a 64-sequence
// SmolLM2 decode step. One pair is fused: gate_up and SiLU-and-mul run as amx_linear_silu_mul,
// which gives the bits of the two calls.
//
// Per layer, with hidden and residual [T, hidden_size] bfloat16 updated in place (vLLM's Llama
// with the residual stream carried beside the hidden state):
//   hidden = rms_norm(residual += hidden)                    (first layer: residual = hidden)
//   qkv = hidden W_qkv^T (+ b)                               [T, (Hq + 2 Hkv) D]
//   [Qwen3: q, k = rms_norm per head]
//   rotate q, k (RoPE, NeoX layout); write k, v into the layer's paged KV cache at slot_mapping
//   attn = paged attention of q (decode kernel when every sequence has one token, else prefill)
//   hidden = attn W_o^T; hidden = rms_norm(residual += hidden)
//   hidden = (SiLU(gate) * up)(hidden W_gate_up^T (+ b)) W_down^T (+ b)
// After the last layer, the stream is residual + hidden (added by the final norm).
//
// Projections use AMX-packed weights (amx_pack_linear_weight), so the stack needs AMX and at most
// kCpuDecoderMaxTokens tokens per step (larger steps take the Python path's oneDNN projections).
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "pagedllm/attention.h"
#include "pagedllm/tensor_view.h"

namespace pagedllm {

/// Steps of more tokens than this go through the Python path (oneDNN projections for prefill).
constexpr int64_t kCpuDecoderMaxTokens = 128;

struct CpuDecoderConfig {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_heads = 0;     // Hq
  int64_t num_kv_heads = 0;  // Hkv, divides Hq
  int64_t head_dim = 0;      // D
  double rms_norm_eps = 1e-6;
  double scale = 0.0;        // softmax scale, usually D^-0.5
};

/// One layer's operands (views of tensors the caller keeps alive), all bfloat16 on the CPU except
/// the biases (float32 or bfloat16).
struct CpuDecoderLayer {
  TensorView input_norm;                 // [hidden_size]
  TensorView qkv;                        // packed [(Hq + 2 Hkv) D / 32, hidden_size / 32, 2, 16, 32]
  std::optional<TensorView> qkv_bias;    // [(Hq + 2 Hkv) D] (Qwen2)
  std::optional<TensorView> q_norm;      // [D] (Qwen3; with k_norm)
  std::optional<TensorView> k_norm;      // [D]
  TensorView o;                          // packed, [hidden_size / 32, Hq D / 32, ...]
  TensorView post_norm;                  // [hidden_size]
  TensorView gate_up;                    // packed, [2 intermediate / 32, hidden_size / 32, ...]
  std::optional<TensorView> gate_up_bias;
  TensorView down;                       // packed, [hidden_size / 32, intermediate / 32, ...]
  std::optional<TensorView> down_bias;
  TensorView key_cache, value_cache;     // [num_blocks, Hkv, block_size, D], bfloat16 or FP8
  KVCacheScales kv_scales;               // FP8 caches: the layer's scales (attention.h); unset = 1.0
  int32_t sliding_window = 0;            // 0 = full causal context
};

/// One step's batch: positions int64 [T], slot_mapping int64 [T], block_tables int32 [S, M],
/// seq_lens int32 [S], query_start_loc int32 [S + 1]; decode_only: every sequence has one query
/// token (T == S). As paged_attention / paged_prefill_attention define them.
struct CpuDecoderStep {
  TensorView positions, slot_mapping, block_tables, seq_lens, query_start_loc;
  bool decode_only = false;
};

/// The layers of one model plus the scratch activations of a step (reused across calls; one call
/// at a time per stack: a concurrent forward throws).
class CpuDecoderStack {
 public:
  /// Checks every operand's dtype, device and shape against cfg (InvalidArgument naming the layer
  /// and operand) and that AMX is available. cos_sin_cache [max_position, R] bfloat16 (RoPE table
  /// of rotary_embedding, R even and <= head_dim). The step's tensors are checked by the kernels.
  CpuDecoderStack(const CpuDecoderConfig& cfg, std::vector<CpuDecoderLayer> layers, const TensorView& cos_sin_cache);

  /// Layers [start, end) over hidden and residual [T, hidden_size] bfloat16, contiguous, in place
  /// (T <= kCpuDecoderMaxTokens; hidden and residual must not overlap). has_residual false:
  /// residual's contents are ignored and it receives the stream before layer `start` (= hidden),
  /// as for the first layer.
  void forward(int64_t start, int64_t end, const TensorView& hidden, const TensorView& residual, bool has_residual,
               const CpuDecoderStep& step);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  CpuDecoderConfig cfg_;
  std::vector<CpuDecoderLayer> layers_;
  TensorView cos_sin_cache_;
  // scratch, [kCpuDecoderMaxTokens x width] bfloat16 each
  std::vector<uint16_t> qkv_, q_, k_, attn_, act_;
  std::mutex busy_;  // held by forward
};

}  // namespace pagedllm
