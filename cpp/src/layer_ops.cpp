// Launchers of pagedllm/layer_ops.h: validate every argument, then run the CPU kernels
// (cpu_layer_ops.cpp) or, for CUDA tensors, the CUDA ones (cuda/rms_norm.cu, activation.cu,
// rotary_embedding.cu, declared in cuda/layer_ops_cuda.h).
#include "pagedllm/layer_ops.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "cpu_layer_kernels.h"
#include "kernel_checks.h"
#include "pagedllm/attention.h"
#if defined(PAGEDLLM_WITH_CUDA) && !defined(PAGEDLLM_NO_LAYER_OPS_CUDA)
#define PAGEDLLM_LAYER_OPS_CUDA 1
#include "layer_ops_cuda.h"
#endif

namespace pagedllm {

namespace {

using detail::check_contiguous;
using detail::check_dim;
using detail::check_dtype;
using detail::check_ndim;
using detail::check_same_device;

/// The op's dtype: float32 or bfloat16 on the CPU, also float16 on CUDA.
void check_float(const char* op, const char* name, const TensorView& t) {
  if (t.device == DeviceType::kCUDA) {
    PAGEDLLM_CHECK(t.dtype == DType::kFloat32 || t.dtype == DType::kBFloat16 || t.dtype == DType::kFloat16, op,
                   ": ", name, " dtype ", dtype_name(t.dtype),
                   " is not supported; supported dtypes on cuda: float32, bfloat16, float16");
    return;
  }
  PAGEDLLM_CHECK(t.dtype == DType::kFloat32 || t.dtype == DType::kBFloat16, op, ": ", name, " dtype ",
                 dtype_name(t.dtype), " is not supported; supported dtypes on cpu: float32, bfloat16");
}

/// A [rows, n] matrix whose rows may be strided but whose elements are contiguous.
void check_rows(const char* op, const char* name, const TensorView& t, DType dtype, const char* layout) {
  check_ndim(op, name, t, 2, layout);
  check_dtype(op, name, t, dtype);
  PAGEDLLM_CHECK(t.size(1) <= 1 || t.stride(1) == 1, op, ": ", name,
                 " must have a contiguous last dimension, got ", t.describe());
}

/// The CUDA kernels take whole contiguous matrices (the CPU ones also strided rows).
void check_cuda_contiguous(const char* op, const char* name, const TensorView& t) {
  if (t.device == DeviceType::kCUDA)
    PAGEDLLM_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous on cuda (strided rows are "
                   "supported on the cpu only), got ", t.describe(), " with row stride ", t.stride(0));
}

void check_eps(const char* op, double eps) {
  PAGEDLLM_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be a finite number >= 0, got ", eps);
}

/// The arguments of both norms: input [T, N] and `other` (out or residual) [T, N] of one float
/// dtype and device, weight [N] contiguous, eps finite and >= 0.
void check_norm_args(const char* op, const TensorView& input, const char* other_name, const TensorView& other,
                     const TensorView& weight, double eps) {
  check_float(op, "input", input);
  check_rows(op, "input", input, input.dtype, "[num_tokens, hidden_size]");
  check_rows(op, other_name, other, input.dtype, "[num_tokens, hidden_size]");
  check_ndim(op, "weight", weight, 1, "[hidden_size]");
  check_dtype(op, "weight", weight, input.dtype);
  check_contiguous(op, "weight", weight);
  check_same_device(op, other_name, other, "input", input);
  check_same_device(op, "weight", weight, "input", input);
  check_dim(op, other_name, other, 0, input.size(0), "num_tokens, must match input");
  check_dim(op, other_name, other, 1, input.size(1), "hidden_size, must match input");
  check_dim(op, "weight", weight, 0, input.size(1), "hidden_size, must match input");
  check_eps(op, eps);
}

bool overlaps(const TensorView& a, const TensorView& b) {
  const char* a0 = static_cast<const char*>(a.data);
  const char* b0 = static_cast<const char*>(b.data);
  const int64_t an = a.numel() * static_cast<int64_t>(dtype_size(a.dtype));
  const int64_t bn = b.numel() * static_cast<int64_t>(dtype_size(b.dtype));
  return an > 0 && bn > 0 && a0 < b0 + bn && b0 < a0 + an;
}

/// [T, H, D] with heads and features contiguous (any token stride): the CUDA rotary kernel's layout.
void check_heads(const char* op, const char* name, const TensorView& t, const char* layout) {
  check_ndim(op, name, t, 3, layout);
  PAGEDLLM_CHECK(t.size(2) == 1 || t.stride(2) == 1, op, ": ", name,
                 " must have contiguous features (stride(2) == 1), got stride ", t.stride(2), " (",
                 t.describe(), ")");
  PAGEDLLM_CHECK(t.size(1) == 1 || t.stride(1) == t.size(2), op, ": ", name,
                 " must have contiguous heads (stride(1) == head_size ", t.size(2), "), got stride ",
                 t.stride(1), " (", t.describe(), ")");
  PAGEDLLM_CHECK(t.size(0) <= 1 || t.stride(0) >= t.size(1) * t.size(2), op, ": ", name,
                 " token stride ", t.stride(0), " is smaller than num_heads * head_size (", t.describe(), ")");
}

[[noreturn]] void no_layer_ops_cuda(const char* op) {
  throw std::runtime_error(std::string(op) + ": got CUDA tensors but pagedllm was built without the CUDA "
                           "layer kernels (PAGEDLLM_CUDA=ON)");
}

}  // namespace

bool layer_ops_built_with_cuda() {
#ifdef PAGEDLLM_LAYER_OPS_CUDA
  return true;
#else
  return false;
#endif
}

/// fp8_out / fp8_scale of a norm: both or neither, CUDA, uint8 [T, N] and float32 [T], contiguous.
static void check_fp8_outputs(const char* op, const TensorView& input, const TensorView* fp8_out,
                              const TensorView* fp8_scale) {
  PAGEDLLM_CHECK((fp8_out == nullptr) == (fp8_scale == nullptr), op, ": pass both fp8_out and fp8_scale or neither");
  if (fp8_out == nullptr) return;
  PAGEDLLM_CHECK(input.device == DeviceType::kCUDA, op, ": fp8_out is CUDA only, input is on ",
                 detail::device_str(input));
  check_ndim(op, "fp8_out", *fp8_out, 2, "[num_tokens, hidden_size]");
  check_dtype(op, "fp8_out", *fp8_out, DType::kUInt8);
  check_cuda_contiguous(op, "fp8_out", *fp8_out);
  check_same_device(op, "fp8_out", *fp8_out, "input", input);
  check_dim(op, "fp8_out", *fp8_out, 0, input.size(0), "num_tokens, must match input");
  check_dim(op, "fp8_out", *fp8_out, 1, input.size(1), "hidden_size, must match input");
  check_ndim(op, "fp8_scale", *fp8_scale, 1, "[num_tokens]");
  check_dtype(op, "fp8_scale", *fp8_scale, DType::kFloat32);
  check_cuda_contiguous(op, "fp8_scale", *fp8_scale);
  check_same_device(op, "fp8_scale", *fp8_scale, "input", input);
  check_dim(op, "fp8_scale", *fp8_scale, 0, input.size(0), "num_tokens, must match input");
}

void rms_norm(const TensorView& out, const TensorView& input, const TensorView& weight, double eps,
              std::uintptr_t stream, const TensorView* fp8_out, const TensorView* fp8_scale) {
  const char* op = "rms_norm";
  check_fp8_outputs(op, input, fp8_out, fp8_scale);  // first: "CUDA only" before a CPU dtype message
  check_norm_args(op, input, "out", out, weight, eps);
  if (input.numel() == 0) return;
  if (input.device == DeviceType::kCPU) {
    cpu::rms_norm(out, input, weight, static_cast<float>(eps), get_num_threads());
    return;
  }
  check_cuda_contiguous(op, "input", input);
  check_cuda_contiguous(op, "out", out);
  PAGEDLLM_CHECK(!overlaps(out, input), op, ": out and input overlap (fused_add_rms_norm works in place)");
#ifdef PAGEDLLM_LAYER_OPS_CUDA
  cuda::rms_norm(out, input, nullptr, weight, static_cast<float>(eps), stream, fp8_out, fp8_scale);
#else
  (void)stream;
  no_layer_ops_cuda(op);
#endif
}

void fused_add_rms_norm(const TensorView& input, const TensorView& residual, const TensorView& weight,
                        double eps, std::uintptr_t stream, const TensorView* fp8_out, const TensorView* fp8_scale) {
  const char* op = "fused_add_rms_norm";
  check_fp8_outputs(op, input, fp8_out, fp8_scale);
  check_norm_args(op, input, "residual", residual, weight, eps);
  if (input.numel() == 0) return;
  if (input.device == DeviceType::kCPU) {
    cpu::fused_add_rms_norm(input, residual, weight, static_cast<float>(eps), get_num_threads());
    return;
  }
  check_cuda_contiguous(op, "input", input);
  check_cuda_contiguous(op, "residual", residual);
  PAGEDLLM_CHECK(!overlaps(input, residual), op, ": input and residual overlap");
#ifdef PAGEDLLM_LAYER_OPS_CUDA
  cuda::rms_norm(input, input, &residual, weight, static_cast<float>(eps), stream, fp8_out, fp8_scale);
#else
  (void)stream;
  no_layer_ops_cuda(op);
#endif
}

void scaled_fp8_quant(const TensorView& out, const TensorView& scale, const TensorView& input,
                      std::uintptr_t stream) {
  const char* op = "scaled_fp8_quant";
  PAGEDLLM_CHECK(input.device == DeviceType::kCUDA, op, ": CUDA only, input is on ", detail::device_str(input));
  check_float(op, "input", input);
  detail::check_ndim(op, "input", input, 2, "[num_tokens, in_features]");
  check_cuda_contiguous(op, "input", input);
  detail::check_ndim(op, "out", out, 2, "[num_tokens, in_features]");
  detail::check_dtype(op, "out", out, DType::kUInt8);
  check_cuda_contiguous(op, "out", out);
  check_same_device(op, "out", out, "input", input);
  check_dim(op, "out", out, 0, input.size(0), "num_tokens, must match input");
  check_dim(op, "out", out, 1, input.size(1), "in_features, must match input");
  detail::check_ndim(op, "scale", scale, 1, "[num_tokens]");
  detail::check_dtype(op, "scale", scale, DType::kFloat32);
  check_cuda_contiguous(op, "scale", scale);
  check_same_device(op, "scale", scale, "input", input);
  check_dim(op, "scale", scale, 0, input.size(0), "num_tokens, must match input");
  PAGEDLLM_CHECK(input.size(1) > 0 && input.size(1) <= INT32_MAX, op, ": in_features must be in [1, 2^31), got ",
                 input.size(1));
  if (input.size(0) == 0) return;
#ifdef PAGEDLLM_LAYER_OPS_CUDA
  cuda::scaled_fp8_quant(out, scale, input, stream);
#else
  (void)stream;
  no_layer_ops_cuda(op);
#endif
}

void silu_and_mul(const TensorView& out, const TensorView& input, std::uintptr_t stream, bool paired_rows) {
  const char* op = "silu_and_mul";
  check_float(op, "input", input);
  check_rows(op, "input", input, input.dtype, "[num_tokens, 2 * intermediate_size]");
  check_rows(op, "out", out, input.dtype, "[num_tokens, intermediate_size]");
  check_same_device(op, "out", out, "input", input);
  PAGEDLLM_CHECK(input.size(1) % 2 == 0, op, ": input's last dimension (gate and up halves) must be even, got ",
                 input.describe());
  check_dim(op, "out", out, 0, input.size(0), "num_tokens, must match input");
  check_dim(op, "out", out, 1, input.size(1) / 2, "intermediate_size, half of input's last dimension");
  PAGEDLLM_CHECK(!paired_rows || out.size(1) % 8 == 0, op,
                 ": paired_rows (gate_up_paired_row order) needs intermediate_size % 8 == 0, got ", out.size(1));
  PAGEDLLM_CHECK(!paired_rows || input.device == DeviceType::kCUDA, op,
                 ": paired_rows (gate_up_paired_row order) is CUDA only; input is on ", detail::device_str(input));
  if (out.numel() == 0) return;
  if (input.device == DeviceType::kCPU) {
    cpu::silu_and_mul(out, input, get_num_threads());
    return;
  }
  check_cuda_contiguous(op, "input", input);
  check_cuda_contiguous(op, "out", out);
  PAGEDLLM_CHECK(!overlaps(out, input), op, ": out and input overlap");
#ifdef PAGEDLLM_LAYER_OPS_CUDA
  cuda::silu_and_mul(out, input, stream, paired_rows);
#else
  (void)stream;
  no_layer_ops_cuda(op);
#endif
}

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin_cache, std::uintptr_t /*stream*/) {
  const char* op = "rotary_embedding";
  PAGEDLLM_CHECK(query.device == DeviceType::kCPU, op, ": query is on ", detail::device_str(query),
                 "; the in-place rotary embedding has a CPU kernel only so far (on cuda use "
                 "rotary_embedding_and_cache)");
  check_float(op, "query", query);
  const char* layout = "[num_tokens, num_heads, head_size]";
  check_ndim(op, "query", query, 3, layout);
  check_ndim(op, "key", key, 3, layout);
  check_dtype(op, "key", key, query.dtype);
  check_ndim(op, "positions", positions, 1, "[num_tokens]");
  check_dtype(op, "positions", positions, DType::kInt64);
  check_contiguous(op, "positions", positions);
  check_ndim(op, "cos_sin_cache", cos_sin_cache, 2, "[max_position, rotary_dim] (cos half, then sin half)");
  check_dtype(op, "cos_sin_cache", cos_sin_cache, query.dtype);
  check_contiguous(op, "cos_sin_cache", cos_sin_cache);
  for (const auto* t : {&positions, &key, &cos_sin_cache})
    check_same_device(op, t == &key ? "key" : t == &positions ? "positions" : "cos_sin_cache", *t, "query", query);
  const int64_t tokens = query.size(0), rot = cos_sin_cache.size(1);
  check_dim(op, "key", key, 0, tokens, "num_tokens, must match query");
  check_dim(op, "positions", positions, 0, tokens, "num_tokens, must match query");
  check_dim(op, "key", key, 2, query.size(2), "head_size, must match query");
  PAGEDLLM_CHECK(query.size(2) <= 1 || query.stride(2) == 1, op, ": query must have a contiguous last dimension, got ",
                 query.describe());
  PAGEDLLM_CHECK(key.size(2) <= 1 || key.stride(2) == 1, op, ": key must have a contiguous last dimension, got ",
                 key.describe());
  PAGEDLLM_CHECK(rot > 0 && rot % 2 == 0 && rot <= query.size(2), op, ": rotary_dim (cos_sin_cache dimension 1) = ",
                 rot, " must be even, positive and at most head_size ", query.size(2));
  const int64_t max_pos = cos_sin_cache.size(0);
  const int64_t* pos = positions.ptr<const int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    PAGEDLLM_CHECK(pos[t] >= 0 && pos[t] < max_pos, op, ": positions[", t, "] = ", pos[t],
                   " is outside the cos_sin_cache's [0, ", max_pos, ")");
  if (tokens == 0) return;
  cpu::rotary_embedding(positions, query, key, cos_sin_cache, get_num_threads());
}

