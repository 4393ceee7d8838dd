// cuda/device_guard.h — internal: makes a tensor's device current for the scope of a launcher
// call and restores the caller's device afterwards (CUDA runtime state is per host thread).
#pragma once

#include <cuda_runtime.h>

#include "cuda_check.h"

namespace pagedllm::cuda::detail {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    PAGEDLLM_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device != previous_) PAGEDLLM_CUDA_CHECK(cudaSetDevice(device));
    else previous_ = -1;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace pagedllm::cuda::detail
