// Bindings for pagedllm/gemv.h. The GIL is released while the launcher runs.
#include "pagedllm/gemv.h"

#include <pybind11/stl.h>

#include <optional>

#include "registry.h"

namespace {

pagedllm::GemvConfig make_config(int variant, int warps, int splits, int prefetch) {
  pagedllm::GemvConfig c;
  c.variant = variant;
  c.warps = warps;
  c.splits = splits;
  c.prefetch = prefetch;
  return c;
}

}  // namespace

PAGEDLLM_BINDING(gemv, m) {
  namespace py = pybind11;
  using pagedllm::TensorView;
  m.attr("gemv_max_tokens") = pagedllm::kGemvMaxTokens;
  m.def("gemv_built_with_cuda", &pagedllm::gemv_built_with_cuda, "Whether this build has the GEMV kernels.");
  m.def(
      "gemv",
      [](const TensorView& out, const TensorView& input, const TensorView& weight,
         const std::optional<TensorView>& bias, bool silu_and_mul, std::uintptr_t stream, int variant, int warps,
         int splits, int prefetch) {
        const auto config = make_config(variant, warps, splits, prefetch);
        const TensorView* b = bias ? &*bias : nullptr;
        if (silu_and_mul) pagedllm::silu_and_mul_gemv(out, input, weight, b, stream, &config);
        else pagedllm::gemv(out, input, weight, b, stream, &config);
      },
      py::arg("out"), py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(),
      py::arg("silu_and_mul") = false, py::arg("stream") = 0, py::arg("variant") = 0, py::arg("warps") = 0,
      py::arg("splits") = 0, py::arg("prefetch") = -1, py::call_guard<py::gil_scoped_release>(),
      "out [M, N] = input [M, K] @ weight [N, K]^T (+ bias); silu_and_mul: input [M, 2K] and the "
      "product uses SiLU(input[:, :K]) * input[:, K:]. variant/warps/splits/prefetch: GemvConfig "
      "tuning overrides (0 / -1: automatic).");
  m.def("l2_prefetch", &pagedllm::l2_prefetch, py::arg("tensor"), py::arg("stream") = 0,
        py::call_guard<py::gil_scoped_release>(),
        "Ask the L2 cache to fetch a contiguous CUDA tensor's bytes (asynchronous hint, sm_90).");
}
