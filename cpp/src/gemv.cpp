// Launchers of pagedllm/gemv.h: validate every argument, then run the CUDA kernels (cuda/gemv.cu,
// declared in cuda/gemv_cuda.h). There is no CPU kernel: on the CPU, F.linear (oneDNN) is the GEMV.
#include "pagedllm/gemv.h"

#include <stdexcept>
#include <string>

#include "kernel_checks.h"
#if defined(PAGEDLLM_WITH_CUDA)
#include "gemv_cuda.h"
#endif

namespace pagedllm {

namespace {

using detail::check_contiguous;
using detail::check_dim;
using detail::check_dtype;
using detail::check_ndim;
using detail::check_same_device;
using detail::overlaps;

void check_config(const char* op, const GemvConfig& c) {
  PAGEDLLM_CHECK(c.variant >= 0 && c.variant <= 3, op, ": config.variant must be 0..3, got ", c.variant);
  PAGEDLLM_CHECK(c.warps >= 0 && c.warps <= 8, op, ": config.warps must be 0..8, got ", c.warps);
  PAGEDLLM_CHECK(c.splits == 0 || c.splits == 1 || c.splits == 2 || c.splits == 4 || c.splits == 8, op,
                 ": config.splits must be 0 (auto), 1, 2, 4 or 8, got ", c.splits);
  PAGEDLLM_CHECK(c.prefetch >= -1 && c.prefetch <= 1, op, ": config.prefetch must be -1, 0 or 1, got ", c.prefetch);
}

/// The rope epilogue's arguments: those of rotary_embedding_and_cache with query, key and value
/// the parts of out, and the arrival counters.
void check_rope(const char* op, const TensorView& out, const GemvRope& r, bool residual) {
  PAGEDLLM_CHECK(!residual, op, ": the rope epilogue cannot be combined with a residual");
  for (const TensorView* t : {r.positions, r.cos_cache, r.sin_cache, r.query_out, r.key_cache, r.value_cache,
                              r.slot_mapping})
    PAGEDLLM_CHECK(t != nullptr, op, ": the rope epilogue needs positions, cos_cache, sin_cache, query_out, "
                   "key_cache, value_cache and slot_mapping");
  PAGEDLLM_CHECK(r.paired_rows || r.counters != nullptr, op,
                 ": the rope epilogue needs counters (or paired_rows: weight rows in the rotary_paired_row order)");
  PAGEDLLM_CHECK(r.num_heads > 0 && r.num_kv_heads > 0, op, ": rope num_heads and num_kv_heads must be positive, "
                 "got ", r.num_heads, " and ", r.num_kv_heads);
  detail::check_kv_caches(op, *r.key_cache, *r.value_cache);
  const int64_t D = r.key_cache->size(3), M = out.size(0), heads = r.num_heads + 2 * int64_t{r.num_kv_heads};
  PAGEDLLM_CHECK(D % 32 == 0, op, ": the rope epilogue needs head_size % 32 == 0, got ", D,
                 " (use rotary_embedding_and_cache)");
  PAGEDLLM_CHECK(out.size(1) == heads * D, op, ": out has ", out.size(1), " columns but (num_heads ", r.num_heads,
                 " + 2 * num_kv_heads ", r.num_kv_heads, ") * head_size ", D, " = ", heads * D);
  auto part = [&](int64_t first_head, int64_t num) {  // [M, num, D] view of out's columns
    TensorView v = out;
    v.data = static_cast<char*>(out.data) + first_head * D * static_cast<int64_t>(dtype_size(out.dtype));
    v.ndim = 3;
    v.shape[0] = M;
    v.shape[1] = num;
    v.shape[2] = D;
    v.strides[0] = out.size(1);
    v.strides[1] = D;
    v.strides[2] = 1;
    return v;
  };
  const TensorView q = part(0, r.num_heads), k = part(r.num_heads, r.num_kv_heads),
                   v = part(r.num_heads + r.num_kv_heads, r.num_kv_heads);
  detail::check_rotary_and_cache_args(op, *r.positions, q, k, v, *r.cos_cache, *r.sin_cache, *r.query_out,
                                      *r.key_cache, *r.value_cache, *r.slot_mapping);
  detail::check_kv_scales(op, r.kv_scales, *r.key_cache);
  PAGEDLLM_CHECK(!overlaps(*r.query_out, out), op, ": query_out overlaps out");
  if (r.paired_rows) {
    detail::check_rotary_paired_rows(op, D, r.cos_cache->size(1));
    return;  // no counters: every CTA rotates its own rows
  }
  check_ndim(op, "counters", *r.counters, 1, "[>= num_heads + 2 * num_kv_heads]");
  check_dtype(op, "counters", *r.counters, DType::kInt32);
  check_same_device(op, "counters", *r.counters, "out", out);
  check_contiguous(op, "counters", *r.counters);
  PAGEDLLM_CHECK(r.counters->size(0) >= heads, op, ": counters has ", r.counters->size(0),
                 " entries, fewer than num_heads + 2 * num_kv_heads = ", heads);
}

void run(const char* op, const TensorView& out, const TensorView& input, const TensorView& weight,
         const TensorView* bias, const GemvFusion& fusion, std::uintptr_t stream, const GemvConfig* config) {
  const bool silu = fusion.silu_and_mul;
  PAGEDLLM_CHECK(input.device == DeviceType::kCUDA, op, ": input is on ", detail::device_str(input),
                 "; the GEMV kernels are CUDA only (on the cpu use torch.nn.functional.linear)");
  PAGEDLLM_CHECK(input.dtype == DType::kBFloat16 || input.dtype == DType::kFloat16, op, ": input dtype ",
                 dtype_name(input.dtype), " is not supported; supported dtypes: bfloat16, float16 (use "
                 "torch.nn.functional.linear for float32)");
  check_ndim(op, "input", input, 2, silu ? "[num_tokens, 2 * in_features]" : "[num_tokens, in_features]");
  PAGEDLLM_CHECK(input.size(1) <= 1 || input.stride(1) == 1, op,
                 ": input must have a contiguous last dimension, got ", input.describe());
  check_ndim(op, "weight", weight, 2, "[out_features, in_features]");
  check_dtype(op, "weight", weight, input.dtype);
  check_same_device(op, "weight", weight, "input", input);
  check_contiguous(op, "weight", weight);
  const int64_t M = input.size(0), N = weight.size(0), K = weight.size(1);
  PAGEDLLM_CHECK(M <= kGemvMaxTokens, op, ": input has ", M, " rows (tokens); the GEMV takes at most ",
                 kGemvMaxTokens, " (use torch.nn.functional.linear for more)");
  PAGEDLLM_CHECK(N > 0 && K > 0, op, ": weight must be non-empty, got ", weight.describe());
  PAGEDLLM_CHECK(N < (int64_t{1} << 31) && K < (int64_t{1} << 30), op, ": weight ", weight.describe(),
                 " is too large for the GEMV");
  if (silu)
    check_dim(op, "input", input, 1, 2 * K, "2 * in_features: the gate and up halves, each weight.size(1)");
  else
    check_dim(op, "input", input, 1, K, "in_features, must match weight.size(1)");
  PAGEDLLM_CHECK(M <= 1 || input.stride(0) >= input.size(1), op, ": input row stride ", input.stride(0),
                 " is smaller than its row length (", input.describe(), ")");
  if (bias != nullptr) {
    check_ndim(op, "bias", *bias, 1, "[out_features]");
    check_dtype(op, "bias", *bias, input.dtype);
    check_same_device(op, "bias", *bias, "input", input);
    check_contiguous(op, "bias", *bias);
    check_dim(op, "bias", *bias, 0, N, "out_features, must match weight.size(0)");
  }
  check_ndim(op, "out", out, 2, "[num_tokens, out_features]");
  const bool out_f32 = out.dtype == DType::kFloat32;
  PAGEDLLM_CHECK(out_f32 || out.dtype == input.dtype, op, ": out dtype ", dtype_name(out.dtype),
                 " must be the input's (", dtype_name(input.dtype), ") or float32");
  PAGEDLLM_CHECK(!out_f32 || (fusion.residual == nullptr && fusion.rope == nullptr), op,
                 ": a float32 out (the product rounded to the input dtype, stored as float32) cannot be "
                 "combined with a residual or the rope epilogue");
  check_same_device(op, "out", out, "input", input);
  check_contiguous(op, "out", out);
  check_dim(op, "out", out, 0, M, "num_tokens, must match input");
  if (fusion.silu_paired_rows) {
    PAGEDLLM_CHECK(N % 16 == 0, op, ": silu_paired_rows (gate_up_paired_row order) needs out_features % 16 == 0, "
                   "got weight ", weight.describe());
    const char* other = out_f32                     ? "a float32 out"
                        : fusion.residual != nullptr ? "a residual"
                        : fusion.rope != nullptr     ? "the rope epilogue"
                        : silu                       ? "the silu_and_mul prologue"
                                                     : nullptr;
    PAGEDLLM_CHECK(other == nullptr, op, ": silu_paired_rows (the SiLU-and-mul epilogue) cannot be combined with ",
                   other == nullptr ? "" : other);
    check_dim(op, "out", out, 1, N / 2, "out_features / 2 with silu_paired_rows (SiLU(gate) * up)");
  } else {
    check_dim(op, "out", out, 1, N, "out_features, must match weight.size(0)");
  }
  PAGEDLLM_CHECK(!overlaps(out, input), op, ": out overlaps input");
  PAGEDLLM_CHECK(!overlaps(out, weight), op, ": out overlaps weight");
  PAGEDLLM_CHECK(bias == nullptr || !overlaps(out, *bias), op, ": out overlaps bias");
  if (const TensorView* g = fusion.norm_weight; g != nullptr) {
    PAGEDLLM_CHECK(!silu, op, ": norm_weight (RMSNorm prologue) and silu_and_mul cannot be combined");
    check_ndim(op, "norm_weight", *g, 1, "[in_features]");
    check_dtype(op, "norm_weight", *g, input.dtype);
    check_same_device(op, "norm_weight", *g, "input", input);
    check_contiguous(op, "norm_weight", *g);
    check_dim(op, "norm_weight", *g, 0, K, "in_features, must match weight.size(1)");
    PAGEDLLM_CHECK(fusion.eps >= 0.f && fusion.eps < 1e30f, op, ": eps must be finite and >= 0, got ", fusion.eps);
    PAGEDLLM_CHECK(!overlaps(out, *g), op, ": out overlaps norm_weight");
  }
  if (const TensorView* r = fusion.residual; r != nullptr) {
    check_ndim(op, "residual", *r, 2, "[num_tokens, out_features]");
    check_dtype(op, "residual", *r, input.dtype);
    check_same_device(op, "residual", *r, "input", input);
    check_contiguous(op, "residual", *r);
    check_dim(op, "residual", *r, 0, M, "num_tokens, must match input");
    check_dim(op, "residual", *r, 1, N, "out_features, must match weight.size(0)");
    PAGEDLLM_CHECK(r->data == out.data || !overlaps(out, *r), op,
                   ": residual overlaps out without being out (in place: pass the same tensor)");
  }
  if (const GemvRope* r = fusion.rope; r != nullptr) check_rope(op, out, *r, fusion.residual != nullptr);
  const GemvConfig cfg = config != nullptr ? *config : GemvConfig{};
  check_config(op, cfg);
  if (M == 0) return;
#if defined(PAGEDLLM_WITH_CUDA)
  cuda::gemv(out, input, weight, bias, fusion, cfg, stream);
#else
  (void)stream;
  throw std::runtime_error(std::string(op) + ": got CUDA tensors but pagedllm was built without CUDA "
                           "(PAGEDLLM_CUDA=ON)");
#endif
}

}  // namespace

bool gemv_built_with_cuda() {
#if defined(PAGEDLLM_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

bool gemv_fusion_fits(int64_t tokens, int64_t in_features, DType dtype) {
#if defined(PAGEDLLM_WITH_CUDA)
  return cuda::gemv_stage_fits(tokens, in_features, static_cast<int>(dtype_size(dtype)));
#else
  (void)tokens;
  (void)in_features;
  (void)dtype;
  return false;
#endif
}

void gemv(const TensorView& out, const TensorView& input, const TensorView& weight, const TensorView* bias,
          std::uintptr_t stream, const GemvConfig* config, const GemvFusion* fusion) {
  const GemvFusion f = fusion != nullptr ? *fusion : GemvFusion{};
  run(f.silu_and_mul ? "silu_and_mul_gemv" : "gemv", out, input, weight, bias, f, stream, config);
}

void silu_and_mul_gemv(const TensorView& out, const TensorView& input, const TensorView& weight,
                       const TensorView* bias, std::uintptr_t stream, const GemvConfig* config) {
  GemvFusion f;
  f.silu_and_mul = true;
  run("silu_and_mul_gemv", out, input, weight, bias, f, stream, config);
}

}  // namespace pagedllm
