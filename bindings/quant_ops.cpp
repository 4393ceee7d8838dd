// Bindings for pagedllm/quant_ops.h. The GIL is released while a kernel launches.
#include "pagedllm/quant_ops.h"

#include "registry.h"

PAGEDLLM_BINDING(quant_ops, m) {
  namespace py = pybind11;
  m.attr("FP8_GEMV_MAX_TOKENS") = pagedllm::kFp8GemvMaxTokens;
  m.def("fp8_gemv", &pagedllm::fp8_gemv, py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("scale"),
        py::arg("bias") = nullptr, py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
        "CUDA: out [M, N] = x [M, K] @ (e4m3 weight [N, K] * scale)^T + bias, M <= 8 (weight-only FP8 GEMV)");
  m.def("int4_dequantize", &pagedllm::int4_dequantize, py::arg("out"), py::arg("nibbles"), py::arg("scale_zero"),
        py::arg("group_size"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
        "CUDA: out bf16 [N, K] = (q - 8) * scale + zero from nibbles uint8 [N, K/2] and scale_zero bf16 [K/g, N, 2]");
}
