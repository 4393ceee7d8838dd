// Bindings for pagedllm/cpu_linear.h. The GIL is released while a kernel runs.
#include "pagedllm/cpu_linear.h"

#include <pybind11/stl.h>

#include <optional>

#include "registry.h"

PAGEDLLM_BINDING(cpu_linear, m) {
  namespace py = pybind11;
  m.def("amx_linear_supported", &pagedllm::amx_linear_supported,
        "Whether the AMX projection kernels can run on this machine and build.");
  m.def("amx_packed_weight_shape", &pagedllm::amx_packed_weight_shape, py::arg("out_features"),
        py::arg("in_features"), "Shape of the packed weight: [N/32, K/32, 2, 16, 32].");
  m.def("amx_pack_linear_weight", &pagedllm::amx_pack_linear_weight, py::arg("packed"), py::arg("weight"),
        py::call_guard<py::gil_scoped_release>(), "packed <- weight bf16 [N, K] as AMX B tiles.");
  m.def(
      "amx_linear",
      [](const pagedllm::TensorView& out, const pagedllm::TensorView& x, const pagedllm::TensorView& packed,
         const std::optional<pagedllm::TensorView>& bias) {
        pagedllm::amx_linear(out, x, packed, bias ? &*bias : nullptr);
      },
      py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(),
      py::call_guard<py::gil_scoped_release>(), "out [M, N] = x [M, K] @ weight^T (+ bias) from the packed weight.");
  m.def(
      "amx_linear_silu_mul",
      [](const pagedllm::TensorView& out, const pagedllm::TensorView& x, const pagedllm::TensorView& packed,
         const std::optional<pagedllm::TensorView>& bias) {
        pagedllm::amx_linear_silu_mul(out, x, packed, bias ? &*bias : nullptr);
      },
      py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(),
      py::call_guard<py::gil_scoped_release>(),
      "out [M, I] = silu(gate) * up of the gate_up projection x [M, K] @ weight [2I, K]^T (+ bias).");
  m.def(
      "amx_linear_argmax",
      [](const pagedllm::TensorView& out, const pagedllm::TensorView& x, const pagedllm::TensorView& packed,
         int64_t vocab, const std::optional<pagedllm::TensorView>& bias) {
        pagedllm::amx_linear_argmax(out, x, packed, vocab, bias ? &*bias : nullptr);
      },
      py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("vocab") = 0, py::arg("bias") = py::none(),
      py::call_guard<py::gil_scoped_release>(),
      "out int64 [M] = per-row argmax over columns [0, vocab) of x @ weight^T (+ bias), logits not written.");
}
