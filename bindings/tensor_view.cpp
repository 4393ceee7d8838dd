// Bindings for pagedllm/tensor_view.h: Python builds a TensorView from any tensor's data pointer,
// dtype name, shape, strides (elements) and device (pagedllm.ops does it for torch tensors).
#include "pagedllm/tensor_view.h"

#include <pybind11/stl.h>

#include <vector>

#include "registry.h"

PAGEDLLM_BINDING(tensor_view, m) {
  namespace py = pybind11;
  using pagedllm::TensorView;
  py::class_<TensorView>(m, "TensorView",
                         "Non-owning view of a strided tensor (pointer, dtype, shape, strides in "
                         "elements, device). The memory must outlive every use of the view.")
      .def(py::init([](std::uintptr_t data, const std::string& dtype, const std::vector<int64_t>& shape,
                       const std::vector<int64_t>& strides, const std::string& device, int device_index) {
             PAGEDLLM_CHECK(shape.size() == strides.size(), "TensorView: shape has ", shape.size(),
                            " dimensions but strides has ", strides.size());
             PAGEDLLM_CHECK(static_cast<int>(shape.size()) <= TensorView::kMaxDims,
                            "TensorView supports at most ", TensorView::kMaxDims, " dimensions, got ",
                            shape.size());
             PAGEDLLM_CHECK(device == "cpu" || device == "cuda", "TensorView: device '", device,
                            "' is not supported; expected 'cpu' or 'cuda'");
             TensorView v;
             v.data = reinterpret_cast<void*>(data);
             v.dtype = pagedllm::parse_dtype(dtype);
             v.device = device == "cpu" ? pagedllm::DeviceType::kCPU : pagedllm::DeviceType::kCUDA;
             v.device_index = device_index;
             v.ndim = static_cast<int>(shape.size());
             for (int d = 0; d < v.ndim; ++d) {
               v.shape[d] = shape[d];
               v.strides[d] = strides[d];
             }
             return v;
           }),
           py::arg("data_ptr"), py::arg("dtype"), py::arg("shape"), py::arg("strides"),
           py::arg("device") = "cpu", py::arg("device_index") = 0)
      .def_static(
          "from_parts",
          [](std::uintptr_t data, int dtype_code, const py::tuple& shape, const py::tuple& strides, bool cuda,
             int device_index) {
            // The hot path of pagedllm.ops._view (several calls per kernel launch): integer dtype
            // code (the order of pagedllm::DType), shape and strides as tuples read in place.
            PAGEDLLM_CHECK(dtype_code >= 0 && dtype_code <= static_cast<int>(pagedllm::DType::kFloat8E5M2),
                           "TensorView.from_parts: dtype code ", dtype_code, " is out of range");
            const auto ndim = static_cast<int>(PyTuple_GET_SIZE(shape.ptr()));
            PAGEDLLM_CHECK(ndim == static_cast<int>(PyTuple_GET_SIZE(strides.ptr())), "TensorView: shape has ",
                           ndim, " dimensions but strides has ", PyTuple_GET_SIZE(strides.ptr()));
            PAGEDLLM_CHECK(ndim <= TensorView::kMaxDims, "TensorView supports at most ", TensorView::kMaxDims,
                           " dimensions, got ", ndim);
            TensorView v;
            v.data = reinterpret_cast<void*>(data);
            v.dtype = static_cast<pagedllm::DType>(dtype_code);
            v.device = cuda ? pagedllm::DeviceType::kCUDA : pagedllm::DeviceType::kCPU;
            v.device_index = device_index;
            v.ndim = ndim;
            for (int d = 0; d < ndim; ++d) {
              v.shape[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), d));
              v.strides[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(strides.ptr(), d));
            }
            if (PyErr_Occurred()) throw py::error_already_set();
            return v;
          },
          py::arg("data_ptr"), py::arg("dtype_code"), py::arg("shape"), py::arg("strides"), py::arg("cuda"),
          py::arg("device_index"),
          "TensorView from a pointer, a pagedllm::DType code (float32, float16, bfloat16, int32, int64, "
          "uint8, int8, float8_e4m3fn, float8_e5m2 = 0..8), shape and strides tuples (elements) and the device (cuda flag, index).")
      .def_property_readonly("shape", [](const TensorView& v) {
        return std::vector<int64_t>(v.shape, v.shape + v.ndim);
      })
      .def_property_readonly("strides", [](const TensorView& v) {
        return std::vector<int64_t>(v.strides, v.strides + v.ndim);
      })
      .def_property_readonly("dtype", [](const TensorView& v) { return pagedllm::dtype_name(v.dtype); })
      .def_property_readonly("device", [](const TensorView& v) { return pagedllm::device_name(v.device); })
      .def("__repr__", [](const TensorView& v) { return "TensorView(" + v.describe() + ")"; });
}
