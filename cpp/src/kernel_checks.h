// kernel_checks.h — internal: argument validation shared by the attention and cache-op
// launchers. Every check throws pagedllm::InvalidArgument whose message starts with the op's
// name and names the offending argument and value.
#pragma once

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pagedllm/attention.h"
#include "pagedllm/errors.h"
#include "pagedllm/tensor_view.h"

namespace pagedllm::detail {

inline std::string join(const std::vector<int64_t>& values) {
  std::string s;
  for (size_t i = 0; i < values.size(); ++i) s += (i ? ", " : "") + std::to_string(values[i]);
  return s;
}

inline std::string device_str(const TensorView& t) {
  std::string s = device_name(t.device);
  if (t.device == DeviceType::kCUDA) s += ":" + std::to_string(t.device_index);
  return s;
}

/// Cache dtypes the kernels of `device` implement.
inline const char* supported_dtypes(DeviceType device) {
  return device == DeviceType::kCPU ? "float32, bfloat16, float8_e4m3fn, float8_e5m2"
                                    : "float32, bfloat16, float16, float8_e4m3fn, float8_e5m2";
}

/// Query / key / value / out dtypes taken with an FP8 cache on `device` (attention.h's fp8_query_dtypes).
inline const char* fp8_compute_dtypes(DeviceType device) {
  return device == DeviceType::kCPU ? "float32, bfloat16" : "bfloat16, float16";
}

inline bool fp8_compute_dtype_ok(DType dtype, DeviceType device) {
  if (device == DeviceType::kCPU) return dtype == DType::kFloat32 || dtype == DType::kBFloat16;
  return dtype == DType::kBFloat16 || dtype == DType::kFloat16;
}

inline void check_cache_dtype(const char* op, const TensorView& cache) {
  bool ok = cache.dtype == DType::kFloat32 || cache.dtype == DType::kBFloat16 || is_fp8(cache.dtype) ||
            (cache.dtype == DType::kFloat16 && cache.device == DeviceType::kCUDA);
  PAGEDLLM_CHECK(ok, op, ": cache dtype ", dtype_name(cache.dtype), " is not supported on ",
                 device_name(cache.device), "; supported dtypes on ", device_name(cache.device), ": ",
                 supported_dtypes(cache.device));
}

/// A tensor that meets the cache (query, key, value, out): the cache's dtype, or with an FP8 cache
/// one of fp8_compute_dtypes(device).
inline void check_compute_dtype(const char* op, const char* name, const TensorView& t, const TensorView& cache) {
  if (!is_fp8(cache.dtype)) {
    PAGEDLLM_CHECK(t.dtype == cache.dtype, op, ": ", name, " must be ", dtype_name(cache.dtype), ", got ",
                   dtype_name(t.dtype), " (", t.describe(), "; it must have the cache's dtype)");
    return;
  }
  PAGEDLLM_CHECK(fp8_compute_dtype_ok(t.dtype, cache.device), op, ": with a ", dtype_name(cache.dtype),
                 " cache on ", device_name(cache.device), ", ", name, " must be one of ",
                 fp8_compute_dtypes(cache.device), ", got ", dtype_name(t.dtype), " (", t.describe(), ")");
}

/// KVCacheScales: each set scale a float32 one-element tensor on the cache's device; on the CPU
/// also finite and > 0.
inline void check_kv_scales(const char* op, const KVCacheScales& scales, const TensorView& cache) {
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"k_scale", &scales.k_scale},
                                std::pair<const char*, const TensorView*>{"v_scale", &scales.v_scale}}) {
    if (t->data == nullptr) continue;
    PAGEDLLM_CHECK(t->dtype == DType::kFloat32 && t->numel() == 1, op, ": ", name,
                   " must be a one-element float32 tensor, got ", t->describe());
    const bool same = t->device == cache.device &&
                      (t->device == DeviceType::kCPU || t->device_index == cache.device_index);
    PAGEDLLM_CHECK(same, op, ": ", name, " is on ", device_str(*t), " but the cache is on ", device_str(cache),
                   "; the scale must be on the cache's device");
    if (t->device == DeviceType::kCPU) {
      const float v = *static_cast<const float*>(t->data);
      PAGEDLLM_CHECK(v > 0.0f && v < std::numeric_limits<float>::infinity(), op, ": ", name,
                     " must be finite and > 0, got ", v);
    }
  }
}

inline void check_contiguous(const char* op, const char* name, const TensorView& t) {
  PAGEDLLM_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got ", t.describe(),
                 " with non-contiguous strides");
}

/// A [tokens, heads, head_size] tensor whose (heads, head_size) part is contiguous; on the CPU
/// the token stride may be anything (e.g. q, k, v as views of one fused QKV projection), CUDA
/// kernels take contiguous tensors only.
inline void check_token_rows(const char* op, const char* name, const TensorView& t) {
  if (t.device != DeviceType::kCPU) {
    PAGEDLLM_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous on cuda, got ", t.describe(),
                   " with non-contiguous strides");
    return;
  }
  const bool inner = (t.size(2) <= 1 || t.stride(2) == 1) && (t.size(1) <= 1 || t.stride(1) == t.size(2));
  PAGEDLLM_CHECK(inner, op, ": ", name, " must have contiguous [num_heads, head_size] rows (any token stride), got ",
                 t.describe());
}

