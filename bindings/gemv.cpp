// Bindings for pagedllm/gemv.h. The GIL is released while the launcher runs.
#include "pagedllm/gemv.h"

#include "pagedllm/errors.h"

#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

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
         int splits, int prefetch, const std::optional<TensorView>& norm_weight, float eps,
         const std::optional<TensorView>& residual, const std::optional<std::vector<TensorView>>& rope,
         int rope_heads, int rope_kv_heads, bool rope_paired_rows, bool silu_paired_rows,
         const TensorView* rope_k_scale, const TensorView* rope_v_scale) {
        const auto config = make_config(variant, warps, splits, prefetch);
        pagedllm::GemvFusion fusion;
        fusion.silu_and_mul = silu_and_mul;
        fusion.silu_paired_rows = silu_paired_rows;
        fusion.norm_weight = norm_weight ? &*norm_weight : nullptr;
        fusion.eps = eps;
        fusion.residual = residual ? &*residual : nullptr;
        pagedllm::GemvRope r;
        if (rope) {  // positions, cos, sin, query_out, key_cache, value_cache, slot_mapping[, counters]
          if (rope->size() != 8 && rope->size() != 7)
            throw pagedllm::InvalidArgument("gemv: rope takes 7 or 8 tensors (counters last), got " +
                                            std::to_string(rope->size()));
          const auto& t = *rope;
          r = {rope_heads, rope_kv_heads, &t[0], &t[1], &t[2], &t[3], &t[4], &t[5], &t[6],
               t.size() == 8 ? &t[7] : nullptr, rope_paired_rows};
          if (rope_k_scale != nullptr) r.kv_scales.k_scale = *rope_k_scale;
          if (rope_v_scale != nullptr) r.kv_scales.v_scale = *rope_v_scale;
          fusion.rope = &r;
        }
        pagedllm::gemv(out, input, weight, bias ? &*bias : nullptr, stream, &config, &fusion);
      },
      py::arg("out"), py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(),
      py::arg("silu_and_mul") = false, py::arg("stream") = 0, py::arg("variant") = 0, py::arg("warps") = 0,
      py::arg("splits") = 0, py::arg("prefetch") = -1, py::arg("norm_weight") = py::none(), py::arg("eps") = 1e-6f,
      py::arg("residual") = py::none(), py::arg("rope") = py::none(), py::arg("rope_heads") = 0,
      py::arg("rope_kv_heads") = 0, py::arg("rope_paired_rows") = false, py::arg("silu_paired_rows") = false,
      py::arg("rope_k_scale") = nullptr, py::arg("rope_v_scale") = nullptr,
      py::call_guard<py::gil_scoped_release>(),
      "out [M, N] = x [M, K] @ weight [N, K]^T (+ bias) (+ residual [M, N], may be out); x = input, "
      "or SiLU(input[:, :K]) * input[:, K:] (silu_and_mul, input [M, 2K]), or RMSNorm(input) * "
      "norm_weight (eps). variant/warps/splits/prefetch: GemvConfig tuning overrides (0 / -1: automatic). "
      "rope: [positions, cos_cache, sin_cache, query_out, key_cache, value_cache, slot_mapping, counters] "
      "with rope_heads / rope_kv_heads: the rotary + KV-cache epilogue of a qkv projection (GemvRope); "
      "rope_paired_rows: weight rows in the rotary_paired_row order (counters may be left out). "
      "silu_paired_rows: weight rows in the gate_up_paired_row order, out [M, N / 2] = SiLU(gate) * up.");
  m.def(
      "gemv_fusion_fits",
      [](int64_t tokens, int64_t in_features, const std::string& dtype) {
        return pagedllm::gemv_fusion_fits(tokens, in_features, pagedllm::parse_dtype(dtype));
      },
      py::arg("tokens"), py::arg("in_features"), py::arg("dtype"),
      "Whether a GEMV prologue fusion (norm_weight / silu_and_mul) fits the current CUDA device's "
      "shared memory for tokens x in_features elements of dtype ('bfloat16' / 'float16').");
}
