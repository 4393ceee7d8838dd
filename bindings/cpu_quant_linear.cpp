// Bindings for pagedllm/cpu_quant_linear.h. The GIL is released while a kernel runs.
#include "pagedllm/cpu_quant_linear.h"

#include "registry.h"

PAGEDLLM_BINDING(cpu_quant_linear, m) {
  namespace py = pybind11;
  m.def("int8_linear_vnni", &pagedllm::int8_linear_vnni,
        "whether int8_linear runs the AVX-512 VNNI kernel (else a portable loop)");
  m.def("int8_activation_group", &pagedllm::int8_activation_group, py::arg("in_features"),
        "activation elements per scale: the largest of 256, 192, 128, 64 dividing in_features, else in_features");
  m.def("int8_pack_linear_weight", &pagedllm::int8_pack_linear_weight, py::arg("packed"), py::arg("comp"),
        py::arg("weight"), py::call_guard<py::gil_scoped_release>(),
        "packed int8 [N/16, K/4, 16, 4], comp int32 [K/group, N] = 128 * group sums <- weight int8 [N, K]");
  m.def("int8_linear", &pagedllm::int8_linear, py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("comp"),
        py::arg("w_scale"), py::arg("bias") = nullptr, py::call_guard<py::gil_scoped_release>(),
        "out [M, N] = W8A8 product of x [M, K] (activations quantized per token) and the packed int8 weight");
}
