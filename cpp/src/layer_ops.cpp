// Launchers of pagedllm/layer_ops.h: validate, then dispatch to the CUDA kernels (cuda/rms_norm.cu,
// cuda/activation.cu, cuda/rotary_embedding.cu, declared in cuda/layer_ops_cuda.h). No CPU kernels yet:
// CPU tensors are refused with a message saying so (a CPU version would be dispatched here).
#include "pagedllm/layer_ops.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "kernel_checks.h"
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

/// float32 / bfloat16 / float16 on a CUDA device (the only kernels there are).
void check_float_cuda(const char* op, const char* name, const TensorView& t) {
  PAGEDLLM_CHECK(t.device == DeviceType::kCUDA, op, ": ", name, " is on ", detail::device_str(t),
                 "; only CUDA kernels exist for this op (the CPU model path uses PyTorch)");
  PAGEDLLM_CHECK(t.dtype == DType::kFloat32 || t.dtype == DType::kBFloat16 || t.dtype == DType::kFloat16, op,
                 ": ", name, " dtype ", dtype_name(t.dtype),
                 " is not supported; supported dtypes: float32, bfloat16, float16");
}

void check_eps(const char* op, double eps) {
  PAGEDLLM_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
}

/// weight [hidden] of input's dtype and device, contiguous.
void check_norm_weight(const char* op, const TensorView& weight, const TensorView& input) {
  check_ndim(op, "weight", weight, 1, "[hidden_size]");
  check_dtype(op, "weight", weight, input.dtype);
  check_same_device(op, "weight", weight, "input", input);
  check_contiguous(op, "weight", weight);
  check_dim(op, "weight", weight, 0, input.size(1), "hidden_size, must match input");
}

bool overlaps(const TensorView& a, const TensorView& b) {
  const char* a0 = static_cast<const char*>(a.data);
  const char* b0 = static_cast<const char*>(b.data);
  const int64_t an = a.numel() * static_cast<int64_t>(dtype_size(a.dtype));
  const int64_t bn = b.numel() * static_cast<int64_t>(dtype_size(b.dtype));
  return an > 0 && bn > 0 && a0 < b0 + bn && b0 < a0 + an;
}

/// [T, H, D] with heads and features contiguous (any token stride).
void check_heads(const char* op, const char* name, const TensorView& t, const char* layout) {
  check_ndim(op, name, t, 3, layout);
  PAGEDLLM_CHECK(t.size(2) == 1 || t.stride(2) == 1, op, ": ", name,
                 " must have contiguous features (stride(2) == 1), got stride ", t.stride(2), " (",
                 t.describe(), ")");
  PAGEDLLM_CHECK(t.size(1) == 1 || t.stride(1) == t.size(2), op, ": ", name,
                 " must have contiguous heads (stride(1) == head_size ", t.size(2), "), got stride ",
                 t.stride(1), " (", t.describe(), ")");
  PAGEDLLM_CHECK(t.size(0) <= 1 || t.stride(0) >= t.size(1) * t.size(2), op, ": ", name,
                 " token stride ", t.stride(0), " is smaller than num_heads * head_size (",
                 t.describe(), ")");
}