namespace detail {

void check_rotary_and_cache_args(const char* op, const TensorView& positions, const TensorView& query,
                                 const TensorView& key, const TensorView& value, const TensorView& cos_cache,
                                 const TensorView& sin_cache, const TensorView& query_out,
                                 const TensorView& key_cache, const TensorView& value_cache,
                                 const TensorView& slot_mapping) {
  check_float(op, "query", query);
  check_heads(op, "query", query, "[num_tokens, num_heads, head_size]");
  check_heads(op, "key", key, "[num_tokens, num_kv_heads, head_size]");
  check_heads(op, "value", value, "[num_tokens, num_kv_heads, head_size]");
  check_dtype(op, "key", key, query.dtype);
  check_dtype(op, "value", value, query.dtype);
  check_same_device(op, "key", key, "query", query);
  check_same_device(op, "value", value, "query", query);
  check_dim(op, "key", key, 0, query.size(0), "num_tokens, must match query");
  check_dim(op, "key", key, 2, query.size(2), "head_size, must match query");
  for (int d = 0; d < 3; ++d)
    PAGEDLLM_CHECK(value.size(d) == key.size(d), op, ": value shape ", value.describe(),
                   " differs from key shape ", key.describe());
  check_ndim(op, "positions", positions, 1, "[num_tokens]");
  check_dtype(op, "positions", positions, DType::kInt64);
  check_same_device(op, "positions", positions, "query", query);
  check_contiguous(op, "positions", positions);
  check_dim(op, "positions", positions, 0, query.size(0), "num_tokens, must match query");
  for (const auto* c : {&cos_cache, &sin_cache}) {
    const char* name = c == &cos_cache ? "cos_cache" : "sin_cache";
    check_ndim(op, name, *c, 2, "[max_position, rotary_dim / 2]");
    check_dtype(op, name, *c, query.dtype);
    check_same_device(op, name, *c, "query", query);
    check_contiguous(op, name, *c);
  }
  PAGEDLLM_CHECK(sin_cache.size(0) == cos_cache.size(0) && sin_cache.size(1) == cos_cache.size(1), op,
                 ": sin_cache shape ", sin_cache.describe(), " differs from cos_cache shape ", cos_cache.describe());
  PAGEDLLM_CHECK(cos_cache.size(0) > 0 && cos_cache.size(1) > 0 && 2 * cos_cache.size(1) <= query.size(2), op,
                 ": rotary_dim 2 * ", cos_cache.size(1), " (cos_cache dimension 1 = rotary_dim / 2) must be "
                 "positive and at most head_size ", query.size(2), " (cos_cache is ", cos_cache.describe(), ")");
  PAGEDLLM_CHECK(query.size(1) > 0 && key.size(1) > 0, op, ": num_heads and num_kv_heads must be positive, got ",
                 query.size(1), " and ", key.size(1));
  check_ndim(op, "query_out", query_out, 3, "[num_tokens, num_heads, head_size]");
  check_dtype(op, "query_out", query_out, query.dtype);
  check_same_device(op, "query_out", query_out, "query", query);
  check_contiguous(op, "query_out", query_out);
  for (int d = 0; d < 3; ++d)
    PAGEDLLM_CHECK(query_out.size(d) == query.size(d), op, ": query_out shape ", query_out.describe(),
                   " differs from query shape ", query.describe());
  detail::check_kv_caches(op, key_cache, value_cache);
  detail::check_compute_dtype(op, "query", query, key_cache);
  check_same_device(op, "key_cache", key_cache, "query", query);
  check_dim(op, "key", key, 1, key_cache.size(1), "num_kv_heads, must match key_cache");
  check_dim(op, "key", key, 2, key_cache.size(3), "head_size, must match key_cache");
  check_ndim(op, "slot_mapping", slot_mapping, 1, "[num_tokens]");
  check_dtype(op, "slot_mapping", slot_mapping, DType::kInt64);
  check_same_device(op, "slot_mapping", slot_mapping, "query", query);
  check_contiguous(op, "slot_mapping", slot_mapping);
  check_dim(op, "slot_mapping", slot_mapping, 0, query.size(0), "num_tokens, must match query");
  if (query.size(0) == 0) return;
  // Overlap is checked on the span the strided query touches (its numel undercounts it).
  TensorView q_span = query;
  q_span.shape[0] = 1;
  q_span.shape[1] = 1;
  q_span.shape[2] = (query.size(0) - 1) * query.stride(0) + query.size(1) * query.size(2);
  PAGEDLLM_CHECK(!overlaps(query_out, q_span), op, ": query_out overlaps query");
}

void check_rotary_paired_rows(const char* op, int64_t head_size, int64_t rot_half) {
  PAGEDLLM_CHECK(2 * rot_half == head_size && head_size % 16 == 0, op,
                 ": paired_rows needs full rotary (rotary_dim == head_size) and head_size % 16 == 0, got head_size ",
                 head_size, " and rotary_dim ", 2 * rot_half);
}

}  // namespace detail

