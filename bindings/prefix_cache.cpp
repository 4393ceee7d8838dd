// Bindings for pagedllm/prefix_cache.h. Token ids: any int32-convertible sequence or array.
#include "pagedllm/prefix_cache.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <span>

#include "registry.h"

namespace {
namespace py = pybind11;
using Tokens = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
std::span<const int32_t> as_span(const Tokens& a) {
  if (a.ndim() != 1) throw pagedllm::InvalidArgument("token_ids must be 1-D, got ndim " + std::to_string(a.ndim()));
  return {a.data(), static_cast<size_t>(a.size())};
}
}  // namespace

PAGEDLLM_BINDING(prefix_cache, m) {
  using pagedllm::ChainLink;
  using pagedllm::PrefixCache;
  py::class_<ChainLink>(m, "ChainLink", "Where a hash chain stands: last hash + the parent entry.")
      .def_readonly("hash", &ChainLink::hash)
      .def_readonly("block", &ChainLink::block)
      .def_readonly("generation", &ChainLink::generation)
      .def_static("root", &ChainLink::root)
      .def_static("dead", &ChainLink::dead, py::arg("hash"))
      .def("__eq__", [](const ChainLink& a, const ChainLink& b) { return a == b; })
      .def("__repr__", [](const ChainLink& l) {
        return "ChainLink(hash=" + std::to_string(l.hash) + ", block=" + std::to_string(l.block) +
               ", generation=" + std::to_string(l.generation) + ")";
      });
  py::class_<PrefixCache>(m, "PrefixCache",
                          "Full KV blocks keyed by a chained hash; lookups verify tokens and the "
                          "parent entry, so a hash collision can only miss.")
      .def(py::init<int32_t, int32_t>(), py::arg("num_blocks"), py::arg("block_size"))
      .def_property_readonly("block_size", &PrefixCache::block_size)
      .def_property_readonly("num_cached_blocks", &PrefixCache::num_cached_blocks)
      .def_static("hash_block",
                  [](uint64_t parent_hash, const Tokens& tokens, uint64_t extra_key) {
                    return PrefixCache::hash_block(parent_hash, as_span(tokens), extra_key);
                  },
                  py::arg("parent_hash"), py::arg("tokens"), py::arg("extra_key") = 0)
      .def("lookup",
           [](const PrefixCache& c, const ChainLink& parent, uint64_t hash, const Tokens& tokens,
              uint64_t extra_key) { return c.lookup(parent, hash, as_span(tokens), extra_key); },
           py::arg("parent"), py::arg("hash"), py::arg("tokens"), py::arg("extra_key") = 0,
           "Block caching these tokens after `parent`, or NO_BLOCK (-1).")
      .def("match_prefix",
           [](const PrefixCache& c, const Tokens& tokens, uint64_t extra_key, int32_t max_blocks) {
             std::vector<int32_t> blocks;
             ChainLink link = c.match_prefix(as_span(tokens), extra_key, max_blocks, &blocks);
             return py::make_tuple(blocks, link);
           },
           py::arg("tokens"), py::arg("extra_key") = 0, py::arg("max_blocks") = INT32_MAX,
           "(hit block ids, link after the last hit) for the full blocks of tokens.")
      .def("insert",
           [](PrefixCache& c, int32_t block, const ChainLink& parent, uint64_t hash,
              const Tokens& tokens, uint64_t extra_key) {
             return c.insert(block, parent, hash, as_span(tokens), extra_key);
           },
           py::arg("block"), py::arg("parent"), py::arg("hash"), py::arg("tokens"),
           py::arg("extra_key") = 0)
      .def("evict", &PrefixCache::evict, py::arg("block"))
      .def("is_cached", &PrefixCache::is_cached, py::arg("block"))
      .def("link", &PrefixCache::link, py::arg("block"));
}