/// positions, query, key, cos/sin caches: shared by both rotary ops.
void check_rotary(const char* op, const TensorView& positions, const TensorView& query, const TensorView& key,
                  const TensorView& cos_cache, const TensorView& sin_cache) {
  check_float_cuda(op, "query", query);
  check_heads(op, "query", query, "[num_tokens, num_heads, head_size]");
  check_heads(op, "key", key, "[num_tokens, num_kv_heads, head_size]");
  check_dtype(op, "key", key, query.dtype);
  check_same_device(op, "key", key, "query", query);
  check_dim(op, "key", key, 0, query.size(0), "num_tokens, must match query");
  check_dim(op, "key", key, 2, query.size(2), "head_size, must match query");
  check_ndim(op, "positions", positions, 1, "[num_tokens]");
  check_dtype(op, "positions", positions, DType::kInt64);
  check_same_device(op, "positions", positions, "query", query);
  check_contiguous(op, "positions", positions);
  check_dim(op, "positions", positions, 0, query.size(0), "num_tokens, must match query");
  for (const auto* c : {&cos_cache, &sin_cache}) {
    const char* name = c == &cos_cache ? "cos_cache" : "sin_cache";
    check_ndim(op, name, *c, 2, "[max_positions, rotary_dim / 2]");
    check_dtype(op, name, *c, query.dtype);
    check_same_device(op, name, *c, "query", query);
    check_contiguous(op, name, *c);
  }
  PAGEDLLM_CHECK(sin_cache.size(0) == cos_cache.size(0) && sin_cache.size(1) == cos_cache.size(1), op,
                 ": sin_cache shape ", sin_cache.describe(), " differs from cos_cache shape ",
                 cos_cache.describe());
  PAGEDLLM_CHECK(cos_cache.size(0) > 0 && cos_cache.size(1) > 0, op, ": cos_cache is empty (",
                 cos_cache.describe(), ")");
  PAGEDLLM_CHECK(2 * cos_cache.size(1) <= query.size(2), op, ": rotary_dim 2 * ", cos_cache.size(1),
                 " (cos_cache dimension 1 = rotary_dim / 2) exceeds head_size ", query.size(2));
  PAGEDLLM_CHECK(query.size(1) > 0 && key.size(1) > 0, op, ": num_heads and num_kv_heads must be positive, got ",
                 query.size(1), " and ", key.size(1));
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

void rms_norm(const TensorView& out, const TensorView& input, const TensorView& weight, double eps,
              std::uintptr_t stream) {
  const char* op = "rms_norm";
  check_float_cuda(op, "input", input);
  check_ndim(op, "input", input, 2, "[num_tokens, hidden_size]");
  check_ndim(op, "out", out, 2, "[num_tokens, hidden_size]");
  check_dtype(op, "out", out, input.dtype);
  check_same_device(op, "out", out, "input", input);
  check_contiguous(op, "input", input);
  check_contiguous(op, "out", out);
  check_dim(op, "out", out, 0, input.size(0), "num_tokens, must match input");
  check_dim(op, "out", out, 1, input.size(1), "hidden_size, must match input");
  PAGEDLLM_CHECK(input.size(1) > 0, op, ": hidden_size must be positive, got ", input.size(1));
  check_norm_weight(op, weight, input);
  check_eps(op, eps);
  PAGEDLLM_CHECK(!overlaps(out, input), op, ": out and input overlap (use fused_add_rms_norm to work in place)");
  if (input.size(0) == 0) return;
#ifdef PAGEDLLM_LAYER_OPS_CUDA
  cuda::rms_norm(out, input, nullptr, weight, static_cast<float>(eps), stream);
#else
  (void)stream;
  no_layer_ops_cuda(op);
#endif
}

void fused_add_rms_norm(const TensorView& input, const TensorView& residual, const TensorView& weight,
                        double eps, std::uintptr_t stream) {
  const char* op = "fused_add_rms_norm";
  check_float_cuda(op, "input", input);
  check_ndim(op, "input", input, 2, "[num_tokens, hidden_size]");
  check_ndim(op, "residual", residual, 2, "[num_tokens, hidden_size]");
  check_dtype(op, "residual", residual, input.dtype);
  check_same_device(op, "residual", residual, "input", input);
  check_contiguous(op, "input", input);
  check_contiguous(op, "residual", residual);
  check_dim(op, "residual", residual, 0, input.size(0), "num_tokens, must match input");
  check_dim(op, "residual", residual, 1, input.size(1), "hidden_size, must match input");
  PAGEDLLM_CHECK(input.size(1) > 0, op, ": hidden_size must be positive, got ", input.size(1));
  check_norm_weight(op, weight, input);
  check_eps(op, eps);
  PAGEDLLM_CHECK(!overlaps(input, residual), op, ": input and residual overlap");
  if (input.size(0) == 0) return;
#ifdef PAGEDLLM_LAYER_OPS_CUDA
  cuda::rms_norm(input, input, &residual, weight, static_cast<float>(eps), stream);
#else
  (void)stream;
  no_layer_ops_cuda(op);
#endif
}

void silu_and_mul(const TensorView& out, const TensorView& input, std::uintptr_t stream) {
  const char* op = "silu_and_mul";
  check_float_cuda(op, "input", input);
  check_ndim(op, "input", input, 2, "[num_tokens, 2 * d]");
  check_ndim(op, "out", out, 2, "[num_tokens, d]");
  check_dtype(op, "out", out, input.dtype);
  check_same_device(op, "out", out, "input", input);
  check_contiguous(op, "input", input);
  check_contiguous(op, "out", out);
  PAGEDLLM_CHECK(input.size(1) > 0 && input.size(1) % 2 == 0, op, ": input dimension 1 must be a positive even "
                 "number (gate | up), got ", input.size(1), " (", input.describe(), ")");
  check_dim(op, "out", out, 0, input.size(0), "num_tokens, must match input");
  check_dim(op, "out", out, 1, input.size(1) / 2, "d, half of input dimension 1");
  PAGEDLLM_CHECK(!overlaps(out, input), op, ": out and input overlap");
  if (input.size(0) == 0) return;
#ifdef PAGEDLLM_LAYER_OPS_CUDA
  cuda::silu_and_mul(out, input, stream);
#else
  (void)stream;
  no_layer_ops_cuda(op);
#endif
}

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_cache, const TensorView& sin_cache, std::uintptr_t stream) {
  const char* op = "rotary_embedding";
  check_rotary(op, positions, query, key, cos_cache, sin_cache);
  if (query.size(0) == 0) return;
#ifdef PAGEDLLM_LAYER_OPS_CUDA
  cuda::rotary_embedding(positions, query, key, nullptr, cos_cache, sin_cache, nullptr, nullptr, nullptr,
                         nullptr, stream);
#else
  (void)stream;
  no_layer_ops_cuda(op);
#endif
}

