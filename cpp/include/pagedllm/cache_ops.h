// pagedllm/cache_ops.h — writing into and moving blocks of the paged KV cache.
//
// The cache layout is documented in pagedllm/attention.h:
//   key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_size], contiguous;
//   slot s = block * block_size + row.
// Launchers validate every argument (throwing InvalidArgument that names the bad value) and
// dispatch on the caches' device: CPU kernels in cpp/src, CUDA kernels in cuda/. `stream` is a
// cudaStream_t passed as an integer (0 = legacy default stream); ignored on CPU.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "pagedllm/attention.h"
#include "pagedllm/tensor_view.h"

namespace pagedllm {

/// Shape of one layer's key (or value) cache: {num_blocks, num_kv_heads, block_size, head_size}.
/// Throws InvalidArgument for a non-positive size, an unsupported block size or head size.
std::array<int64_t, 4> kv_cache_shape(int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
                                      int64_t head_size);

/// Write this step's keys and values into the cache (vLLM's reshape_and_cache).
///
///   key, value    [T, Hkv, D]   the cache's dtype (an FP8 cache: one of attention.h's
///                               fp8_query_dtypes) and device, contiguous (on the CPU: any token
///                               stride, [Hkv, D] rows contiguous: views of a fused QKV)
///   key_cache, value_cache  [num_blocks, Hkv, block_size, D]
///   slot_mapping  int64 [T]     slot of each token, same device; slot < 0 skips the token
///                               (padding); slot >= num_blocks * block_size is an error (checked
///                               on CPU; on CUDA such a slot is skipped)
///   scales        FP8 caches: the stored code is key / k_scale (value / v_scale), rounded to
///                 nearest-even and saturated to the format's largest finite value (attention.h);
///                 ignored for 16/32-bit caches
/// T = 0 is a no-op.
void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping,
                       const KVCacheScales& scales = {}, std::uintptr_t stream = 0);

/// Copy whole blocks within each layer's caches (copy-on-write after a fork).
///
///   key_caches, value_caches  one cache per layer (equal counts), all of one shape, dtype and
///                             device
///   block_mapping int64 [C, 2] rows (src_block, dst_block), on the caches' device (so a CUDA
///                              launch never syncs with the host); ids in [0, num_blocks)
/// Copies are applied as if in order; a dst should not also be a src of the same call.
/// C = 0 or no layers is a no-op.
void copy_blocks(const std::vector<TensorView>& key_caches, const std::vector<TensorView>& value_caches,
                 const TensorView& block_mapping, std::uintptr_t stream = 0);

/// Copy blocks between two caches of the same block shape and dtype, possibly on different
/// devices (swap out GPU -> CPU, swap in CPU -> GPU, or within one device).
///
///   src, dst       [num_blocks_src, ...] and [num_blocks_dst, ...], equal trailing dims
///                  (Hkv, block_size, D) and dtype; contiguous
///   block_mapping  int64 [C, 2] on the CPU: rows (src_block, dst_block)
/// Asynchronous on CUDA with respect to the host only when the host memory is pinned.
void swap_blocks(const TensorView& src, const TensorView& dst, const TensorView& block_mapping,
                 std::uintptr_t stream = 0);

}  // namespace pagedllm
