// Launchers of pagedllm/cache_ops.h: validate, then dispatch to the CPU kernels (cpu_cache_ops.cpp)
// or the CUDA ones (cuda/, declared in cuda/kernels.h).
#include "pagedllm/cache_ops.h"

#include <algorithm>
#include <stdexcept>

#include "cpu_kernels.h"
#include "kernel_checks.h"
#ifdef PAGEDLLM_WITH_CUDA
#include "kernels.h"
#endif

namespace pagedllm {

namespace {

using detail::check_contiguous;
using detail::check_dim;
using detail::check_dtype;
using detail::check_ndim;
using detail::check_same_device;
using detail::no_cuda;


/// int64 [C, 2] (src, dst) mapping; on the CPU also checks every id against the block counts.
void check_block_mapping(const char* op, const TensorView& mapping, int64_t num_src_blocks,
                         int64_t num_dst_blocks) {
  check_ndim(op, "block_mapping", mapping, 2, "[num_copies, 2] of (src_block, dst_block)");
  check_dtype(op, "block_mapping", mapping, DType::kInt64);
  check_dim(op, "block_mapping", mapping, 1, 2, "(src_block, dst_block)");
  check_contiguous(op, "block_mapping", mapping);
  if (mapping.device != DeviceType::kCPU) return;
  const int64_t* m = mapping.ptr<int64_t>();
  for (int64_t i = 0; i < mapping.size(0); ++i) {
    PAGEDLLM_CHECK(m[2 * i] >= 0 && m[2 * i] < num_src_blocks, op, ": block_mapping[", i,
                   "][0] (src block) = ", m[2 * i], " is out of range [0, ", num_src_blocks, ")");
    PAGEDLLM_CHECK(m[2 * i + 1] >= 0 && m[2 * i + 1] < num_dst_blocks, op, ": block_mapping[", i,
                   "][1] (dst block) = ", m[2 * i + 1], " is out of range [0, ", num_dst_blocks, ")");
  }
}

}  // namespace

std::array<int64_t, 4> kv_cache_shape(int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
                                      int64_t head_size) {
  const char* op = "kv_cache_shape";
  PAGEDLLM_CHECK(num_blocks > 0, op, ": num_blocks must be positive, got ", num_blocks);
  PAGEDLLM_CHECK(num_kv_heads > 0, op, ": num_kv_heads must be positive, got ", num_kv_heads);
  const auto& bs = supported_block_sizes();
  PAGEDLLM_CHECK(std::find(bs.begin(), bs.end(), block_size) != bs.end(), op, ": block size ",
                 block_size, " is not supported; supported block sizes: ", detail::join(bs));
  const auto& hs = supported_head_sizes();
  PAGEDLLM_CHECK(std::find(hs.begin(), hs.end(), head_size) != hs.end(), op, ": head size ",
                 head_size, " is not supported; supported head sizes: ", detail::join(hs));
  return {num_blocks, num_kv_heads, block_size, head_size};
}

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping,
                       const KVCacheScales& scales, std::uintptr_t stream) {
  const char* op = "reshape_and_cache";
  detail::check_kv_caches(op, key_cache, value_cache);
  const char* layout = "[num_tokens, num_kv_heads, head_size]";
  check_ndim(op, "key", key, 3, layout);
  check_ndim(op, "value", value, 3, layout);
  check_ndim(op, "slot_mapping", slot_mapping, 1, "[num_tokens]");
  detail::check_compute_dtype(op, "key", key, key_cache);
  check_dtype(op, "value", value, key.dtype);
  detail::check_kv_scales(op, scales, key_cache);
  check_dtype(op, "slot_mapping", slot_mapping, DType::kInt64);
  check_same_device(op, "key", key, "key_cache", key_cache);
  check_same_device(op, "value", value, "key_cache", key_cache);
  check_same_device(op, "slot_mapping", slot_mapping, "key_cache", key_cache);
  detail::check_token_rows(op, "key", key);
  detail::check_token_rows(op, "value", value);
  check_contiguous(op, "slot_mapping", slot_mapping);
  for (int d = 0; d < 3; ++d)
    PAGEDLLM_CHECK(value.size(d) == key.size(d), op, ": value shape ", value.describe(),
                   " differs from key shape ", key.describe());
  check_dim(op, "key", key, 1, key_cache.size(1), "num_kv_heads, must match key_cache");
  check_dim(op, "key", key, 2, key_cache.size(3), "head_size, must match key_cache");
  check_dim(op, "slot_mapping", slot_mapping, 0, key.size(0), "num_tokens, must match key");
  const int64_t num_tokens = key.size(0);
  if (num_tokens == 0) return;
  if (key_cache.device == DeviceType::kCPU) {
    const int64_t num_slots = key_cache.size(0) * key_cache.size(2);
    const int64_t* slots = slot_mapping.ptr<int64_t>();
    for (int64_t t = 0; t < num_tokens; ++t)
      PAGEDLLM_CHECK(slots[t] < num_slots, op, ": slot_mapping[", t, "] = ", slots[t],
                     " is out of range: the cache has ", num_slots, " slots (", key_cache.size(0),
                     " blocks x block_size ", key_cache.size(2), "); negative slots are skipped");
    cpu::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, scales, get_num_threads());
    return;
  }
