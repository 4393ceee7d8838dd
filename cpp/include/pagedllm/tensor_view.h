// pagedllm/tensor_view.h — a non-owning view of a strided tensor in host or device memory.
//
// The kernels' launchers take TensorViews, never framework tensors, so the native library has
// no PyTorch dependency: Python builds views from torch tensors (data_ptr(), shape, stride()),
// a C++ server from its own buffers. Shapes and strides are in elements, not bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "pagedllm/errors.h"

namespace pagedllm {

/// Element types. kFloat8E4M3FN / kFloat8E5M2 are the OCP FP8 formats as PyTorch's float8_e4m3fn
/// (4 exponent bits, bias 7, 3 mantissa bits, no infinities, max 448) and float8_e5m2 (bias 15, 2
/// mantissa bits, IEEE-like, max 57344): "OCP 8-bit Floating Point Specification (OFP8)", 2023.
enum class DType : int8_t { kFloat32, kFloat16, kBFloat16, kInt32, kInt64, kUInt8, kInt8, kFloat8E4M3FN, kFloat8E5M2 };
enum class DeviceType : int8_t { kCPU, kCUDA };

/// Size in bytes of one element of `dtype`.
inline std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
    case DType::kInt8: return 1;
    case DType::kFloat8E4M3FN: return 1;
    case DType::kFloat8E5M2: return 1;
  }
  return 0;
}

/// The dtype's name as PyTorch spells it ("float32", "bfloat16", ...).
inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kFloat8E4M3FN: return "float8_e4m3fn";
    case DType::kFloat8E5M2: return "float8_e5m2";
  }
  return "unknown";
}

/// Whether `dtype` is one of the 8-bit float formats (kFloat8E4M3FN, kFloat8E5M2).
inline bool is_fp8(DType dtype) { return dtype == DType::kFloat8E4M3FN || dtype == DType::kFloat8E5M2; }

/// Parse a dtype name ("float32"/"float", "float16"/"half", "bfloat16", "int32", "int64", "uint8", "int8",
/// "float8_e4m3fn", "float8_e5m2");
/// a "torch." prefix is accepted. Throws InvalidArgument naming an unknown name.
DType parse_dtype(const std::string& name);

inline const char* device_name(DeviceType device) {
  return device == DeviceType::kCPU ? "cpu" : "cuda";
}

struct TensorView {
  static constexpr int kMaxDims = 6;

  void* data = nullptr;
  DType dtype = DType::kFloat32;
  DeviceType device = DeviceType::kCPU;
  int device_index = 0;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements

  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  int64_t stride(int d) const { return strides[d < 0 ? d + ndim : d]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < ndim; ++d) n *= shape[d];
    return n;
  }
  /// Row-major contiguous (size-1 dimensions may have any stride).
  bool is_contiguous() const {
    int64_t expected = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      if (shape[d] != 1 && strides[d] != expected) return false;
      expected *= shape[d];
    }
    return true;
  }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }

  /// A contiguous view of `data` with the given shape.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               DeviceType device = DeviceType::kCPU, int device_index = 0);
  /// "[2, 3, 4] bfloat16 cuda:0" — for error messages.
  std::string describe() const;
};

}  // namespace pagedllm