inline void check_ndim(const char* op, const char* name, const TensorView& t, int ndim,
                       const char* layout) {
  PAGEDLLM_CHECK(t.ndim == ndim, op, ": ", name, " must be ", ndim, "-D ", layout, ", got ",
                 t.describe());
}

inline void check_dtype(const char* op, const char* name, const TensorView& t, DType dtype) {
  PAGEDLLM_CHECK(t.dtype == dtype, op, ": ", name, " must be ", dtype_name(dtype), ", got ",
                 dtype_name(t.dtype), " (", t.describe(), ")");
}

inline void check_same_device(const char* op, const char* name, const TensorView& t,
                              const char* ref_name, const TensorView& ref) {
  bool same = t.device == ref.device &&
              (t.device == DeviceType::kCPU || t.device_index == ref.device_index);
  PAGEDLLM_CHECK(same, op, ": ", name, " is on ", device_str(t), " but ", ref_name, " is on ",
                 device_str(ref), "; all tensors must be on one device");
}

inline void check_dim(const char* op, const char* name, const TensorView& t, int dim,
                      int64_t expected, const char* what) {
  PAGEDLLM_CHECK(t.size(dim) == expected, op, ": ", name, " dimension ", dim, " (", what,
                 ") must be ", expected, ", got ", t.size(dim), " (", name, " is ", t.describe(), ")");
}

/// key_cache / value_cache: 4-D [num_blocks, Hkv, block_size, D], equal shape/dtype/device,
/// contiguous, supported dtype, block size and head size.
inline void check_kv_caches(const char* op, const TensorView& key_cache, const TensorView& value_cache) {
  const char* layout = "[num_blocks, num_kv_heads, block_size, head_size]";
  check_ndim(op, "key_cache", key_cache, 4, layout);
  check_ndim(op, "value_cache", value_cache, 4, layout);
  check_same_device(op, "value_cache", value_cache, "key_cache", key_cache);
  PAGEDLLM_CHECK(value_cache.dtype == key_cache.dtype, op, ": value_cache dtype ",
                 dtype_name(value_cache.dtype), " differs from key_cache dtype ",
                 dtype_name(key_cache.dtype));
  for (int d = 0; d < 4; ++d)
    PAGEDLLM_CHECK(value_cache.size(d) == key_cache.size(d), op, ": value_cache shape ",
                   value_cache.describe(), " differs from key_cache shape ", key_cache.describe());
  check_cache_dtype(op, key_cache);
  check_contiguous(op, "key_cache", key_cache);
  check_contiguous(op, "value_cache", value_cache);
  const auto& bs = supported_block_sizes();
  PAGEDLLM_CHECK(std::find(bs.begin(), bs.end(), key_cache.size(2)) != bs.end(), op,
                 ": block size ", key_cache.size(2), " (key_cache dimension 2) is not supported; "
                 "supported block sizes: ", join(bs));
  const auto& hs = supported_head_sizes();
  PAGEDLLM_CHECK(std::find(hs.begin(), hs.end(), key_cache.size(3)) != hs.end(), op,
                 ": head size ", key_cache.size(3), " (key_cache dimension 3) is not supported; "
                 "supported head sizes: ", join(hs));
  PAGEDLLM_CHECK(key_cache.size(1) > 0, op, ": num_kv_heads must be positive, got ",
                 key_cache.size(1));
  PAGEDLLM_CHECK(key_cache.data != nullptr || key_cache.numel() == 0, op,
                 ": key_cache has a null data pointer");
}

/// A launcher got CUDA tensors in a build without the CUDA kernels.
[[noreturn]] inline void no_cuda(const char* op) {
  throw std::runtime_error(std::string(op) +
                           ": got CUDA tensors but pagedllm was built without CUDA (PAGEDLLM_CUDA=ON)");
}

/// Bytes [first, last) a view with non-negative strides touches (nullptr, nullptr when empty).
inline std::pair<const char*, const char*> byte_span(const TensorView& t) {
  if (t.numel() == 0) return {nullptr, nullptr};
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) last += (t.size(d) - 1) * t.stride(d);
  const char* p = static_cast<const char*>(t.data);
  return {p, p + (last + 1) * static_cast<int64_t>(dtype_size(t.dtype))};
}

/// Whether two views share any byte of memory (an out that a kernel writes while it still reads
/// the other would give wrong results).
inline bool overlaps(const TensorView& a, const TensorView& b) {
  auto [a0, a1] = byte_span(a);
  auto [b0, b1] = byte_span(b);
  return a0 != nullptr && b0 != nullptr && a0 < b1 && b0 < a1;
}

/// The argument checks of layer_ops.h's rotary_embedding_and_cache (cpp/src/layer_ops.cpp), also
/// used by the GEMV's rotary epilogue (gemv.h, GemvRope); throws InvalidArgument naming `op`.
void check_rotary_and_cache_args(const char* op, const TensorView& positions, const TensorView& query,
                                 const TensorView& key, const TensorView& value, const TensorView& cos_cache,
                                 const TensorView& sin_cache, const TensorView& query_out,
                                 const TensorView& key_cache, const TensorView& value_cache,
                                 const TensorView& slot_mapping);

/// The paired-rows order (layer_ops.h's rotary_paired_row) needs full rotary: 2 * rot_half ==
/// head_size, and head_size % 16 == 0; throws InvalidArgument naming `op` and both values.
void check_rotary_paired_rows(const char* op, int64_t head_size, int64_t rot_half);

}  // namespace pagedllm::detail
