// Bindings for pagedllm/block_pool.h.
#include "pagedllm/block_pool.h"

#include <pybind11/stl.h>

#include "registry.h"

PAGEDLLM_BINDING(block_pool, m) {
  namespace py = pybind11;
  using pagedllm::BlockPool;
  m.attr("NO_BLOCK") = pagedllm::kNoBlock;
  py::class_<BlockPool>(m, "BlockPool",
                        "Physical KV blocks: ref counts and the LRU free queue (O(1) allocate, "
                        "free, and removal of a free block from the middle).")
      .def(py::init<int32_t>(), py::arg("num_blocks"))
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("num_free_blocks", &BlockPool::num_free_blocks)
      .def("allocate", &BlockPool::allocate,
           "Pop the free queue's head with ref_count 1; NO_BLOCK (-1) when none is free.")
      .def("incref", &BlockPool::incref, py::arg("block"),
           "ref_count + 1 (a free block leaves the free queue).")
      .def("release", &BlockPool::release, py::arg("block"),
           "ref_count - 1; at 0 the block joins the free queue. ValueError on a double free.")
      .def("set_reusable", &BlockPool::set_reusable, py::arg("block"), py::arg("reusable"),
           "Mark a block as holding prefix-cached content (freed: LRU tail instead of head).")
      .def("is_reusable", &BlockPool::is_reusable, py::arg("block"))
      .def("ref_count", &BlockPool::ref_count, py::arg("block"))
      .def("is_free", &BlockPool::is_free, py::arg("block"))
      .def("free_queue", &BlockPool::free_queue, "Free block ids, head (next allocated) first.");
}
