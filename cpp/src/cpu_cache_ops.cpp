// CPU cache ops: reshape_and_cache (scatter this step's K/V rows into their slots), copy_blocks
// (copy-on-write block copies) and host-side swap_blocks. Plain memcpy of contiguous runs: a
// token's [Hkv, D] row becomes Hkv runs of D elements, a block is one run per layer.
#include <omp.h>

#include <cstring>

#include "cpu_kernels.h"

namespace pagedllm::cpu {

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping, int num_threads) {
  const int64_t T = key.size(0), Hkv = key.size(1), D = key.size(2);
  const int64_t bs = key_cache.size(2);
  const size_t elem = dtype_size(key.dtype);
  const size_t row_bytes = static_cast<size_t>(D) * elem;
  const char* k = static_cast<const char*>(key.data);
  const char* v = static_cast<const char*>(value.data);
  char* kc = static_cast<char*>(key_cache.data);
  char* vc = static_cast<char*>(value_cache.data);
  const int64_t* slots = slot_mapping.ptr<const int64_t>();
  const int threads = T * Hkv * D >= (1 << 16) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding token
    const int64_t block = slot / bs, row = slot % bs;
    // [Hkv, D] of a token is contiguous; tokens may be strided (views of a fused QKV)
    const char* kt = k + static_cast<size_t>(t * key.stride(0)) * elem;
    const char* vt = v + static_cast<size_t>(t * value.stride(0)) * elem;
    for (int64_t h = 0; h < Hkv; ++h) {
      const size_t src = static_cast<size_t>(h) * row_bytes;
      const size_t dst = static_cast<size_t>((block * Hkv + h) * bs + row) * row_bytes;
      std::memcpy(kc + dst, kt + src, row_bytes);
      std::memcpy(vc + dst, vt + src, row_bytes);
    }
  }
}

void copy_blocks(const std::vector<TensorView>& key_caches, const std::vector<TensorView>& value_caches,
                 const TensorView& block_mapping, int num_threads) {
  const TensorView& first = key_caches[0];
  const size_t block_bytes =
      static_cast<size_t>(first.size(1) * first.size(2) * first.size(3)) * dtype_size(first.dtype);
  const int64_t C = block_mapping.size(0);
  const int64_t L = static_cast<int64_t>(key_caches.size());
  const int64_t* map = block_mapping.ptr<const int64_t>();
  // Parallel over layers (and K/V): copies within one layer keep their order.
  const int threads = C * L * static_cast<int64_t>(block_bytes) >= (1 << 20) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t job = 0; job < 2 * L; ++job) {
    const TensorView& cache = (job % 2 == 0) ? key_caches[job / 2] : value_caches[job / 2];
    char* base = static_cast<char*>(cache.data);
    for (int64_t i = 0; i < C; ++i)
      std::memmove(base + map[2 * i + 1] * block_bytes, base + map[2 * i] * block_bytes, block_bytes);
  }
}

void swap_blocks(const TensorView& src, const TensorView& dst, const TensorView& block_mapping) {
  const size_t block_bytes =
      static_cast<size_t>(src.size(1) * src.size(2) * src.size(3)) * dtype_size(src.dtype);
  const int64_t* map = block_mapping.ptr<const int64_t>();
  const char* s = static_cast<const char*>(src.data);
  char* d = static_cast<char*>(dst.data);
  for (int64_t i = 0; i < block_mapping.size(0); ++i)
    std::memmove(d + map[2 * i + 1] * block_bytes, s + map[2 * i] * block_bytes, block_bytes);
}

}  // namespace pagedllm::cpu
