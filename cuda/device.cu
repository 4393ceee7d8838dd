// Device queries and the trivial fill op that proves the CUDA build path end to end.
#include <stdexcept>

#include "cuda_check.h"
#include "pagedllm/cuda_runtime.h"

namespace pagedllm {

bool built_with_cuda() { return true; }

namespace cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

void require_device() {
  if (device_count() == 0)
    throw std::runtime_error("no CUDA device: this pagedllm build has CUDA kernels, but no GPU/driver is visible");
}

namespace {
__global__ void fill_int32_kernel(int32_t* dst, int64_t n, int32_t value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = value;
}
}  // namespace

void fill_int32(int32_t* dst, int64_t n, int32_t value, std::uintptr_t stream) {
  require_device();
  if (n <= 0) return;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  fill_int32_kernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), threads, 0,
                      reinterpret_cast<cudaStream_t>(stream)>>>(dst, n, value);
  PAGEDLLM_CUDA_CHECK_LAUNCH();
}

void copy_async(void* dst, const void* src, std::size_t nbytes, std::uintptr_t stream) {
  if (nbytes == 0) return;
  PAGEDLLM_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, reinterpret_cast<cudaStream_t>(stream)));
}

}  // namespace cuda
}  // namespace pagedllm
