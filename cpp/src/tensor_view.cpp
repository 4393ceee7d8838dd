#include "pagedllm/tensor_view.h"

namespace pagedllm {

DType parse_dtype(const std::string& raw) {
  std::string name = raw.rfind("torch.", 0) == 0 ? raw.substr(6) : raw;
  if (name == "float32" || name == "float") return DType::kFloat32;
  if (name == "float16" || name == "half") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "int32" || name == "int") return DType::kInt32;
  if (name == "int64" || name == "long") return DType::kInt64;
  if (name == "uint8") return DType::kUInt8;
  if (name == "int8") return DType::kInt8;
  if (name == "float8_e4m3fn") return DType::kFloat8E4M3FN;
  if (name == "float8_e5m2") return DType::kFloat8E5M2;
  throw InvalidArgument("unknown dtype '" + raw +
                        "'; expected one of float32, float16, bfloat16, int32, int64, uint8, int8, float8_e4m3fn, "
                        "float8_e5m2");
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  DeviceType device, int device_index) {
  PAGEDLLM_CHECK(static_cast<int>(shape.size()) <= kMaxDims, "TensorView supports at most ",
                 kMaxDims, " dimensions, got ", shape.size());
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.device_index = device_index;
  v.ndim = static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) v.shape[d++] = s;
  int64_t stride = 1;
  for (d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = stride;
    stride *= v.shape[d];
  }
  return v;
}

std::string TensorView::describe() const {
  // std::to_string, not an ostringstream: see detail::concat in pagedllm/errors.h
  std::string s = "[";
  for (int d = 0; d < ndim; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  s += std::string("] ") + dtype_name(dtype) + " " + device_name(device);
  if (device == DeviceType::kCUDA) s += ":" + std::to_string(device_index);
  return s;
}

}  // namespace pagedllm