#ifdef PAGEDLLM_WITH_CUDA
  cuda::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, scales, stream);
#else
  (void)stream;
  no_cuda(op);
#endif
}

void copy_blocks(const std::vector<TensorView>& key_caches, const std::vector<TensorView>& value_caches,
                 const TensorView& block_mapping, std::uintptr_t stream) {
  const char* op = "copy_blocks";
  PAGEDLLM_CHECK(key_caches.size() == value_caches.size(), op, ": got ", key_caches.size(),
                 " key caches but ", value_caches.size(), " value caches (one of each per layer)");
  if (key_caches.empty()) {
    check_ndim(op, "block_mapping", block_mapping, 2, "[num_copies, 2] of (src_block, dst_block)");
    return;
  }
  const TensorView& first = key_caches[0];
  for (size_t l = 0; l < key_caches.size(); ++l) {
    detail::check_kv_caches(op, key_caches[l], value_caches[l]);
    check_same_device(op, "key_caches[l]", key_caches[l], "key_caches[0]", first);
    PAGEDLLM_CHECK(key_caches[l].dtype == first.dtype, op, ": key_caches[", l, "] dtype ",
                   dtype_name(key_caches[l].dtype), " differs from key_caches[0] dtype ",
                   dtype_name(first.dtype));
    for (int d = 0; d < 4; ++d)
      PAGEDLLM_CHECK(key_caches[l].size(d) == first.size(d), op, ": key_caches[", l, "] shape ",
                     key_caches[l].describe(), " differs from key_caches[0] shape ", first.describe());
  }
  check_same_device(op, "block_mapping", block_mapping, "the caches", first);
  check_block_mapping(op, block_mapping, first.size(0), first.size(0));
  if (block_mapping.size(0) == 0) return;
  if (first.device == DeviceType::kCPU) {
    cpu::copy_blocks(key_caches, value_caches, block_mapping, get_num_threads());
    return;
  }
#ifdef PAGEDLLM_WITH_CUDA
  cuda::copy_blocks(key_caches, value_caches, block_mapping, stream);
#else
  (void)stream;
  no_cuda(op);
#endif
}

void swap_blocks(const TensorView& src, const TensorView& dst, const TensorView& block_mapping,
                 std::uintptr_t stream) {
  const char* op = "swap_blocks";
  const char* layout = "[num_blocks, num_kv_heads, block_size, head_size]";
  check_ndim(op, "src", src, 4, layout);
  check_ndim(op, "dst", dst, 4, layout);
  check_contiguous(op, "src", src);
  check_contiguous(op, "dst", dst);
  PAGEDLLM_CHECK(src.dtype == dst.dtype, op, ": src dtype ", dtype_name(src.dtype),
                 " differs from dst dtype ", dtype_name(dst.dtype));
  for (int d = 1; d < 4; ++d)
    PAGEDLLM_CHECK(src.size(d) == dst.size(d), op, ": src block shape ", src.describe(),
                   " differs from dst block shape ", dst.describe(), " (dimensions 1-3 must match)");
  PAGEDLLM_CHECK(block_mapping.device == DeviceType::kCPU, op,
                 ": block_mapping must be on the cpu, got ", detail::device_str(block_mapping));
  if (src.device == DeviceType::kCUDA && dst.device == DeviceType::kCUDA)
    PAGEDLLM_CHECK(src.device_index == dst.device_index, op, ": src is on ", detail::device_str(src),
                   " but dst is on ", detail::device_str(dst), "; copies across GPUs are not supported");
  check_block_mapping(op, block_mapping, src.size(0), dst.size(0));
  if (block_mapping.size(0) == 0) return;
  if (src.device == DeviceType::kCPU && dst.device == DeviceType::kCPU) {
    cpu::swap_blocks(src, dst, block_mapping);
    return;
  }
#ifdef PAGEDLLM_WITH_CUDA
  cuda::swap_blocks(src, dst, block_mapping, stream);
#else
  (void)stream;
  no_cuda(op);
#endif
}

}  // namespace pagedllm
