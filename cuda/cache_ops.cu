// cuda/cache_ops.cu — the KV-cache write and block-move kernels on CUDA: reshape_and_cache,
// copy_blocks (copy-on-write), swap_blocks (CPU <-> GPU, cudaMemcpyAsync).
//
// All three move bytes, not values, so one kernel serves every dtype (an FP8 cache's
// reshape_and_cache quantizes instead: fp8_kv.cuh). Rows of head_size elements
// are 160..1024 bytes — always a multiple of 16 for the supported head sizes and dtypes — so the
// kernels copy 16-byte vectors (uint4): consecutive threads take consecutive vectors of a row,
// fully coalesced on both sides.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#include <cuda_bf16.h>
#include <type_traits>

#include "cuda_check.h"
#include "device_guard.h"
#include "fp8_kv.cuh"
#include "kernels.h"
#include "pagedllm/errors.h"

namespace pagedllm::cuda {
namespace {

using detail::DeviceGuard;

/// One CTA per token: key[t] and value[t] ([Hkv, D] each) go to row slot % bs of block
/// slot / bs, for every KV head. slot < 0 or >= num_slots: skipped.
__global__ void reshape_and_cache_kernel(const uint4* __restrict__ key, const uint4* __restrict__ value,
                                         uint4* __restrict__ key_cache, uint4* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping, int num_kv_heads,
                                         int block_size, int row_vecs, int64_t num_slots) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;
  const int64_t block = slot / block_size;
  const int64_t row = slot % block_size;
  const int n = num_kv_heads * row_vecs;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int head = i / row_vecs, c = i % row_vecs;
    const int64_t dst = ((block * num_kv_heads + head) * block_size + row) * row_vecs + c;
    key_cache[dst] = key[token * n + i];
    value_cache[dst] = value[token * n + i];
  }
}

/// reshape_and_cache into an FP8 cache (fp8_kv.cuh): one CTA per token, each thread 8 elements
/// (one 16-byte vector of T in, 8 codes out). row_vecs: 16-byte vectors of T per head row.
template <typename T>
__global__ void reshape_and_cache_fp8_kernel(const uint4* __restrict__ key, const uint4* __restrict__ value,
                                             uint2* __restrict__ key_cache, uint2* __restrict__ value_cache,
                                             const int64_t* __restrict__ slot_mapping, int num_kv_heads,
                                             int block_size, int row_vecs, int64_t num_slots, const float* k_scale,
                                             const float* v_scale, int kind) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;
  const float ks = fp8::load_scale(k_scale), vs = fp8::load_scale(v_scale);
  const int64_t block = slot / block_size;
  const int64_t row = slot % block_size;
  const int n = num_kv_heads * row_vecs;
  auto convert = [&](const uint4& in, float scale) {
    const T* x = reinterpret_cast<const T*>(&in);
    uint8_t c[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float f;
      if constexpr (std::is_same_v<T, __half>) f = __half2float(x[e]);
      else f = __bfloat162float(x[e]);
      c[e] = fp8::encode(f, scale, kind);
    }
    return *reinterpret_cast<const uint2*>(c);
  };
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int head = i / row_vecs, c = i % row_vecs;
    const int64_t dst = ((block * num_kv_heads + head) * block_size + row) * row_vecs + c;
    key_cache[dst] = convert(key[token * n + i], ks);
    value_cache[dst] = convert(value[token * n + i], vs);
  }
}

constexpr int kMaxLayersPerLaunch = 64;
struct LayerPointers {
  uint4* key[kMaxLayersPerLaunch];
  uint4* value[kMaxLayersPerLaunch];
};

/// grid (pairs, layers, 2: key/value): copy block src -> dst, block_vecs uint4 each.
__global__ void copy_blocks_kernel(const LayerPointers layers, const int64_t* __restrict__ mapping,
                                   int64_t block_vecs) {
  const int64_t pair = blockIdx.x;
  uint4* cache = blockIdx.z == 0 ? layers.key[blockIdx.y] : layers.value[blockIdx.y];
  const int64_t src = mapping[2 * pair] * block_vecs;
  const int64_t dst = mapping[2 * pair + 1] * block_vecs;
  for (int64_t i = threadIdx.x; i < block_vecs; i += blockDim.x) cache[dst + i] = cache[src + i];
}

void require_aligned(const TensorView& t, const char* op, const char* name) {
  if (reinterpret_cast<std::uintptr_t>(t.data) % 16 != 0)
    throw InvalidArgument(std::string("CUDA ") + op + ": " + name + " data pointer must be 16-byte aligned, got " +
                          std::to_string(reinterpret_cast<std::uintptr_t>(t.data)));
}