void rotary_embedding_and_cache(const TensorView& positions, const TensorView& query, const TensorView& key,
                                const TensorView& value, const TensorView& cos_cache,
                                const TensorView& sin_cache, const TensorView& query_out,
                                const TensorView& key_cache, const TensorView& value_cache,
                                const TensorView& slot_mapping, std::uintptr_t stream, bool paired_rows,
                                const KVCacheScales& scales) {
  const char* op = "rotary_embedding_and_cache";
  PAGEDLLM_CHECK(query.device == DeviceType::kCUDA, op, ": query is on ", detail::device_str(query),
                 "; this op has a CUDA kernel only so far (on the cpu use rotary_embedding, then "
                 "reshape_and_cache)");
  detail::check_rotary_and_cache_args(op, positions, query, key, value, cos_cache, sin_cache, query_out, key_cache,
                                      value_cache, slot_mapping);
  if (paired_rows) detail::check_rotary_paired_rows(op, query.size(2), cos_cache.size(1));
  detail::check_kv_scales(op, scales, key_cache);
  if (query.size(0) == 0) return;
#ifdef PAGEDLLM_LAYER_OPS_CUDA
  cuda::rotary_embedding(positions, query, key, &value, cos_cache, sin_cache, &query_out, &key_cache,
                         &value_cache, &slot_mapping, stream, paired_rows, &scales);
#else
  (void)stream;
  no_layer_ops_cuda(op);
#endif
}

}  // namespace pagedllm
