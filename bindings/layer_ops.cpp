// Bindings for pagedllm/layer_ops.h. The GIL is released while a kernel runs.
#include "pagedllm/layer_ops.h"

#include <string>

#include "pagedllm/errors.h"

#include "registry.h"

PAGEDLLM_BINDING(layer_ops, m) {
  namespace py = pybind11;
  using pagedllm::TensorView;
  m.def("layer_ops_built_with_cuda", &pagedllm::layer_ops_built_with_cuda,
        "Whether this build has the CUDA layer kernels.");
  m.def("rms_norm", &pagedllm::rms_norm, py::arg("out"), py::arg("input"), py::arg("weight"), py::arg("eps"),
        py::arg("stream") = 0, py::arg("fp8_out") = nullptr, py::arg("fp8_scale") = nullptr,
        py::call_guard<py::gil_scoped_release>(),
        "out [T, N] = RMSNorm(input [T, N]) * weight [N]; with fp8_out / fp8_scale (CUDA) also its per-token FP8.");
  m.def("fused_add_rms_norm", &pagedllm::fused_add_rms_norm, py::arg("input"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"), py::arg("stream") = 0, py::arg("fp8_out") = nullptr,
        py::arg("fp8_scale") = nullptr, py::call_guard<py::gil_scoped_release>(),
        "In place: residual += input; input = RMSNorm(residual) * weight; with fp8_out / fp8_scale (CUDA) also "
        "input's per-token FP8.");
  m.def("silu_and_mul", &pagedllm::silu_and_mul, py::arg("out"), py::arg("input"), py::arg("stream") = 0,
        py::arg("paired_rows") = false, py::call_guard<py::gil_scoped_release>(),
        "out [T, I] = SiLU(input[:, :I]) * input[:, I:]; paired_rows: input in the gate_up_paired_row order.");
  m.def("scaled_fp8_quant", &pagedllm::scaled_fp8_quant, py::arg("out"), py::arg("scale"), py::arg("input"),
        py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
        "CUDA: per-token FP8 e4m3 quantization: scale [T] = max|input[t]| / 448, out uint8 [T, K] the e4m3 bits.");
  m.def("rotary_embedding", &pagedllm::rotary_embedding, py::arg("positions"), py::arg("query"), py::arg("key"),
        py::arg("cos_sin_cache"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
        "Rotate query [T, Hq, D] and key [T, Hkv, D] in place (NeoX layout) by positions int64 [T].");
  m.def(
      "rotary_embedding_and_cache",
      [](const TensorView& positions, const TensorView& query, const TensorView& key, const TensorView& value,
         const TensorView& cos_cache, const TensorView& sin_cache, const TensorView& query_out,
         const TensorView& key_cache, const TensorView& value_cache, const TensorView& slot_mapping,
         std::uintptr_t stream, bool paired_rows, const TensorView* k_scale, const TensorView* v_scale) {
        pagedllm::KVCacheScales scales;
        if (k_scale != nullptr) scales.k_scale = *k_scale;
        if (v_scale != nullptr) scales.v_scale = *v_scale;
        pagedllm::rotary_embedding_and_cache(positions, query, key, value, cos_cache, sin_cache, query_out, key_cache,
                                             value_cache, slot_mapping, stream, paired_rows, scales);
      },
      py::arg("positions"), py::arg("query"), py::arg("key"), py::arg("value"), py::arg("cos_cache"),
      py::arg("sin_cache"), py::arg("query_out"), py::arg("key_cache"), py::arg("value_cache"),
      py::arg("slot_mapping"), py::arg("stream") = 0, py::arg("paired_rows") = false, py::arg("k_scale") = nullptr,
      py::arg("v_scale") = nullptr, py::call_guard<py::gil_scoped_release>(),
      "RoPE: rotated query -> query_out, rotated key and value -> the paged caches at slot_mapping; "
      "paired_rows: query and key in the rotary_paired_row order; k_scale / v_scale: an FP8 cache's scales.");
  m.def(
      "rotary_paired_row",
      [](int feature, int rot_half) {
        if (rot_half <= 0 || rot_half % 8 != 0)
          throw pagedllm::InvalidArgument("rotary_paired_row: rot_half must be a positive multiple of 8, got " +
                                          std::to_string(rot_half));
        if (feature < 0 || feature >= 2 * rot_half)
          throw pagedllm::InvalidArgument("rotary_paired_row: feature must be in [0, " + std::to_string(2 * rot_half) +
                                          "), got " + std::to_string(feature));
        return pagedllm::rotary_paired_row(feature, rot_half);
      },
      py::arg("feature"), py::arg("rot_half"), "The row of a head's feature in the paired-rows order (layer_ops.h).");
  m.def(
      "gate_up_paired_row",
      [](int64_t row, int64_t intermediate) {
        if (intermediate <= 0 || intermediate % 8 != 0)
          throw pagedllm::InvalidArgument("gate_up_paired_row: intermediate must be a positive multiple of 8, got " +
                                          std::to_string(intermediate));
        if (row < 0 || row >= 2 * intermediate)
          throw pagedllm::InvalidArgument("gate_up_paired_row: row must be in [0, " + std::to_string(2 * intermediate) +
                                          "), got " + std::to_string(row));
        return pagedllm::gate_up_paired_row(row, intermediate);
      },
      py::arg("row"), py::arg("intermediate"),
      "The standard [gate; up] row held by row `row` of the paired gate/up order (layer_ops.h).");
}
