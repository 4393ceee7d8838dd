// Bindings for pagedllm/cpu_decoder.h. The GIL is released while a step runs.
#include "pagedllm/cpu_decoder.h"

#include <pybind11/stl.h>

#include <optional>
#include <vector>

#include "registry.h"

PAGEDLLM_BINDING(cpu_decoder, m) {
  namespace py = pybind11;
  using pagedllm::TensorView;
  m.attr("CPU_DECODER_MAX_TOKENS") = pagedllm::kCpuDecoderMaxTokens;
  py::class_<pagedllm::CpuDecoderConfig>(m, "CpuDecoderConfig", "Shapes of a Llama-family decoder stack.")
      .def(py::init<>())
      .def_readwrite("hidden_size", &pagedllm::CpuDecoderConfig::hidden_size)
      .def_readwrite("intermediate_size", &pagedllm::CpuDecoderConfig::intermediate_size)
      .def_readwrite("num_heads", &pagedllm::CpuDecoderConfig::num_heads)
      .def_readwrite("num_kv_heads", &pagedllm::CpuDecoderConfig::num_kv_heads)
      .def_readwrite("head_dim", &pagedllm::CpuDecoderConfig::head_dim)
      .def_readwrite("rms_norm_eps", &pagedllm::CpuDecoderConfig::rms_norm_eps)
      .def_readwrite("scale", &pagedllm::CpuDecoderConfig::scale);
  py::class_<pagedllm::CpuDecoderLayer>(m, "CpuDecoderLayer", "One layer's weights and KV cache (views).")
      .def(py::init<>())
      .def_readwrite("input_norm", &pagedllm::CpuDecoderLayer::input_norm)
      .def_readwrite("qkv", &pagedllm::CpuDecoderLayer::qkv)
      .def_readwrite("qkv_bias", &pagedllm::CpuDecoderLayer::qkv_bias)
      .def_readwrite("q_norm", &pagedllm::CpuDecoderLayer::q_norm)
      .def_readwrite("k_norm", &pagedllm::CpuDecoderLayer::k_norm)
      .def_readwrite("o", &pagedllm::CpuDecoderLayer::o)
      .def_readwrite("post_norm", &pagedllm::CpuDecoderLayer::post_norm)
      .def_readwrite("gate_up", &pagedllm::CpuDecoderLayer::gate_up)
      .def_readwrite("gate_up_bias", &pagedllm::CpuDecoderLayer::gate_up_bias)
      .def_readwrite("down", &pagedllm::CpuDecoderLayer::down)
      .def_readwrite("down_bias", &pagedllm::CpuDecoderLayer::down_bias)
      .def_readwrite("key_cache", &pagedllm::CpuDecoderLayer::key_cache)
      .def_readwrite("value_cache", &pagedllm::CpuDecoderLayer::value_cache)
      .def_readwrite("sliding_window", &pagedllm::CpuDecoderLayer::sliding_window)
      .def_property(
          "k_scale", [](const pagedllm::CpuDecoderLayer& l) { return l.kv_scales.k_scale; },
          [](pagedllm::CpuDecoderLayer& l, const pagedllm::TensorView& v) { l.kv_scales.k_scale = v; },
          "FP8 caches: the layer's key scale (float32 [1] cpu tensor view; unset = 1.0)")
      .def_property(
          "v_scale", [](const pagedllm::CpuDecoderLayer& l) { return l.kv_scales.v_scale; },
          [](pagedllm::CpuDecoderLayer& l, const pagedllm::TensorView& v) { l.kv_scales.v_scale = v; },
          "FP8 caches: the layer's value scale (float32 [1] cpu tensor view; unset = 1.0)");
  py::class_<pagedllm::CpuDecoderStack>(m, "CpuDecoderStack",
                                        "Llama decoder layers run natively on the CPU (pagedllm/cpu_decoder.h).")
      .def(py::init<const pagedllm::CpuDecoderConfig&, std::vector<pagedllm::CpuDecoderLayer>, const TensorView&>(),
           py::arg("config"), py::arg("layers"), py::arg("cos_sin_cache"))
      .def_property_readonly("num_layers", &pagedllm::CpuDecoderStack::num_layers)
      .def(
          "forward",
          [](pagedllm::CpuDecoderStack& self, int64_t start, int64_t end, const TensorView& hidden,
             const TensorView& residual, bool has_residual, const TensorView& positions, const TensorView& slot_mapping,
             const TensorView& block_tables, const TensorView& seq_lens, const TensorView& query_start_loc,
             bool decode_only) {
            self.forward(start, end, hidden, residual, has_residual,
                         {positions, slot_mapping, block_tables, seq_lens, query_start_loc, decode_only});
          },
          py::arg("start"), py::arg("end"), py::arg("hidden"), py::arg("residual"), py::arg("has_residual"),
          py::arg("positions"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"),
          py::arg("query_start_loc"), py::arg("decode_only"), py::call_guard<py::gil_scoped_release>(),
          "Layers [start, end) over hidden and residual [T, hidden_size] in place.");
}
