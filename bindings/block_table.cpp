// Bindings for pagedllm/block_table.h. Copy orders come back as (src, dst) tuples.
#include "pagedllm/block_table.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <optional>
#include <utility>

#include "registry.h"

PAGEDLLM_BINDING(block_table, m) {
  namespace py = pybind11;
  using pagedllm::BlockPool;
  using pagedllm::BlockTable;
  using pagedllm::CopyOrder;
  using Copies = std::vector<std::pair<int32_t, int32_t>>;
  m.def("check_block_size", &pagedllm::check_block_size, py::arg("block_size"),
        "Raise ValueError unless block_size is a power of two in [8, 128].");
  py::class_<BlockTable>(m, "BlockTable",
                         "One sequence's logical-to-physical block list over a BlockPool; fork() "
                         "shares blocks, appending into a shared partial block is copy-on-write.")
      .def(py::init<int32_t>(), py::arg("block_size"))
      .def_property_readonly("block_size", &BlockTable::block_size)
      .def_property_readonly("num_tokens", &BlockTable::num_tokens)
      .def_property_readonly("num_blocks", &BlockTable::num_blocks)
      .def("block_ids",
           [](const BlockTable& t) {
             auto ids = t.block_ids();
             return py::array_t<int32_t>(static_cast<py::ssize_t>(ids.size()), ids.data());
           },
           "Physical block ids in logical order (int32 array, a copy).")
      .def("slot", &BlockTable::slot, py::arg("position"))
      .def("num_blocks_needed", &BlockTable::num_blocks_needed, py::arg("pool"),
           py::arg("num_new_tokens"))
      .def("append_slots",
           [](BlockTable& t, BlockPool& pool, int32_t n) -> std::optional<Copies> {
             std::vector<CopyOrder> copies;
             if (!t.append_slots(pool, n, &copies)) return std::nullopt;
             Copies out;
             for (auto c : copies) out.emplace_back(c.src, c.dst);
             return out;
           },
           py::arg("pool"), py::arg("num_new_tokens"),
           "Reserve slots; returns the copy-on-write orders [(src, dst)], or None (nothing "
           "changed) when the pool lacks free blocks. Test the result with `is None`.")
      .def("share_full_blocks",
           [](BlockTable& t, BlockPool& pool, std::vector<int32_t> blocks) {
             t.share_full_blocks(pool, blocks);
           },
           py::arg("pool"), py::arg("blocks"))
      .def("fork", &BlockTable::fork, py::arg("pool"))
      .def("free", &BlockTable::free, py::arg("pool"), "Release every block, last first.");
}
