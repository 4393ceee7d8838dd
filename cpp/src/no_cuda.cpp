// Compiled only when the library is built without CUDA: every CUDA entry point says so.
#include <stdexcept>

#include "pagedllm/cuda_runtime.h"

namespace pagedllm {

bool built_with_cuda() { return false; }

namespace cuda {

int device_count() { return 0; }

void require_device() {
  throw std::runtime_error("pagedllm was built without CUDA: rebuild with nvcc on PATH (PAGEDLLM_CUDA=ON)");
}

void fill_int32(int32_t*, int64_t, int32_t, std::uintptr_t) { require_device(); }

void copy_async(void*, const void*, std::size_t, std::uintptr_t) { require_device(); }

bool pdl_enabled() { return false; }
void set_pdl_enabled(bool) {}

}  // namespace cuda
}  // namespace pagedllm
