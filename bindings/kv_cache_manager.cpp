// Bindings for pagedllm/kv_cache_manager.h. Token ids: any int32-convertible sequence or numpy
// array; block ids and slots come back as numpy arrays; copy orders as [(src, dst)] tuples.
#include "pagedllm/kv_cache_manager.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <optional>
#include <span>
#include <utility>

#include "registry.h"

namespace {
namespace py = pybind11;
using Tokens = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
std::span<const int32_t> tokens_span(const Tokens& a) {
  if (a.ndim() != 1) throw pagedllm::InvalidArgument("token_ids must be 1-D, got ndim " + std::to_string(a.ndim()));
  return {a.data(), static_cast<size_t>(a.size())};
}
}  // namespace

PAGEDLLM_BINDING(kv_cache_manager, m) {
  using pagedllm::KVCacheManager;
  using pagedllm::KVCacheStats;
  using pagedllm::PrefixHit;
  using pagedllm::SeqId;
  using Copies = std::vector<std::pair<int32_t, int32_t>>;

  py::class_<PrefixHit>(m, "PrefixHit", "Cached full blocks holding the first num_tokens tokens.")
      .def(py::init([](std::vector<int32_t> blocks, int32_t num_tokens) {
             return PrefixHit{std::move(blocks), num_tokens};
           }),
           py::arg("blocks") = std::vector<int32_t>{}, py::arg("num_tokens") = 0)
      .def_readwrite("blocks", &PrefixHit::blocks)
      .def_readwrite("num_tokens", &PrefixHit::num_tokens)
      .def_readwrite("cache_epoch", &PrefixHit::cache_epoch,
                     "prefix-cache eviction count at lookup; a hit from before an eviction is stale")
      .def("__repr__", [](const PrefixHit& h) {
        return "PrefixHit(num_blocks=" + std::to_string(h.blocks.size()) +
               ", num_tokens=" + std::to_string(h.num_tokens) + ")";
      });

  py::class_<KVCacheStats>(m, "KVCacheStats", "KV-cache usage and prefix-cache counters (tokens).")
      .def_readonly("num_blocks", &KVCacheStats::num_blocks)
      .def_readonly("num_free_blocks", &KVCacheStats::num_free_blocks)
      .def_readonly("num_cached_blocks", &KVCacheStats::num_cached_blocks)
      .def_readonly("usage", &KVCacheStats::usage, "1 - num_free_blocks / num_blocks (0..1)")
      .def_readonly("prefix_cache_queries", &KVCacheStats::prefix_cache_queries, "in tokens")
      .def_readonly("prefix_cache_hits", &KVCacheStats::prefix_cache_hits, "in tokens")
      .def("__repr__", [](const KVCacheStats& s) {
        return "KVCacheStats(num_blocks=" + std::to_string(s.num_blocks) +
               ", num_free_blocks=" + std::to_string(s.num_free_blocks) +
               ", num_cached_blocks=" + std::to_string(s.num_cached_blocks) +
               ", usage=" + std::to_string(s.usage) +
               ", prefix_cache_queries=" + std::to_string(s.prefix_cache_queries) +
               ", prefix_cache_hits=" + std::to_string(s.prefix_cache_hits) + ")";
      });

  py::class_<KVCacheManager>(m, "KVCacheManager",
                             "Paged KV-cache manager: block tables per sequence, copy-on-write "
                             "fork, automatic prefix caching (see kv_cache_manager.h).")
      .def(py::init<int32_t, int32_t, bool>(), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("enable_prefix_caching") = true)
      .def_property_readonly("block_size", &KVCacheManager::block_size)
      .def_property_readonly("num_blocks", &KVCacheManager::num_blocks)
      .def_property_readonly("num_free_blocks", &KVCacheManager::num_free_blocks)
      .def_property_readonly("num_seqs", &KVCacheManager::num_seqs)
      .def_property_readonly("prefix_caching_enabled", &KVCacheManager::prefix_caching_enabled)
      .def("find_cached_prefix",
           [](KVCacheManager& kv, const Tokens& tokens, uint64_t extra_key, bool record_stats) {
             return kv.find_cached_prefix(tokens_span(tokens), extra_key, record_stats);
           },
           py::arg("token_ids"), py::arg("extra_key") = 0, py::arg("record_stats") = true,
           "Longest cached prefix of full blocks (always leaves >= 1 token to compute).")
      .def("num_blocks_needed", &KVCacheManager::num_blocks_needed, py::arg("seq"),
           py::arg("num_new_tokens"), py::arg("hit") = nullptr)
      .def("allocate_slots",
           [](KVCacheManager& kv, SeqId seq, int32_t n, const PrefixHit* hit) -> std::optional<Copies> {
             std::vector<pagedllm::CopyOrder> copies;
             if (!kv.allocate_slots(seq, n, hit, &copies)) return std::nullopt;
             Copies out;
             for (auto c : copies) out.emplace_back(c.src, c.dst);
             return out;
           },
           py::arg("seq"), py::arg("num_new_tokens"), py::arg("hit") = nullptr,
           "Reserve slots (all-or-nothing). Returns the copy-on-write orders [(src, dst)] "
           "(often empty), or None when the pool lacks blocks (nothing changed): test `is None`.")
      .def("block_ids",
           [](const KVCacheManager& kv, SeqId seq) {
             auto ids = kv.block_ids(seq);
             return py::array_t<int32_t>(static_cast<py::ssize_t>(ids.size()), ids.data());
           },
           py::arg("seq"), "Physical block ids of seq (int32 array, a copy).")
      .def("num_tokens", &KVCacheManager::num_tokens, py::arg("seq"))
      .def("slot", &KVCacheManager::slot, py::arg("seq"), py::arg("position"))
      .def("slots",
           [](const KVCacheManager& kv, SeqId seq, int32_t start, int32_t count) {
             if (count < 0) throw pagedllm::InvalidArgument("count must be >= 0, got " + std::to_string(count));
             py::array_t<int64_t> out(count);
             kv.slots(seq, start, {out.mutable_data(), static_cast<size_t>(count)});
             return out;
           },
           py::arg("seq"), py::arg("start"), py::arg("count"),
           "Slot mapping of positions [start, start + count) (int64 array).")
      .def("cache_full_blocks",
           [](KVCacheManager& kv, SeqId seq, const Tokens& tokens, int32_t num_computed,
              uint64_t extra_key) { kv.cache_full_blocks(seq, tokens_span(tokens), num_computed, extra_key); },
           py::arg("seq"), py::arg("token_ids"), py::arg("num_computed_tokens"),
           py::arg("extra_key") = 0)
      .def("fork", &KVCacheManager::fork, py::arg("parent"), py::arg("child"))
      .def("free", &KVCacheManager::free, py::arg("seq"))
      .def("contains", &KVCacheManager::contains, py::arg("seq"))
      .def("__contains__", &KVCacheManager::contains)
      .def("stats", &KVCacheManager::stats)
      .def("reset_prefix_cache", &KVCacheManager::reset_prefix_cache)
      // Introspection for tests and tools.
      .def("ref_count", [](const KVCacheManager& kv, int32_t b) { return kv.pool().ref_count(b); },
           py::arg("block"))
      .def("free_queue", [](const KVCacheManager& kv) { return kv.pool().free_queue(); })
      .def("is_cached",
           [](const KVCacheManager& kv, int32_t b) {
             kv.pool().check_id(b);
             return kv.prefix_cache() != nullptr && kv.prefix_cache()->is_cached(b);
           },
           py::arg("block"));
}
