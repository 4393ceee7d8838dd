// Launchers of pagedllm/layer_ops.h: validate every argument, then run the CPU kernels
// (cpu_layer_ops.cpp). CUDA tensors are refused until CUDA versions exist.
#include "pagedllm/layer_ops.h"

#include <cmath>

#include "cpu_layer_kernels.h"
#include "kernel_checks.h"
#include "pagedllm/attention.h"

namespace pagedllm {

namespace {

using detail::check_contiguous;
using detail::check_dim;
using detail::check_dtype;
using detail::check_ndim;
using detail::check_same_device;

/// The op's dtype: float32 or bfloat16 on the CPU; CUDA is refused (no kernels yet).
void check_float_cpu(const char* op, const char* name, const TensorView& t) {
  PAGEDLLM_CHECK(t.device == DeviceType::kCPU, op, ": ", name, " is on ", detail::device_str(t),
                 "; this op has only a CPU implementation so far");
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

void check_eps(const char* op, double eps) {
  PAGEDLLM_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be a finite number >= 0, got ", eps);
}

}  // namespace

void rms_norm(const TensorView& out, const TensorView& input, const TensorView& weight, double eps,
              std::uintptr_t /*stream*/) {
  const char* op = "rms_norm";
  check_float_cpu(op, "input", input);
  check_rows(op, "input", input, input.dtype, "[num_tokens, hidden_size]");
  check_rows(op, "out", out, input.dtype, "[num_tokens, hidden_size]");
  check_ndim(op, "weight", weight, 1, "[hidden_size]");
  check_dtype(op, "weight", weight, input.dtype);
  check_contiguous(op, "weight", weight);
  check_same_device(op, "out", out, "input", input);
  check_same_device(op, "weight", weight, "input", input);
  check_dim(op, "out", out, 0, input.size(0), "num_tokens, must match input");
  check_dim(op, "out", out, 1, input.size(1), "hidden_size, must match input");
  check_dim(op, "weight", weight, 0, input.size(1), "hidden_size, must match input");
  check_eps(op, eps);
  if (input.numel() == 0) return;
  cpu::rms_norm(out, input, weight, static_cast<float>(eps), get_num_threads());
}

void fused_add_rms_norm(const TensorView& input, const TensorView& residual, const TensorView& weight,
                        double eps, std::uintptr_t /*stream*/) {
  const char* op = "fused_add_rms_norm";
  check_float_cpu(op, "input", input);
  check_rows(op, "input", input, input.dtype, "[num_tokens, hidden_size]");
  check_rows(op, "residual", residual, input.dtype, "[num_tokens, hidden_size]");
  check_ndim(op, "weight", weight, 1, "[hidden_size]");
  check_dtype(op, "weight", weight, input.dtype);
  check_contiguous(op, "weight", weight);
  check_same_device(op, "residual", residual, "input", input);
  check_same_device(op, "weight", weight, "input", input);
  check_dim(op, "residual", residual, 0, input.size(0), "num_tokens, must match input");
  check_dim(op, "residual", residual, 1, input.size(1), "hidden_size, must match input");
  check_dim(op, "weight", weight, 0, input.size(1), "hidden_size, must match input");
  check_eps(op, eps);
  if (input.numel() == 0) return;
  cpu::fused_add_rms_norm(input, residual, weight, static_cast<float>(eps), get_num_threads());
}

void silu_and_mul(const TensorView& out, const TensorView& input, std::uintptr_t /*stream*/) {
  const char* op = "silu_and_mul";
  check_float_cpu(op, "input", input);
  check_rows(op, "input", input, input.dtype, "[num_tokens, 2 * intermediate_size]");
  check_rows(op, "out", out, input.dtype, "[num_tokens, intermediate_size]");
  check_same_device(op, "out", out, "input", input);
  PAGEDLLM_CHECK(input.size(1) % 2 == 0, op, ": input's last dimension (gate and up halves) must be even, got ",
                 input.describe());
  check_dim(op, "out", out, 0, input.size(0), "num_tokens, must match input");
  check_dim(op, "out", out, 1, input.size(1) / 2, "intermediate_size, half of input's last dimension");
  if (out.numel() == 0) return;
  cpu::silu_and_mul(out, input, get_num_threads());
}

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin_cache, std::uintptr_t /*stream*/) {
  const char* op = "rotary_embedding";
  check_float_cpu(op, "query", query);
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

}  // namespace pagedllm
