// Bindings for pagedllm/cache_ops.h. The GIL is released while a kernel runs.
#include "pagedllm/cache_ops.h"

#include <pybind11/stl.h>

#include "registry.h"

PAGEDLLM_BINDING(cache_ops, m) {
  namespace py = pybind11;
  using pagedllm::TensorView;
  m.def(
      "kv_cache_shape",
      [](int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, int64_t head_size) {
        auto s = pagedllm::kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size);
        return py::make_tuple(s[0], s[1], s[2], s[3]);
      },
      py::arg("num_blocks"), py::arg("block_size"), py::arg("num_kv_heads"), py::arg("head_size"),
      "(num_blocks, num_kv_heads, block_size, head_size): one layer's key (or value) cache shape.");
  m.def(
      "reshape_and_cache",
      [](const TensorView& key, const TensorView& value, const TensorView& key_cache, const TensorView& value_cache,
         const TensorView& slot_mapping, std::uintptr_t stream, const TensorView* k_scale, const TensorView* v_scale) {
        pagedllm::KVCacheScales scales;
        if (k_scale != nullptr) scales.k_scale = *k_scale;
        if (v_scale != nullptr) scales.v_scale = *v_scale;
        pagedllm::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, scales, stream);
      },
      py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
      py::arg("stream") = 0, py::arg("k_scale") = nullptr, py::arg("v_scale") = nullptr,
      py::call_guard<py::gil_scoped_release>(),
      "Write key/value [T, Hkv, D] into the paged caches at slot_mapping (int64 [T]; < 0 skips); FP8 caches "
      "store key / k_scale, value / v_scale (float32 [1] views; None = 1.0).");
  m.def("copy_blocks", &pagedllm::copy_blocks, py::arg("key_caches"), py::arg("value_caches"),
        py::arg("block_mapping"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
        "Copy blocks (src, dst) of block_mapping int64 [C, 2] within every layer's caches.");
  m.def("swap_blocks", &pagedllm::swap_blocks, py::arg("src"), py::arg("dst"),
        py::arg("block_mapping"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
        "Copy blocks (src, dst) between two caches, possibly on different devices.");
}
