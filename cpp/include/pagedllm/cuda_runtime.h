// pagedllm/cuda_runtime.h — whether this build has CUDA, and the device queries every CUDA op
// goes through. The library links cudart statically, so it loads on a machine without a GPU
// driver; only calling a CUDA op there fails, with a RuntimeError-style std::runtime_error
// that says "no CUDA device".
#pragma once

#include <cstddef>
#include <cstdint>

namespace pagedllm {

/// True when the library was compiled with the CUDA kernels (cuda/).
bool built_with_cuda();

namespace cuda {

/// Number of visible CUDA devices; 0 when there is no driver or no device (never throws).
int device_count();

/// Throw std::runtime_error("no CUDA device ...") unless a CUDA device is usable, or
/// std::runtime_error("pagedllm was built without CUDA") in a CPU-only build.
void require_device();

/// The trivial op that proves the CUDA path: dst[i] = value for i in [0, n), int32, on `stream`
/// (a cudaStream_t passed as an integer; 0 = the legacy default stream). Asynchronous.
void fill_int32(int32_t* dst, int64_t n, int32_t value, std::uintptr_t stream);

/// Asynchronous copy of nbytes from src to dst on `stream` (cudaMemcpyDefault: either side may be
/// host or device memory). For per-step inputs staged in pinned host memory: one call costs a
/// few microseconds of host time. The caller keeps src unchanged until the stream has passed the
/// copy. Throws std::runtime_error on a CUDA error.
void copy_async(void* dst, const void* src, std::size_t nbytes, std::uintptr_t stream);

/// Programmatic dependent launch (sm_90+): whether the kernels that support it (the GEMV and
/// the layer ops) are launched so that they may start while the previous kernel in the stream
/// finishes (they still wait for its results; cuda/pdl.cuh). On by default; the environment
/// variable PAGEDLLM_NO_PDL (any value) turns it off at start, set_pdl_enabled at run time (it
/// applies to launches made afterwards, e.g. graphs captured afterwards). Never throws; false
/// in a build without CUDA.
bool pdl_enabled();
void set_pdl_enabled(bool enabled);

}  // namespace cuda
}  // namespace pagedllm
