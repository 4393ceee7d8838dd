// Bindings for pagedllm/attention.h. The GIL is released while a kernel runs.
#include "pagedllm/attention.h"

#include <pybind11/stl.h>

#include "registry.h"

PAGEDLLM_BINDING(attention, m) {
  namespace py = pybind11;
  using pagedllm::AttentionOptions;
  using pagedllm::TensorView;
  m.def("supported_head_sizes", &pagedllm::supported_head_sizes,
        "Head sizes the attention kernels support.");
  m.def("supported_block_sizes", &pagedllm::supported_block_sizes,
        "Block sizes (tokens per KV block) the kernels support.");
  // The dtype names that `list` (supported_cache_dtypes, fp8_query_dtypes) gives for "cpu" or "cuda".
  auto dtype_names = [](const char* op, auto list) {
    return [op, list](const std::string& device) {
      PAGEDLLM_CHECK(device == "cpu" || device == "cuda", op, ": device '", device,
                     "' is not supported; expected 'cpu' or 'cuda'");
      std::vector<std::string> names;
      for (auto d : list(device == "cpu" ? pagedllm::DeviceType::kCPU : pagedllm::DeviceType::kCUDA))
        names.emplace_back(pagedllm::dtype_name(d));
      return names;
    };
  };
  m.def("supported_cache_dtypes", dtype_names("supported_cache_dtypes", &pagedllm::supported_cache_dtypes),
        py::arg("device"), "Cache dtype names the kernels of 'cpu' or 'cuda' implement.");
  m.def("fp8_query_dtypes", dtype_names("fp8_query_dtypes", &pagedllm::fp8_query_dtypes), py::arg("device"),
        "Query / out dtype names the kernels of 'cpu' or 'cuda' take with an FP8 KV cache.");
  m.def("set_num_threads", &pagedllm::set_num_threads, py::arg("n"),
        "Threads of the CPU kernels; n <= 0 = all cores.");
  m.def("get_num_threads", &pagedllm::get_num_threads, "Threads of the CPU kernels.");
  m.def("cpu_attention_uses_amx", &pagedllm::cpu_attention_uses_amx,
        "True when the CPU attention runs bfloat16 caches of head size 64 / 128 on AMX tiles.");
  m.def(
      "paged_attention",
      [](const TensorView& out, const TensorView& query, const TensorView& key_cache,
         const TensorView& value_cache, const TensorView& block_tables, const TensorView& seq_lens,
         double scale, int32_t sliding_window, float soft_cap, int32_t split_k, std::uintptr_t stream,
         std::uintptr_t workspace, int64_t workspace_bytes, bool early_context_loads, const TensorView* k_scale,
         const TensorView* v_scale) {
        AttentionOptions options{sliding_window, soft_cap, split_k};
        options.workspace = reinterpret_cast<void*>(workspace);
        options.workspace_bytes = workspace_bytes;
        options.early_context_loads = early_context_loads;
        if (k_scale != nullptr) options.kv_scales.k_scale = *k_scale;
        if (v_scale != nullptr) options.kv_scales.v_scale = *v_scale;
        pagedllm::paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, options,
                                  stream);
      },
      py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
      py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window") = 0,
      py::arg("soft_cap") = 0.0f, py::arg("split_k") = -1, py::arg("stream") = 0, py::arg("workspace") = 0,
      py::arg("workspace_bytes") = 0, py::arg("early_context_loads") = false, py::arg("k_scale") = nullptr,
      py::arg("v_scale") = nullptr,
      py::call_guard<py::gil_scoped_release>(), "Decode paged attention (see pagedllm/attention.h).");
  m.def(
      "last_cuda_decode_plan",
      [] {
        const pagedllm::DecodePlanInfo info = pagedllm::last_cuda_decode_plan();
        py::dict d;
        d["kernel"] = info.kernel;
        d["splits"] = info.splits;
        d["combine"] = info.combine;
        return d;
      },
      "What this thread's last CUDA paged_attention call ran: {'kernel', 'splits', 'combine'} "
      "(see pagedllm/attention.h).");
  m.def(
      "paged_prefill_attention",
      [](const TensorView& out, const TensorView& query, const TensorView& key_cache,
         const TensorView& value_cache, const TensorView& block_tables, const TensorView& seq_lens,
         const TensorView& query_start_loc, double scale, int32_t sliding_window, float soft_cap,
         std::uintptr_t stream, const TensorView* k_scale, const TensorView* v_scale) {
        AttentionOptions options{sliding_window, soft_cap, -1};
        if (k_scale != nullptr) options.kv_scales.k_scale = *k_scale;
        if (v_scale != nullptr) options.kv_scales.v_scale = *v_scale;
        pagedllm::paged_prefill_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                          query_start_loc, scale, options, stream);
      },
      py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
      py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"),
      py::arg("sliding_window") = 0, py::arg("soft_cap") = 0.0f, py::arg("stream") = 0,
      py::arg("k_scale") = nullptr, py::arg("v_scale") = nullptr,
      py::call_guard<py::gil_scoped_release>(),
      "Varlen causal paged attention for prefill / mixed batches (see pagedllm/attention.h).");
}
