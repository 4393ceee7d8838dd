// Bindings for pagedllm/request.h: RequestParams (what EngineCore.add_request takes).
// RequestParams(**fields) sets any of its fields; unknown names raise TypeError.
#include "pagedllm/request.h"

#include <pybind11/stl.h>

#include "registry.h"

PAGEDLLM_BINDING(request, m) {
  namespace py = pybind11;
  using pagedllm::RequestParams;
  py::class_<RequestParams>(m, "RequestParams",
                            "Engine-side part of a request's SamplingParams (see pagedllm/request.h).")
      .def(py::init([](py::kwargs kwargs) {
             RequestParams p;
             py::object self = py::cast(&p, py::return_value_policy::reference);
             for (auto [key, value] : kwargs) {
               if (!py::hasattr(self, key))
                 throw py::type_error("RequestParams has no field " + py::str(key).cast<std::string>());
               py::setattr(self, key, value);
             }
             return p;
           }))
      .def_readwrite("max_tokens", &RequestParams::max_tokens,
                     "Tokens to generate per sequence; -1 until max_model_len; 0 prompt only.")
      .def_readwrite("min_tokens", &RequestParams::min_tokens)
      .def_readwrite("eos_token_ids", &RequestParams::eos_token_ids)
      .def_readwrite("stop_token_ids", &RequestParams::stop_token_ids)
      .def_readwrite("ignore_eos", &RequestParams::ignore_eos)
      .def_readwrite("n", &RequestParams::n)
      .def_readwrite("priority", &RequestParams::priority, "Lower is more urgent (vLLM).")
      .def_readwrite("arrival_time", &RequestParams::arrival_time, "Seconds.")
      .def_readwrite("cache_salt", &RequestParams::cache_salt)
      .def_readwrite("prompt_logprobs", &RequestParams::prompt_logprobs)
      .def_readwrite("allow_speculation", &RequestParams::allow_speculation,
                     "speculative decoding may propose drafts for this request")
      .def_readwrite("use_beam_search", &RequestParams::use_beam_search,
                     "beam search with n beams (UpdateResult.beam_results)")
      .def_readwrite("length_penalty", &RequestParams::length_penalty,
                     "beam search: score = cum_logprob / num_generated ** length_penalty")
      .def("__repr__", [](const RequestParams& p) {
        return "RequestParams(max_tokens=" + std::to_string(p.max_tokens) +
               ", min_tokens=" + std::to_string(p.min_tokens) + ", n=" + std::to_string(p.n) +
               ", priority=" + std::to_string(p.priority) + ", ignore_eos=" +
               (p.ignore_eos ? "True" : "False") + ", prompt_logprobs=" +
               (p.prompt_logprobs ? "True" : "False") + ")";
      });
}
