// Bindings for pagedllm/cpu_woq_linear.h. The GIL is released while a kernel runs.
#include "pagedllm/cpu_woq_linear.h"

#include "registry.h"

PAGEDLLM_BINDING(cpu_woq_linear, m) {
  namespace py = pybind11;
  m.def("woq_linear_avx512", &pagedllm::woq_linear_avx512,
        "whether woq_linear runs its AVX-512 kernel (else a portable loop)");
  m.def("woq_pack_weight", &pagedllm::woq_pack_weight, py::arg("packed"), py::arg("codes"), py::arg("bits"),
        py::call_guard<py::gil_scoped_release>(),
        "packed [N/16, K, 16] int8 (bits 8) or [N/16, K/2, 16] uint8 (bits 4) <- codes [N, K]");
  m.def("woq_vnni_available", &pagedllm::woq_vnni_available, "whether woq_vnni_linear runs here (AVX-512 VNNI)");
  m.def("woq_vnni_pack_weight", &pagedllm::woq_vnni_pack_weight, py::arg("packed"), py::arg("codes"), py::arg("bits"),
        py::call_guard<py::gil_scoped_release>(),
        "packed uint8 [N/16, K/4, 64] (bits 8: codes + 128) or [N/16, K/4, 32] (bits 4) <- codes [N, K]");
  m.def("woq_vnni_linear", &pagedllm::woq_vnni_linear, py::arg("out"), py::arg("x"), py::arg("packed"),
        py::arg("bits"), py::arg("scale"), py::arg("min") = nullptr, py::arg("bias") = nullptr,
        py::call_guard<py::gil_scoped_release>(),
        "out [M, N]: the weight-only quantized product with x quantized to int8 per token and weight group (VNNI)");
  m.def("woq_linear", &pagedllm::woq_linear, py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bits"),
        py::arg("scale"), py::arg("min") = nullptr, py::arg("bias") = nullptr,
        py::call_guard<py::gil_scoped_release>(),
        "out [M, N] = x [M, K] @ (scale * codes + min)^T + bias, per group of inputs (weight-only quantized)");
}
