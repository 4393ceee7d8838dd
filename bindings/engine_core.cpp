// Bindings for pagedllm/engine_core.h: EngineConfig, EngineStats, EngineCore.
// EngineConfig(**fields) sets any of its fields; unknown names raise TypeError.
#include "pagedllm/engine_core.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <limits>
#include <optional>

#include "registry.h"

namespace {
namespace py = pybind11;
using namespace pagedllm;

template <typename T>
T from_kwargs(const py::kwargs& kwargs, const char* cls) {
  T obj;
  py::object self = py::cast(&obj, py::return_value_policy::reference);
  for (auto [key, value] : kwargs) {
    if (!py::hasattr(self, key))
      throw py::type_error(std::string(cls) + " has no field " + py::str(key).cast<std::string>());
    py::setattr(self, key, value);
  }
  return obj;
}

/// Token ids from a list / numpy array of integers, checked to fit int32.
std::vector<int32_t> token_ids(const py::handle& obj, const char* what) {
  if (py::isinstance<py::array>(obj)) {
    auto kind = py::cast<py::array>(obj).dtype().kind();
    if (kind != 'i' && kind != 'u')
      throw InvalidArgument(std::string(what) + " must hold integers, got an array of dtype kind '" +
                            kind + "'");
  }
  auto a = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(obj);
  if (!a) throw InvalidArgument(std::string(what) + " must be a sequence of integers");
  if (a.ndim() != 1)
    throw InvalidArgument(std::string(what) + " must be 1-D, got ndim " + std::to_string(a.ndim()));
  std::vector<int32_t> out(static_cast<size_t>(a.size()));
  const int64_t* d = a.data();
  for (size_t i = 0; i < out.size(); ++i) {
    PAGEDLLM_CHECK(d[i] >= 0 && d[i] <= std::numeric_limits<int32_t>::max(), what, "[", i,
                   "] = ", d[i], " is not a token id (must be in [0, 2^31))");
    out[i] = static_cast<int32_t>(d[i]);
  }
  return out;
}
}  // namespace

