// pagedllm/attention.h — paged attention over the block-organised KV cache (PagedAttention,
// Kwon et al., SOSP 2023), for decode (one query token per sequence) and for variable-length
// prefill / mixed batches. The same contract on CPU (cpp/src) and CUDA (cuda/); the launchers
// declared here validate every argument and dispatch on the tensors' device.
//
// ---------------------------------------------------------------------------------------------
// KV cache layout (identical on CPU and CUDA)
//
//   per layer two tensors, key_cache and value_cache, each
//       [num_blocks, num_kv_heads, block_size, head_size]      row-major, contiguous
//
//   A token at slot s lives in block s / block_size, row s % block_size. A sequence's logical
//   block i is physical block block_tables[b][i]; its token at position p therefore lives in
//   block block_tables[b][p / block_size], row p % block_size.
//
// Why this layout: the unit every kernel reads is the (block, kv head) tile — block_size tokens x
// head_size elements — and here that tile is ONE contiguous run of block_size*head_size*elem
// bytes (e.g. 16 x 128 x 2 B = 4 KiB in bf16). On a GPU the threads of a warp read consecutive
// 16-byte vectors of it: fully coalesced, and a single TMA box / cp.async bulk copy per tile. On a
// CPU it is a unit-stride stream that the hardware prefetcher follows and that fits in L1, so
// the query heads of one KV head (GQA) can reuse it from cache. K and V share the layout, so the
// same address math serves QK^T (rows of K) and PV (rows of V).
//
// Sizes supported by both implementations: head sizes 32, 64, 80, 96, 128, 256; block sizes
// 16 and 32 (supported_head_sizes(), supported_block_sizes()); GQA/MQA with
// num_heads % num_kv_heads == 0. Dtypes: float32 and bfloat16 on CPU and CUDA, float16 on CUDA
// only; query / out then have the cache's dtype. All accumulation is in float32.
//
// FP8 caches (float8_e4m3fn, float8_e5m2; vLLM's kv_cache_dtype "fp8" / "fp8_e5m2"): a stored
// element c stands for c * k_scale (keys) or c * v_scale (values), per-tensor scales of the layer
// (KVCacheScales). The writers (reshape_and_cache, rotary_embedding_and_cache, the GEMV's rotary
// epilogue) store x / scale rounded to nearest-even and saturated to the format's largest finite
// value (448 for e4m3, 57344 for e5m2; NaN stays NaN). The attention kernels read the codes exactly
// (both formats are exact in bfloat16 / float16 / float32), fold k_scale into the softmax scale and
// v_scale into the output, and keep the softmax and every sum in float32: the result is attention
// over the dequantized cache. query / out are then float32 or bfloat16 on the CPU, bfloat16 or
// float16 on CUDA (fp8_query_dtypes()); CUDA's FP8 kernels take head sizes up to 128 (a larger one
// is an InvalidArgument). docs/fp8_kv_cache.md describes both devices' kernels.
// ---------------------------------------------------------------------------------------------
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagedllm/tensor_view.h"

