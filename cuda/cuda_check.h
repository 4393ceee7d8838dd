// cuda/cuda_check.h — error checking for CUDA runtime calls and kernel launches (internal).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define PAGEDLLM_CUDA_CHECK(expr)                                                           \
  do {                                                                                      \
    cudaError_t err__ = (expr);                                                             \
    if (err__ != cudaSuccess)                                                               \
      throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(err__) +   \
                               " at " __FILE__ ":" + std::to_string(__LINE__) + " (" #expr ")"); \
  } while (0)

/// Check the last kernel launch (configuration errors surface here, asynchronously reported
/// faults at the next synchronizing call).
#define PAGEDLLM_CUDA_CHECK_LAUNCH() PAGEDLLM_CUDA_CHECK(cudaGetLastError())