PAGEDLLM_BINDING(engine_core, m) {
  py::class_<EngineConfig>(m, "EngineConfig", "EngineCore configuration (pagedllm/engine_core.h).")
      .def(py::init([](py::kwargs kw) { return from_kwargs<EngineConfig>(kw, "EngineConfig"); }))
      .def_readwrite("num_blocks", &EngineConfig::num_blocks)
      .def_readwrite("block_size", &EngineConfig::block_size)
      .def_readwrite("max_num_seqs", &EngineConfig::max_num_seqs)
      .def_readwrite("max_num_batched_tokens", &EngineConfig::max_num_batched_tokens)
      .def_readwrite("max_model_len", &EngineConfig::max_model_len)
      .def_readwrite("enable_prefix_caching", &EngineConfig::enable_prefix_caching)
      .def_readwrite("enable_chunked_prefill", &EngineConfig::enable_chunked_prefill)
      .def_readwrite("scheduling_policy", &EngineConfig::scheduling_policy)
      .def_readwrite("num_buffer_sets", &EngineConfig::num_buffer_sets)
      .def_readwrite("async_scheduling", &EngineConfig::async_scheduling,
                     "schedule placeholder decodes of in-flight sequences (pagedllm/scheduler.h)")
      .def_readwrite("speculative", &EngineConfig::speculative,
                     "n-gram speculative decoding (pagedllm/spec_decode.h); assign a SpeculativeConfig");

  py::class_<SpeculativeConfig>(m, "SpeculativeConfig", "n-gram speculative decoding (pagedllm/spec_decode.h).")
      .def(py::init([](py::kwargs kw) { return from_kwargs<SpeculativeConfig>(kw, "SpeculativeConfig"); }))
      .def_readwrite("num_speculative_tokens", &SpeculativeConfig::num_speculative_tokens, "k; 0 = off")
      .def_readwrite("prompt_lookup_min", &SpeculativeConfig::prompt_lookup_min)
      .def_readwrite("prompt_lookup_max", &SpeculativeConfig::prompt_lookup_max)
      .def_readwrite("disable_by_batch_size", &SpeculativeConfig::disable_by_batch_size,
                     "no drafts in a step with at least this many running sequences (0: no limit)")
      .def_readwrite("accept_all", &SpeculativeConfig::accept_all, "debug: accept every draft")
      .def_readwrite("external_drafts", &SpeculativeConfig::external_drafts,
                     "the caller fills input_ids / draft_token_ids of the reserved draft rows (a draft model)");
  m.def("propose_ngram",
        [](py::handle tokens, int32_t min_n, int32_t max_n, int32_t k) {
          std::vector<int32_t> ids = token_ids(tokens, "token_ids"), out;
          pagedllm::propose_ngram(ids, min_n, max_n, k, &out);
          return out;
        },
        py::arg("token_ids"), py::arg("prompt_lookup_min"), py::arg("prompt_lookup_max"), py::arg("k"),
        "n-gram proposal (pagedllm/spec_decode.h): up to k tokens after the earliest earlier "
        "occurrence of the longest suffix of length in [min, max]; [] when none matches.");

  auto stats = py::class_<EngineStats>(m, "EngineStats", "Engine metrics (pagedllm/engine_core.h).");
#define PAGEDLLM_STAT(name) stats.def_readonly(#name, &EngineStats::name)
  PAGEDLLM_STAT(num_running); PAGEDLLM_STAT(num_waiting); PAGEDLLM_STAT(num_unfinished_requests);
  PAGEDLLM_STAT(num_preemptions); PAGEDLLM_STAT(kv_usage); PAGEDLLM_STAT(num_blocks);
  PAGEDLLM_STAT(block_size); PAGEDLLM_STAT(num_free_blocks); PAGEDLLM_STAT(num_cached_blocks);
  PAGEDLLM_STAT(prefix_cache_queries); PAGEDLLM_STAT(prefix_cache_hits);
  PAGEDLLM_STAT(num_prompt_tokens); PAGEDLLM_STAT(num_generation_tokens); PAGEDLLM_STAT(num_steps);
  PAGEDLLM_STAT(num_scheduled_tokens); PAGEDLLM_STAT(num_recomputed_tokens);
  PAGEDLLM_STAT(num_chunked_prefills); PAGEDLLM_STAT(num_forks); PAGEDLLM_STAT(num_copy_orders);
  PAGEDLLM_STAT(num_finished_requests); PAGEDLLM_STAT(num_aborted_requests);
  PAGEDLLM_STAT(spec_decode_num_drafts); PAGEDLLM_STAT(spec_decode_num_draft_tokens);
  PAGEDLLM_STAT(spec_decode_num_accepted_tokens); PAGEDLLM_STAT(spec_decode_num_accepted_tokens_per_pos);
#undef PAGEDLLM_STAT
  stats.def("as_dict", [](py::object self) {
    py::dict d;
    for (auto name : self.attr("__class__").attr("__dict__").cast<py::dict>()) {
      std::string k = py::str(name.first);
      if (k.rfind("_", 0) == 0 || k == "as_dict") continue;
      d[py::str(k)] = self.attr(k.c_str());
    }
    return d;
  }, "Every metric as {name: value}.");

  py::class_<EngineCore>(m, "EngineCore", "The native engine: scheduler + KV cache manager + batch buffers.")
      .def(py::init<const EngineConfig&>(), py::arg("config"))
      .def("add_request",
           [](EngineCore& core, const std::string& request_id, py::handle prompt,
              const RequestParams& params) {
             std::vector<int32_t> ids = token_ids(prompt, "prompt_token_ids");
             return core.add_request(request_id, ids, params);
           },
           py::arg("request_id"), py::arg("prompt_token_ids"), py::arg("params"),
           "Queue a request; returns its index-0 seq id. ValueError naming max_model_len and the "
           "counts when it can never run.")
      .def("abort_request", &EngineCore::abort_request, py::arg("request_id"))
      .def("finish_sequence", &EngineCore::finish_sequence, py::arg("seq_id"),
           py::arg("stop_reason") = py::none(),
           "Finish one sequence with 'stop' (a stop string matched); True when its request is done.")
      .def("schedule", &EngineCore::schedule, py::arg("max_step_seqs") = 0, py::return_value_policy::reference_internal,
           "The next step's SchedulerOutput; max_step_seqs > 0 caps its sequences (pipeline parallelism).")
      .def("num_running_seqs", &EngineCore::num_running_seqs)
      .def("num_waiting_seqs", &EngineCore::num_waiting_seqs)
      .def("update_from_output",
           [](EngineCore& core, SchedulerOutput& out,
              py::array_t<int32_t, py::array::c_style | py::array::forcecast> sampled,
              std::optional<py::array_t<int64_t, py::array::c_style | py::array::forcecast>> topk_ids,
              std::optional<py::array_t<float, py::array::c_style | py::array::forcecast>> topk_logprobs) {
             if (sampled.ndim() != 1)
               throw InvalidArgument("sampled_token_ids must be 1-D, got ndim " +
                                     std::to_string(sampled.ndim()));
             SampledTopK topk;
             if (topk_ids.has_value() != topk_logprobs.has_value())
               throw InvalidArgument("topk_token_ids and topk_logprobs go together");
             if (topk_ids) {
               if (topk_ids->ndim() != 2 || topk_logprobs->ndim() != 2 ||
                   topk_ids->shape(0) != topk_logprobs->shape(0) || topk_ids->shape(1) != topk_logprobs->shape(1))
                 throw InvalidArgument("topk_token_ids and topk_logprobs must be 2-D [num_sampled, k] of one shape");
               topk.k = static_cast<int32_t>(topk_ids->shape(1));
               topk.token_ids = std::span<const int64_t>(topk_ids->data(), static_cast<size_t>(topk_ids->size()));
               topk.logprobs = std::span<const float>(topk_logprobs->data(), static_cast<size_t>(topk_logprobs->size()));
             }
             return core.update_from_output(
                 out, std::span<const int32_t>(sampled.data(), static_cast<size_t>(sampled.size())), topk);
           },
           py::arg("out"), py::arg("sampled_token_ids"), py::arg("topk_token_ids") = py::none(),
           py::arg("topk_logprobs") = py::none(),
           "Apply a step's sampled ids. topk_token_ids int64 / topk_logprobs float32 [num_sampled, k]: "
           "each row's top-k logprobs, descending (a step with beam-search groups needs k >= "
           "max(2, 1 + #eos) x beam width).")
      .def("release", &EngineCore::release, py::arg("out"))
      .def("has_unfinished_requests", &EngineCore::has_unfinished_requests)
      .def("stats", &EngineCore::stats)
      .def("num_kv_seqs", [](const EngineCore& c) { return c.kv_cache().num_seqs(); },
           "Sequences holding KV blocks (0 when idle: no leak).")
      .def_property_readonly("config", &EngineCore::config)
      .def_property_readonly("max_blocks_per_seq", &EngineCore::max_blocks_per_seq)
      .def_property_readonly("num_buffer_sets", &EngineCore::num_buffer_sets)
      .def_property_readonly("num_outputs_held", &EngineCore::num_outputs_held);
}
