// cuda/pdl.cu — the switch behind programmatic dependent launch (cuda/pdl.cuh) and the public
// set_pdl_enabled / pdl_enabled of pagedllm/cuda_runtime.h.
#include <atomic>
#include <cstdlib>

#include "pagedllm/cuda_runtime.h"
#include "pdl.cuh"

namespace pagedllm::cuda {

namespace {
std::atomic<int> g_pdl{-1};  // -1: not read yet; 0 off; 1 on
constexpr int kMaxDevices = 64;
std::atomic<int> g_major[kMaxDevices] = {};
}  // namespace

bool pdl_enabled() {
  int v = g_pdl.load();
  if (v < 0) {
    v = std::getenv("PAGEDLLM_NO_PDL") == nullptr ? 1 : 0;
    g_pdl.store(v);
  }
  return v == 1;
}

void set_pdl_enabled(bool enabled) { g_pdl.store(enabled ? 1 : 0); }

namespace detail {

int current_device_major() {
  int dev = 0;
  PAGEDLLM_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return 0;
  int major = g_major[dev].load();
  if (major == 0) {
    PAGEDLLM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    g_major[dev].store(major);
  }
  return major;
}

bool pdl_enabled_for_current_device() { return pdl_enabled() && current_device_major() >= 9; }

}  // namespace detail
}  // namespace pagedllm::cuda
