// Bindings for pagedllm/sampling_ops.h. The GIL is released while a kernel runs.
#include "pagedllm/sampling_ops.h"

#include "registry.h"

PAGEDLLM_BINDING(sampling_ops, m) {
  namespace py = pybind11;
  m.def("argmax_rows", &pagedllm::argmax_rows, py::arg("out"), py::arg("logits"), py::arg("vocab") = 0,
        py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
        "out int64 [R] = argmax(logits [R, V][:, :vocab], -1), the first index on a tie.");
  m.def("fill_placeholder_ids", &pagedllm::fill_placeholder_ids, py::arg("input_ids"), py::arg("prev_rows"),
        py::arg("sampled"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
        "input_ids int32 [T] (in place)[t] = sampled int64 [R][prev_rows int32 [T][t]] where prev_rows[t] >= 0.");
}
