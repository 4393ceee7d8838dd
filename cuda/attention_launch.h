// cuda/attention_launch.h — internal: the kernel launchers behind pagedllm::cuda::paged_attention
// and paged_prefill_attention (cuda/paged_attention.cu picks one by dtype and head size).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "attention_common.cuh"
#include "pagedllm/tensor_view.h"

namespace pagedllm::cuda::detail {

/// Decode on tensor cores (bf16 / fp16): grid (num_splits, Hkv * ceil(G/16), B), one CTA per
/// (partition, KV head, 16 query heads of its group). Writes `out` when num_splits == 1, else the
/// partials (then splitk_reduce combines them).
void launch_decode_mma(DType dtype, int head_size, const AttnParams& p, cudaStream_t stream);

/// Decode with persistent work items (paged_decode_v2.cu): bf16 / fp16, head size <= 128.
/// items = B * Hkv * ceil(G/16) * num_splits, each owned by a team of warps_per_item warps
/// (1, 2 or kDecodeV2Warps = the whole CTA) that share its tiles and merge in shared memory.
/// Grid sized to decode_v2_units().
constexpr int kDecodeV2Warps = 4;
bool decode_v2_supports(DType dtype, int head_size);
/// (launch_decode_v2 and decode_v2_units read FP8 caches when p.kv_fp8 / kv_fp8 is set: then
/// `dtype` is the query's, bf16 or fp16.)
void launch_decode_v2(DType dtype, int head_size, const AttnParams& p, int warps_per_item, cudaStream_t stream);

/// Concurrent work units of each decode kernel on the current device (occupancy x SMs): teams of
/// warps_per_item warps for v2 (`group` = Hq / Hkv sizes the merge buffers of shared items), CTAs
/// for the CTA-per-item kernel and the float32 kernel.
int decode_v2_units(DType dtype, int head_size, int warps_per_item, int group, int kv_fp8 = 0);
int decode_v1_units(DType dtype, int head_size);
int attention_fp32_units(int head_size);

/// Varlen causal prefill / mixed batch on tensor cores (bf16 / fp16 queries; FP8 caches with p.kv_fp8).
void launch_prefill_mma(DType dtype, int head_size, const AttnParams& p, cudaStream_t stream);

/// float32 caches on CUDA cores, decode (query_start_loc == nullptr, split-K supported) or
/// prefill.
void launch_attention_fp32(int head_size, const AttnParams& p, cudaStream_t stream);

/// The split-K reduction takes one warp per (sequence, head) row up to this many partitions (its
/// lanes walk them in sequence), one CTA per row beyond (8 groups of threads walk them in parallel).
constexpr int kWarpReduceMaxSplits = 8;

/// Flash-decoding reduction: out[b, h] = sum_s w_s * partial_out[b, h, s] / sum_s w_s with
/// w_s = partial_sum * 2^(partial_max - max_s partial_max). An all-empty row is written as 0.
void launch_splitk_reduce(DType dtype, int head_size, const AttnParams& p, cudaStream_t stream);

/// In-kernel split-K combine (decode v2, AttnParams::split_counters): arrival counters, one per
/// (sequence, KV head, 16-head chunk) of a launch, from a persistent zeroed buffer of
/// kSplitCounterSlabs slabs of kSplitCountersPerSlab per device, one slab per stream
/// (cuda/split_counters.cu states the concurrency rule). Returns the calling stream's slab, or
/// nullptr when the reduction kernel must be used instead: `needed` > kSplitCountersPerSlab, every
/// slab taken by other streams, or the device's buffer not yet allocated while `stream` is
/// capturing a CUDA graph (it is allocated by the first call outside a capture).
constexpr int64_t kSplitCountersPerSlab = 16384;
constexpr int kSplitCounterSlabs = 64;
int* split_counters_for(cudaStream_t stream, int64_t needed);

/// Raise a kernel's dynamic shared-memory limit to `bytes`, once per device (`done_devices` is
/// the kernel's own bit set of devices already raised).
void set_max_dynamic_smem(const void* kernel, size_t bytes, std::atomic<uint64_t>& done_devices);

}  // namespace pagedllm::cuda::detail