int64_t row_bytes(const TensorView& t) {
  return t.size(-1) * static_cast<int64_t>(dtype_size(t.dtype));
}

}  // namespace

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping,
                       const KVCacheScales& scales, std::uintptr_t stream) {
  DeviceGuard guard(key_cache.device_index);
  const int64_t num_tokens = key.size(0);
  if (num_tokens == 0) return;
  require_aligned(key, "reshape_and_cache", "key");
  require_aligned(value, "reshape_and_cache", "value");
  require_aligned(key_cache, "reshape_and_cache", "key_cache");
  require_aligned(value_cache, "reshape_and_cache", "value_cache");
  const int64_t rb = row_bytes(key);
  if (rb % 16 != 0)
    throw std::runtime_error("CUDA reshape_and_cache: row of " + std::to_string(rb) + " bytes is not a multiple of 16");
  const int row_vecs = static_cast<int>(rb / 16);
  const int num_kv_heads = static_cast<int>(key.size(1));
  const int block_size = static_cast<int>(key_cache.size(2));
  const int64_t num_slots = key_cache.size(0) * block_size;
  const int threads = std::clamp(num_kv_heads * row_vecs, 32, 256);
  if (const int kind = fp8::kind_of(key_cache.dtype); kind != 0) {  // key: bfloat16 / float16 (checked)
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(num_tokens), threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
          key.ptr<uint4>(), value.ptr<uint4>(), key_cache.ptr<uint2>(), value_cache.ptr<uint2>(),
          slot_mapping.ptr<int64_t>(), num_kv_heads, block_size, row_vecs, num_slots,
          fp8::scale_ptr(scales.k_scale), fp8::scale_ptr(scales.v_scale), kind);
    };
    if (key.dtype == DType::kFloat16) launch(reshape_and_cache_fp8_kernel<__half>);
    else launch(reshape_and_cache_fp8_kernel<__nv_bfloat16>);
    PAGEDLLM_CUDA_CHECK_LAUNCH();
    return;
  }
  reshape_and_cache_kernel<<<static_cast<unsigned>(num_tokens), threads, 0,
                             reinterpret_cast<cudaStream_t>(stream)>>>(
      key.ptr<uint4>(), value.ptr<uint4>(), key_cache.ptr<uint4>(), value_cache.ptr<uint4>(),
      slot_mapping.ptr<int64_t>(), num_kv_heads, block_size, row_vecs, num_slots);
  PAGEDLLM_CUDA_CHECK_LAUNCH();
}

void copy_blocks(const std::vector<TensorView>& key_caches, const std::vector<TensorView>& value_caches,
                 const TensorView& block_mapping, std::uintptr_t stream) {
  if (key_caches.empty()) return;
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0) return;
  DeviceGuard guard(key_caches[0].device_index);
  const TensorView& c0 = key_caches[0];
  const int64_t block_bytes = c0.size(1) * c0.size(2) * row_bytes(c0);
  if (block_bytes % 16 != 0)
    throw std::runtime_error("CUDA copy_blocks: block of " + std::to_string(block_bytes) + " bytes is not a multiple of 16");
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  for (int64_t first = 0; first < num_layers; first += kMaxLayersPerLaunch) {
    const int64_t n = std::min<int64_t>(kMaxLayersPerLaunch, num_layers - first);
    LayerPointers ptrs{};
    for (int64_t i = 0; i < n; ++i) {
      require_aligned(key_caches[first + i], "copy_blocks", "key_caches[i]");
      require_aligned(value_caches[first + i], "copy_blocks", "value_caches[i]");
      ptrs.key[i] = key_caches[first + i].ptr<uint4>();
      ptrs.value[i] = value_caches[first + i].ptr<uint4>();
    }
    dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(n), 2);
    copy_blocks_kernel<<<grid, 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        ptrs, block_mapping.ptr<int64_t>(), block_bytes / 16);
    PAGEDLLM_CUDA_CHECK_LAUNCH();
  }
}

void swap_blocks(const TensorView& src, const TensorView& dst, const TensorView& block_mapping,
                 std::uintptr_t stream) {
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0) return;
  const TensorView& on_device = src.device == DeviceType::kCUDA ? src : dst;
  DeviceGuard guard(on_device.device_index);
  const int64_t block_bytes = src.size(1) * src.size(2) * row_bytes(src);
  const int64_t* map = block_mapping.ptr<int64_t>();
  const char* s = static_cast<const char*>(src.data);
  char* d = static_cast<char*>(dst.data);
  // Runs of consecutive (src, dst) pairs become one copy.
  int64_t i = 0;
  while (i < num_pairs) {
    int64_t j = i + 1;
    while (j < num_pairs && map[2 * j] == map[2 * (j - 1)] + 1 && map[2 * j + 1] == map[2 * (j - 1) + 1] + 1) ++j;
    PAGEDLLM_CUDA_CHECK(cudaMemcpyAsync(d + map[2 * i + 1] * block_bytes, s + map[2 * i] * block_bytes,
                                        static_cast<size_t>((j - i) * block_bytes), cudaMemcpyDefault,
                                        reinterpret_cast<cudaStream_t>(stream)));
    i = j;
  }
}

}  // namespace pagedllm::cuda
