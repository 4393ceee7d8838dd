// CPU cache ops: reshape_and_cache (scatter this step's K/V rows into their slots), copy_blocks
// (copy-on-write block copies) and host-side swap_blocks. Plain memcpy of contiguous runs: a
// token's [Hkv, D] row becomes Hkv runs of D elements, a block is one run per layer (any dtype,
// FP8 included); into an FP8 cache reshape_and_cache quantizes each element (cpu_fp8.h).
#include <omp.h>

#include <cstring>

#include "cpu_fp8.h"
#include "cpu_kernels.h"

namespace pagedllm::cpu {

namespace {

/// The scale a KVCacheScales view holds (1.0 when unset).
float scale_of(const TensorView& t) { return t.data == nullptr ? 1.0f : *static_cast<const float*>(t.data); }

/// reshape_and_cache into an FP8 cache: code = encode(x / scale), element by element.
template <fp8::Kind K, typename T>
void reshape_and_cache_fp8(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                           const TensorView& value_cache, const TensorView& slot_mapping, float k_scale,
                           float v_scale, int num_threads) {
  const int64_t T_ = key.size(0), Hkv = key.size(1), D = key.size(2);
  const int64_t bs = key_cache.size(2);
  const T* k = key.ptr<const T>();
  const T* v = value.ptr<const T>();
  uint8_t* kc = static_cast<uint8_t*>(key_cache.data);
  uint8_t* vc = static_cast<uint8_t*>(value_cache.data);
  const int64_t* slots = slot_mapping.ptr<const int64_t>();
  const int threads = T_ * Hkv * D >= (1 << 14) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding token
    const int64_t block = slot / bs, row = slot % bs;
    const T* kt = k + t * key.stride(0);
    const T* vt = v + t * value.stride(0);
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t dst = ((block * Hkv + h) * bs + row) * D;
      for (int64_t d = 0; d < D; ++d) {
        kc[dst + d] = fp8::encode<K>(to_float(kt[h * D + d]) / k_scale);
        vc[dst + d] = fp8::encode<K>(to_float(vt[h * D + d]) / v_scale);
      }
    }
  }
}

}  // namespace

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping,
                       const KVCacheScales& scales, int num_threads) {
  if (is_fp8(key_cache.dtype)) {
    const float ks = scale_of(scales.k_scale), vs = scale_of(scales.v_scale);
    auto run = [&]<fp8::Kind K>() {
      if (key.dtype == DType::kFloat32)
        reshape_and_cache_fp8<K, float>(key, value, key_cache, value_cache, slot_mapping, ks, vs, num_threads);
      else
        reshape_and_cache_fp8<K, bf16>(key, value, key_cache, value_cache, slot_mapping, ks, vs, num_threads);
    };
    if (key_cache.dtype == DType::kFloat8E4M3FN)
      run.template operator()<fp8::Kind::kE4M3>();
    else
      run.template operator()<fp8::Kind::kE5M2>();
    return;
  }
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