void rotary_embedding_and_cache(const TensorView& positions, const TensorView& query, const TensorView& key,
                                const TensorView& value, const TensorView& cos_cache,
                                const TensorView& sin_cache, const TensorView& query_out,
                                const TensorView& key_cache, const TensorView& value_cache,
                                const TensorView& slot_mapping, std::uintptr_t stream) {
  const char* op = "rotary_embedding_and_cache";
  check_rotary(op, positions, query, key, cos_cache, sin_cache);
  check_heads(op, "value", value, "[num_tokens, num_kv_heads, head_size]");
  check_dtype(op, "value", value, query.dtype);
  check_same_device(op, "value", value, "query", query);
  for (int d = 0; d < 3; ++d)
    PAGEDLLM_CHECK(value.size(d) == key.size(d), op, ": value shape ", value.describe(),
                   " differs from key shape ", key.describe());
  check_ndim(op, "query_out", query_out, 3, "[num_tokens, num_heads, head_size]");
  check_dtype(op, "query_out", query_out, query.dtype);
  check_same_device(op, "query_out", query_out, "query", query);
  check_contiguous(op, "query_out", query_out);
  for (int d = 0; d < 3; ++d)
    PAGEDLLM_CHECK(query_out.size(d) == query.size(d), op, ": query_out shape ", query_out.describe(),
                   " differs from query shape ", query.describe());
  detail::check_kv_caches(op, key_cache, value_cache);
  check_dtype(op, "key_cache", key_cache, query.dtype);
  check_same_device(op, "key_cache", key_cache, "query", query);
  check_dim(op, "key", key, 1, key_cache.size(1), "num_kv_heads, must match key_cache");
  check_dim(op, "key", key, 2, key_cache.size(3), "head_size, must match key_cache");
  check_ndim(op, "slot_mapping", slot_mapping, 1, "[num_tokens]");
  check_dtype(op, "slot_mapping", slot_mapping, DType::kInt64);
  check_same_device(op, "slot_mapping", slot_mapping, "query", query);
  check_contiguous(op, "slot_mapping", slot_mapping);
  check_dim(op, "slot_mapping", slot_mapping, 0, query.size(0), "num_tokens, must match query");
  if (query.size(0) == 0) return;
  // Overlap is checked on the span each view touches (a strided view's numel undercounts it).
  TensorView q_span = query;
  q_span.shape[0] = 1;
  q_span.shape[1] = 1;
  q_span.shape[2] = (query.size(0) - 1) * query.stride(0) + query.size(1) * query.size(2);
  PAGEDLLM_CHECK(!overlaps(query_out, q_span), op, ": query_out overlaps query");
#ifdef PAGEDLLM_LAYER_OPS_CUDA
  cuda::rotary_embedding(positions, query, key, &value, cos_cache, sin_cache, &query_out, &key_cache,
                         &value_cache, &slot_mapping, stream);
#else
  (void)stream;
  no_layer_ops_cuda(op);
#endif
}

}  // namespace pagedllm
