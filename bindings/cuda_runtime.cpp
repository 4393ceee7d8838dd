// Bindings for pagedllm/cuda_runtime.h.
#include "pagedllm/cuda_runtime.h"

#include "registry.h"

PAGEDLLM_BINDING(cuda_runtime, m) {
  namespace py = pybind11;
  m.attr("built_with_cuda") = pagedllm::built_with_cuda();
  m.def("cuda_device_count", &pagedllm::cuda::device_count,
        "Number of visible CUDA devices (0 without a driver or GPU).");
  m.def(
      "cuda_fill_int32",
      [](std::uintptr_t dst, int64_t n, int32_t value, std::uintptr_t stream) {
        pagedllm::cuda::fill_int32(reinterpret_cast<int32_t*>(dst), n, value, stream);
      },
      py::arg("dst_ptr"), py::arg("n"), py::arg("value"), py::arg("stream") = 0,
      "Fill n int32 values at device pointer dst_ptr with value, on `stream` (cudaStream_t as int). "
      "Raises RuntimeError('no CUDA device ...') without a GPU.");
  m.def(
      "cuda_copy_async",
      [](std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes, std::uintptr_t stream) {
        pagedllm::cuda::copy_async(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes, stream);
      },
      py::arg("dst_ptr"), py::arg("src_ptr"), py::arg("nbytes"), py::arg("stream") = 0,
      "cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream): the decode graphs' input staging "
      "(pinned host -> device). Raises RuntimeError on a CUDA error or without a GPU.");
  m.def("pdl_enabled", &pagedllm::cuda::pdl_enabled,
        "Whether kernels that support it use programmatic dependent launch (sm_90+; False without CUDA).");
  m.def("set_pdl_enabled", &pagedllm::cuda::set_pdl_enabled, py::arg("enabled"),
        "Turn programmatic dependent launch on or off for launches made afterwards.");
}
