// Launchers of pagedllm/quant_ops.h: validate, then call the CUDA implementation (or say that the
// library was built without CUDA).
#include "pagedllm/quant_ops.h"

#include <cstdint>

#include "kernel_checks.h"
#ifdef PAGEDLLM_WITH_CUDA
#include "quant_ops_cuda.h"
#endif

namespace pagedllm {

namespace {

void check_on_cuda(const char* op, const char* name, const TensorView& t) {
  PAGEDLLM_CHECK(t.device == DeviceType::kCUDA, op, ": CUDA only, ", name, " is on ", detail::device_str(t));
}

bool aligned16(const TensorView& t) { return reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0; }

[[noreturn]] void no_cuda(const char* op) {
  throw InvalidArgument(std::string(op) + ": pagedllm was built without CUDA");
}

}  // namespace

void fp8_gemv(const TensorView& out, const TensorView& x, const TensorView& weight, const TensorView& scale,
              const TensorView* bias, std::uintptr_t stream) {
  const char* op = "fp8_gemv";
  check_on_cuda(op, "x", x);
  detail::check_ndim(op, "x", x, 2, "[num_tokens, in_features]");
  PAGEDLLM_CHECK(x.dtype == DType::kBFloat16 || x.dtype == DType::kFloat16, op,
                 ": x must be bfloat16 or float16, got ", dtype_name(x.dtype));
  const int64_t M = x.size(0), K = x.size(1);
  PAGEDLLM_CHECK(M >= 1 && M <= kFp8GemvMaxTokens, op, ": x must have 1 to ", kFp8GemvMaxTokens, " rows, got ", M);
  PAGEDLLM_CHECK(K > 0 && K % 16 == 0 && K <= INT32_MAX, op, ": in_features must be a positive multiple of 16, got ", K);
  PAGEDLLM_CHECK(x.stride(1) == 1 && x.stride(0) % 8 == 0 && aligned16(x), op,
                 ": x rows must be contiguous and 16-byte aligned (row stride a multiple of 8), got ", x.describe());
  detail::check_ndim(op, "weight", weight, 2, "[out_features, in_features]");
  detail::check_dtype(op, "weight", weight, DType::kUInt8);
  detail::check_contiguous(op, "weight", weight);
  detail::check_same_device(op, "weight", weight, "x", x);
  detail::check_dim(op, "weight", weight, 1, K, "in_features, must match x");
  PAGEDLLM_CHECK(aligned16(weight), op, ": weight must be 16-byte aligned");
  const int64_t N = weight.size(0);
  PAGEDLLM_CHECK(N > 0 && N <= INT32_MAX, op, ": out_features must be in [1, 2^31), got ", N);
  detail::check_ndim(op, "scale", scale, 1, "[out_features]");
  detail::check_dtype(op, "scale", scale, DType::kFloat32);
  detail::check_contiguous(op, "scale", scale);
  detail::check_same_device(op, "scale", scale, "x", x);
  detail::check_dim(op, "scale", scale, 0, N, "out_features, must match weight");
  if (bias != nullptr) {
    detail::check_ndim(op, "bias", *bias, 1, "[out_features]");
    detail::check_dtype(op, "bias", *bias, x.dtype);
    detail::check_contiguous(op, "bias", *bias);
    detail::check_same_device(op, "bias", *bias, "x", x);
    detail::check_dim(op, "bias", *bias, 0, N, "out_features, must match weight");
  }
  detail::check_ndim(op, "out", out, 2, "[num_tokens, out_features]");
  detail::check_dtype(op, "out", out, x.dtype);
  detail::check_same_device(op, "out", out, "x", x);
  detail::check_dim(op, "out", out, 0, M, "num_tokens, must match x");
  detail::check_dim(op, "out", out, 1, N, "out_features, must match weight");
  PAGEDLLM_CHECK(out.stride(1) == 1, op, ": out must have a contiguous last dimension, got ", out.describe());
  PAGEDLLM_CHECK(!detail::overlaps(out, x), op, ": out must not overlap x");
#ifdef PAGEDLLM_WITH_CUDA
  cuda::fp8_gemv(out, x, weight, scale, bias, stream);
#else
  (void)stream;
  no_cuda(op);
#endif
}

void int4_dequantize(const TensorView& out, const TensorView& nibbles, const TensorView& scale_zero,
                     int64_t group_size, std::uintptr_t stream) {
  const char* op = "int4_dequantize";
  check_on_cuda(op, "nibbles", nibbles);
  detail::check_ndim(op, "nibbles", nibbles, 2, "[out_features, in_features / 2]");
  detail::check_dtype(op, "nibbles", nibbles, DType::kUInt8);
  detail::check_contiguous(op, "nibbles", nibbles);
  const int64_t N = nibbles.size(0), K = 2 * nibbles.size(1);
  PAGEDLLM_CHECK(N > 0 && K > 0 && K <= INT32_MAX, op, ": nibbles must be non-empty, got ", nibbles.describe());
  PAGEDLLM_CHECK(group_size > 0 && group_size % 16 == 0 && K % group_size == 0, op,
                 ": group_size must be a multiple of 16 dividing in_features=", K, ", got ", group_size);
  PAGEDLLM_CHECK(aligned16(nibbles) || reinterpret_cast<std::uintptr_t>(nibbles.data) % 8 == 0, op,
                 ": nibbles must be 8-byte aligned");
  detail::check_ndim(op, "scale_zero", scale_zero, 3, "[in_features / group_size, out_features, 2]");
  detail::check_dtype(op, "scale_zero", scale_zero, DType::kBFloat16);
  detail::check_contiguous(op, "scale_zero", scale_zero);
  detail::check_same_device(op, "scale_zero", scale_zero, "nibbles", nibbles);
  detail::check_dim(op, "scale_zero", scale_zero, 0, K / group_size, "groups, in_features / group_size");
  detail::check_dim(op, "scale_zero", scale_zero, 1, N, "out_features, must match nibbles");
  detail::check_dim(op, "scale_zero", scale_zero, 2, 2, "(scale, zero)");
  detail::check_ndim(op, "out", out, 2, "[out_features, in_features]");
  detail::check_dtype(op, "out", out, DType::kBFloat16);
  detail::check_contiguous(op, "out", out);
  detail::check_same_device(op, "out", out, "nibbles", nibbles);
  detail::check_dim(op, "out", out, 0, N, "out_features, must match nibbles");
  detail::check_dim(op, "out", out, 1, K, "in_features, twice nibbles' last dimension");
  PAGEDLLM_CHECK(aligned16(out), op, ": out must be 16-byte aligned");
#ifdef PAGEDLLM_WITH_CUDA
  cuda::int4_dequantize(out, nibbles, scale_zero, group_size, stream);
#else
  (void)stream;
  no_cuda(op);
#endif
}

}  // namespace pagedllm
