// Bindings for pagedllm/cpu_comm.h. The region is a shared-memory mapping owned by Python
// (multiprocessing.shared_memory), passed by address; the GIL is released while a collective waits.
#include "pagedllm/cpu_comm.h"

#include "registry.h"

PAGEDLLM_BINDING(cpu_comm, m) {
  namespace py = pybind11;
  using pagedllm::ShmCommunicator;
  py::class_<ShmCommunicator>(m, "ShmCommunicator",
                              "Shared-memory all-reduce / all-gather of the ranks of one host (pagedllm/cpu_comm.h). "
                              "The region must outlive the communicator.")
      .def(py::init([](std::uintptr_t region, std::size_t region_bytes, int rank, int world_size,
                       std::size_t buffer_bytes) {
             return new ShmCommunicator(reinterpret_cast<void*>(region), region_bytes, rank, world_size, buffer_bytes);
           }),
           py::arg("region"), py::arg("region_bytes"), py::arg("rank"), py::arg("world_size"),
           py::arg("buffer_bytes"))
      .def_static("region_bytes", &ShmCommunicator::region_bytes, py::arg("world_size"), py::arg("buffer_bytes"))
      .def("all_reduce", &ShmCommunicator::all_reduce, py::arg("x"), py::call_guard<py::gil_scoped_release>(),
           "x (cpu, contiguous, float32/bfloat16) <- sum over ranks, in place; the same bits on every rank")
      .def("all_gather", &ShmCommunicator::all_gather, py::arg("out"), py::arg("input"),
           py::call_guard<py::gil_scoped_release>(), "out [world_size, *input.shape] <- every rank's input")
      .def("barrier", &ShmCommunicator::barrier, py::call_guard<py::gil_scoped_release>())
      .def("abort", &ShmCommunicator::abort, "make every wait on the region raise RuntimeError")
      .def_property_readonly("aborted", &ShmCommunicator::aborted)
      .def_property_readonly("rank", &ShmCommunicator::rank)
      .def_property_readonly("world_size", &ShmCommunicator::world_size)
      .def_property_readonly("buffer_bytes", &ShmCommunicator::buffer_bytes);
}
