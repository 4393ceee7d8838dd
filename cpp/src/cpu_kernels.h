// cpu_kernels.h — internal: the CPU implementations behind the launchers of
// pagedllm/attention.h and pagedllm/cache_ops.h. Arguments are already validated by the
// launchers (shapes, dtypes, devices, values of seq_lens / block ids / slots).
#pragma once

#include <cstdint>
#include <vector>

#include "pagedllm/attention.h"
#include "pagedllm/tensor_view.h"

namespace pagedllm::cpu {

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, float scale, const AttentionOptions& options,
                     int num_threads);

void paged_prefill_attention(const TensorView& out, const TensorView& query,
                             const TensorView& key_cache, const TensorView& value_cache,
                             const TensorView& block_tables, const TensorView& seq_lens,
                             const TensorView& query_start_loc, float scale,
                             const AttentionOptions& options, int num_threads);

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping,
                       const KVCacheScales& scales, int num_threads);

void copy_blocks(const std::vector<TensorView>& key_caches, const std::vector<TensorView>& value_caches,
                 const TensorView& block_mapping, int num_threads);

/// Host-to-host block copies (both caches on the CPU).
void swap_blocks(const TensorView& src, const TensorView& dst, const TensorView& block_mapping);

/// Number of split-K partitions the CPU decode kernel uses for this batch (>= 1).
int decode_num_splits(int64_t batch, int64_t max_seq_len, int split_k, int num_threads);

}  // namespace pagedllm::cpu
