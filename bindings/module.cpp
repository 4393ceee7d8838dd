// pagedllm._C: the pybind11 module. Each bindings/*.cpp registers its part (registry.h).
// C++ std::invalid_argument (pagedllm::InvalidArgument) becomes ValueError, std::runtime_error
// RuntimeError — pybind11's standard translation.
#include "registry.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedllm native core: paged KV cache, scheduler, attention and cache kernels";
  for (auto& [name, fn] : pagedllm::bindings::registry()) fn(m);
}
