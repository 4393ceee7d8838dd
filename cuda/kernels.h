// cuda/kernels.h — internal: the CUDA implementations the launchers in cpp/src call (only in a
// build with PAGEDLLM_WITH_CUDA). Not installed, not public.
//
// The launchers (cpp/src/attention.cpp, cpp/src/cache_ops.cpp) have ALREADY validated every
// argument before calling these: dtypes agree (float32 / bfloat16 / float16), all tensors are
// contiguous and on one CUDA device (swap_blocks: src or dst on CUDA, block_mapping on the host),
// shapes agree as documented in pagedllm/attention.h and pagedllm/cache_ops.h, head size and
// block size are supported, B / T / C > 0, options are in range. Values inside device tensors
// (seq_lens, block ids, slots) are NOT checked on CUDA — reading them would sync the stream.
// The implementations launch on `stream` (a cudaStream_t as an integer), never synchronize, and
// check every launch (cuda_check.h), so that CUDA graphs can capture them.
//
// Owner: the CUDA kernel engineer (cudakern); the definitions live in cuda/*.cu.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedllm/attention.h"
#include "pagedllm/tensor_view.h"

namespace pagedllm::cuda {

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping,
                       const KVCacheScales& scales, std::uintptr_t stream);

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, float scale, const AttentionOptions& options,
                     std::uintptr_t stream);

/// What this thread's last paged_attention call ran (pagedllm::last_cuda_decode_plan).
DecodePlanInfo last_decode_plan();

void paged_prefill_attention(const TensorView& out, const TensorView& query,
                             const TensorView& key_cache, const TensorView& value_cache,
                             const TensorView& block_tables, const TensorView& seq_lens,
                             const TensorView& query_start_loc, float scale,
                             const AttentionOptions& options, std::uintptr_t stream);

/// key_caches.size() == value_caches.size() >= 1; block_mapping int64 [C, 2] on the device.
void copy_blocks(const std::vector<TensorView>& key_caches, const std::vector<TensorView>& value_caches,
                 const TensorView& block_mapping, std::uintptr_t stream);

/// block_mapping int64 [C, 2] on the host; src/dst any mix of host and device memory.
void swap_blocks(const TensorView& src, const TensorView& dst, const TensorView& block_mapping,
                 std::uintptr_t stream);

}  // namespace pagedllm::cuda