namespace pagedllm {

/// Per-tensor dequantization scales of one layer's FP8 KV cache: key = code * k_scale, value =
/// code * v_scale. Each is a float32 one-element tensor on the cache's device (a host float on the
/// CPU), read by the kernels when they run, so a CUDA graph that captured a launch follows later
/// in-place updates (calculate_kv_scales). An unset view (data == nullptr) means 1.0. Values must
/// be finite and > 0 (checked on the CPU). Ignored for 16/32-bit caches.
struct KVCacheScales {
  TensorView k_scale;
  TensorView v_scale;
};

/// Options shared by the decode and prefill launchers.
struct AttentionOptions {
  /// Sliding-window attention (Mistral / Gemma-2 local layers): a query at position p attends
  /// keys at positions j with p - sliding_window < j <= p (the last `sliding_window` tokens,
  /// itself included). 0 = no window (full causal context). Must be >= 0.
  int32_t sliding_window = 0;
  /// Logit soft-capping (Gemma-2, section 3): score = soft_cap * tanh((q.k * scale) / soft_cap),
  /// applied after the softmax scale. 0 = off. Must be >= 0 and finite.
  float soft_cap = 0.0f;
  /// Decode only (paged_attention). Flash-decoding split-K (Dao et al., "Flash-Decoding for
  /// long-context inference", 2023): each sequence's context is cut into partitions processed in
  /// parallel, then combined by a log-sum-exp reduction. -1 = automatic (split when the batch is
  /// too small to fill the device), 0 = single pass, k > 0 = force a k-way split (partitions of
  /// whole blocks; partitions beyond the context are empty). Ignored by the prefill launcher.
  int32_t split_k = -1;
  /// Decode only, CUDA: caller-owned device scratch for the split-K partials (the call needs
  /// num_seqs * num_heads * splits * (head_size + 2) floats). When given, large enough and 16-byte
  /// aligned it is
  /// used instead of a stream-ordered allocation (cudaMallocAsync / cudaFreeAsync), so a CUDA graph
  /// of the call holds no memory nodes around the kernel; else the allocation as without it. The
  /// caller keeps it alive until the call's work is done and never shares it between streams.
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  /// Decode only, CUDA (the v2 kernel): the caller guarantees that of the KV cache this call reads,
  /// the kernels not yet complete on the stream write at most each sequence's last token (a decode
  /// step's KV-cache write by the kernel just before, as in a model's layer). The kernel then
  /// starts loading the rest of each context before it waits for the previous kernel
  /// (programmatic dependent launch), and only the tiles holding the last token after. Same
  /// results; false (the default) loads nothing before the wait.
  bool early_context_loads = false;
  /// FP8 caches: the layer's dequantization scales (unset: 1.0).
  KVCacheScales kv_scales;
};

/// Head sizes every implementation supports: {32, 64, 80, 96, 128, 256}.
const std::vector<int64_t>& supported_head_sizes();
/// Block sizes (tokens per KV block) every implementation supports: {16, 32}.
const std::vector<int64_t>& supported_block_sizes();

/// Cache dtypes the kernels of `device` implement: float32 and bfloat16 on the CPU; float32,
/// bfloat16 and float16 on CUDA; float8_e4m3fn and float8_e5m2 on both.
std::vector<DType> supported_cache_dtypes(DeviceType device);

/// Query / out dtypes the kernels of `device` take with an FP8 cache: float32 and bfloat16 on the
/// CPU; bfloat16 and float16 on CUDA (its tensor cores read the FP8 tiles as float16).
std::vector<DType> fp8_query_dtypes(DeviceType device);
/// Threads the CPU kernels (attention and cache ops) use. n <= 0 restores the default: all
/// available cores (omp_get_max_threads()). Ignored by the CUDA kernels.
void set_num_threads(int n);
/// The CPU kernels' current thread count (>= 1).
int get_num_threads();

/// True when the CPU attention kernels run bfloat16 caches of head size 64 and 128 on Intel AMX
/// tiles (a build for a CPU with AMX-BF16, the OS tile permission granted, and
/// PAGEDLLM_CPU_ATTENTION_AMX not "0"); otherwise they use AVX-512 (cpp/src/cpu_attention_amx.h).
bool cpu_attention_uses_amx();

/// Decode attention: one query token per sequence against its paged context.
///
///   out          [B, Hq, D]   dtype of the query, same device; written (every element)
///   query        [B, Hq, D]   dtype of the cache (an FP8 cache: see fp8_query_dtypes)
///   key_cache    [num_blocks, Hkv, block_size, D]  float32 | bfloat16 (| float16 on CUDA) |
///                float8_e4m3fn | float8_e5m2 (query / out then in fp8_query_dtypes(device))
///   value_cache  same shape and dtype as key_cache
///   block_tables int32 [B, M]  physical block ids; entries past a sequence's last block unused
///   seq_lens     int32 [B]     context length of each sequence, the query's own token included
///                              (0 <= seq_len <= M * block_size; seq_len 0 writes a zero row)
///   scale        softmax scale (usually 1/sqrt(D)), finite
///
/// The query of sequence b sits at position seq_lens[b] - 1. Query head h reads KV head
/// h / (Hq / Hkv). All tensors on one device (block_tables and seq_lens too) and contiguous, except
/// that on the CPU the query may have any token stride (its [Hq, D] rows contiguous).
/// B = 0 is a no-op. `stream` is a cudaStream_t as an integer, ignored on CPU.
/// Throws InvalidArgument naming the bad value for a wrong dtype, device, shape, head size,
/// block size, contiguity or option; on CPU also for out-of-range seq_lens / block ids.
void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, double scale, const AttentionOptions& options = {},
                     std::uintptr_t stream = 0);

/// What the last CUDA paged_attention call made by this thread ran (for tests and benchmarks; the
/// choice depends on the device, the shapes and PAGEDLLM_* environment settings):
///   kernel   "v2-warp", "v2-pair", "v2-cta" (decode v2 work items on one warp, two warps or a
///            whole CTA), "v1" (CTA per item), "fp32"; empty before the first call and in a
///            CPU-only build (an empty batch launches nothing and leaves the record as it was)
///   splits   flash-decoding partitions per sequence (1 = single pass)
///   combine  "none" (one partition), "kernel" (the split-K reduction kernel after the decode
///            kernel) or "in-kernel" (the last partition of each group to finish combines them
///            inside the decode kernel, arrival counters in a persistent zeroed buffer)
struct DecodePlanInfo {
  std::string kernel;
  int32_t splits = 0;
  std::string combine;
};
DecodePlanInfo last_cuda_decode_plan();

/// Variable-length causal attention over the paged context: chunked prefill, prefix-cache hits,
/// and decode rows mixed in, in one launch (FlashAttention-2 style online softmax,
/// Dao 2023, algorithm 1, per query tile).
///
///   out             [T, Hq, D]   T = total query tokens of the batch
///   query           [T, Hq, D]
///   key_cache, value_cache  as for paged_attention; this step's K/V must already be cached
///                           (reshape_and_cache first)
///   block_tables    int32 [B, M]
///   seq_lens        int32 [B]    context length of each sequence INCLUDING this chunk
///   query_start_loc int32 [B+1]  query rows of sequence b are [query_start_loc[b],
///                                query_start_loc[b+1]); query_start_loc[0] = 0,
///                                query_start_loc[B] = T, non-decreasing, q_len_b <= seq_lens[b]
///
/// Query row i of sequence b sits at position seq_lens[b] - q_len_b + i and attends to the
/// positions <= its own (and within the sliding window). options.split_k is ignored.
/// B = 0 or T = 0 is a no-op. Errors as for paged_attention (on CPU, query_start_loc values are
/// checked too).
void paged_prefill_attention(const TensorView& out, const TensorView& query,
                             const TensorView& key_cache, const TensorView& value_cache,
                             const TensorView& block_tables, const TensorView& seq_lens,
                             const TensorView& query_start_loc, double scale,
                             const AttentionOptions& options = {}, std::uintptr_t stream = 0);

}  // namespace pagedllm
