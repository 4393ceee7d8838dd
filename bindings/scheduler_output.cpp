// Bindings for pagedllm/scheduler_output.h: SchedulerOutput's arrays are zero-copy numpy views
// (base = the SchedulerOutput, valid until EngineCore.release(out)); UpdateResult's arrays are
// views too (base = the UpdateResult). Events are lists of tuples.
#include "pagedllm/scheduler_output.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "registry.h"

namespace {
namespace py = pybind11;
using pagedllm::SchedulerOutput;
using pagedllm::UpdateResult;

template <typename T>
py::array view1d(const std::vector<T>& v, int64_t n, const py::object& base) {
  return py::array_t<T>({n}, {static_cast<int64_t>(sizeof(T))}, v.data(), base);
}

SchedulerOutput& so(const py::object& self) { return self.cast<SchedulerOutput&>(); }
}  // namespace

PAGEDLLM_BINDING(scheduler_output, m) {
  py::class_<SchedulerOutput>(m, "SchedulerOutput",
                              "One step's batch buffers (see pagedllm/scheduler_output.h). Arrays "
                              "are zero-copy views valid until EngineCore.release(out).")
      .def_readonly("num_tokens", &SchedulerOutput::num_tokens)
      .def_readonly("num_seqs", &SchedulerOutput::num_seqs)
      .def_readonly("num_sampled", &SchedulerOutput::num_sampled)
      .def_readonly("num_decode_seqs", &SchedulerOutput::num_decode_seqs)
      .def_readonly("num_prefill_seqs", &SchedulerOutput::num_prefill_seqs)
      .def_readonly("num_prefill_tokens", &SchedulerOutput::num_prefill_tokens)
      .def_readonly("max_query_len", &SchedulerOutput::max_query_len)
      .def_readonly("max_seq_len", &SchedulerOutput::max_seq_len)
      .def_readonly("max_blocks_per_seq", &SchedulerOutput::max_blocks_per_seq)
      .def_readonly("step_id", &SchedulerOutput::step_id)
      .def_readonly("num_placeholders", &SchedulerOutput::num_placeholders)
      .def_readonly("num_draft_tokens", &SchedulerOutput::num_draft_tokens)
      .def_readonly("max_row_blocks", &SchedulerOutput::max_row_blocks,
                    "the most blocks a row of block_tables holds: columns from it on are 0")
      .def_property_readonly("num_copies", &SchedulerOutput::num_copies)
      .def_property_readonly("input_ids", [](py::object self) {
        auto& o = so(self); return view1d(o.input_ids, o.num_tokens, self); }, "int32 [T]")
      .def_property_readonly("positions", [](py::object self) {
        auto& o = so(self); return view1d(o.positions, o.num_tokens, self); }, "int64 [T]")
      .def_property_readonly("slot_mapping", [](py::object self) {
        auto& o = so(self); return view1d(o.slot_mapping, o.num_tokens, self); }, "int64 [T]")
      .def_property_readonly("prev_sample_rows", [](py::object self) {
        auto& o = so(self); return view1d(o.prev_sample_rows, o.num_tokens, self); },
        "int32 [T]: -1, or the sampled row of step step_id - 1 whose token replaces input_ids here")
      .def_property_readonly("seq_lens", [](py::object self) {
        auto& o = so(self); return view1d(o.seq_lens, o.num_seqs, self); }, "int32 [S]")
      .def_property_readonly("query_start_loc", [](py::object self) {
        auto& o = so(self); return view1d(o.query_start_loc, o.num_seqs + 1, self); }, "int32 [S+1]")
      .def_property_readonly("seq_ids", [](py::object self) {
        auto& o = so(self); return view1d(o.seq_ids, o.num_seqs, self); }, "int64 [S]")
      .def_property_readonly("logits_indices", [](py::object self) {
        auto& o = so(self); return view1d(o.logits_indices, o.num_sampled, self); }, "int64 [R]")
      .def_property_readonly("sample_seq_ids", [](py::object self) {
        auto& o = so(self); return view1d(o.sample_seq_ids, o.num_sampled, self); }, "int64 [R]")
      .def_property_readonly("draft_token_ids", [](py::object self) {
        auto& o = so(self); return view1d(o.draft_token_ids, o.num_sampled, self); },
        "int32 [R]: the draft token row r's sample is checked against, or -1 (speculative decoding)")
      .def_property_readonly("block_tables", [](py::object self) {
        auto& o = so(self);
        const int64_t w = o.max_blocks_per_seq;
        return py::array_t<int32_t>({static_cast<int64_t>(o.num_seqs), w},
                                    {w * 4, int64_t{4}}, o.block_tables.data(), self);
      }, "int32 [S, max_blocks_per_seq], rows padded with 0")
      .def_property_readonly("copy_orders", [](py::object self) {
        auto& o = so(self);
        return py::array_t<int64_t>({static_cast<int64_t>(o.num_copies()), int64_t{2}},
                                    {int64_t{16}, int64_t{8}}, o.copy_orders.data(), self);
      }, "int64 [C, 2] copy-on-write (src_block, dst_block)")
      .def_property_readonly("new_seqs", [](const SchedulerOutput& o) {
        py::list l;
        for (auto& s : o.new_seqs) l.append(py::make_tuple(s.seq_id, s.request_id, s.index));
        return l;
      }, "[(seq_id, request_id, index)] sequences that appear for the first time")
      .def_property_readonly("prompt_logprob_rows", [](const SchedulerOutput& o) {
        py::list l;
        for (auto& r : o.prompt_logprob_rows)
          l.append(py::make_tuple(r.request_id, r.first_row, r.num_rows, r.first_position));
        return l;
      }, "[(request_id, first_row, num_rows, first_position)]: row first_row+i's logits score "
         "prompt token first_position+i+1")
      .def("__repr__", [](const SchedulerOutput& o) {
        return "SchedulerOutput(step_id=" + std::to_string(o.step_id) + ", num_tokens=" +
               std::to_string(o.num_tokens) + ", num_seqs=" + std::to_string(o.num_seqs) +
               ", num_sampled=" + std::to_string(o.num_sampled) + ", num_decode_seqs=" +
               std::to_string(o.num_decode_seqs) + ", num_copies=" + std::to_string(o.num_copies()) + ")";
      });

  py::class_<UpdateResult, std::shared_ptr<UpdateResult>>(
      m, "UpdateResult", "Tokens appended by one update_from_output, and what finished.")
      .def_property_readonly("seq_ids", [](py::object self) {
        auto& r = self.cast<UpdateResult&>();
        return view1d(r.seq_ids, static_cast<int64_t>(r.seq_ids.size()), self); }, "int64 [K]")
      .def_property_readonly("token_ids", [](py::object self) {
        auto& r = self.cast<UpdateResult&>();
        return view1d(r.token_ids, static_cast<int64_t>(r.token_ids.size()), self); }, "int32 [K]")
      .def_property_readonly("finished", [](const UpdateResult& r) {
        py::list l;
        for (auto& f : r.finished)
          l.append(py::make_tuple(f.request_id, f.seq_id, f.index,
                                  pagedllm::finish_reason_name(f.finish_reason), f.stop_reason));
        return l;
      }, "[(request_id, seq_id, index, finish_reason, stop_reason)]")
      .def_readonly("request_finished", &UpdateResult::request_finished,
                    "request ids whose every sequence finished")
      .def_property_readonly("beam_results", [](const UpdateResult& r) {
        py::list l;
        for (auto& b : r.beam_results) {
          py::list hyps;
          for (auto& h : b.hypotheses)
            hyps.append(py::make_tuple(h.token_ids, h.cum_logprob, h.score,
                                       pagedllm::finish_reason_name(h.finish_reason)));
          l.append(py::make_tuple(b.request_id, hyps));
        }
        return l;
      }, "[(request_id, [(token_ids, cum_logprob, score, finish_reason)])]: beam-search requests that "
         "finished, hypotheses best first");
}
