// cuda/split_counters.cu — the persistent, zero-initialised arrival counters behind the decode
// kernel's in-kernel split-K combine (declared in attention_launch.h).
//
// Per device: one cudaMalloc of kSplitCounterSlabs slabs of kSplitCountersPerSlab int32 counters,
// zeroed once (on a private stream, synchronised) on the first request made while the caller's
// stream is not capturing a CUDA graph. Each stream that asks gets a slab of its own for the life
// of the process (first come, first served; no slab left -> nullptr). Handing out a slab needs no
// CUDA call, so a capture can take one as long as the device's buffer exists.
//
// Concurrency rule (why a slab per stream): the counters of a launch are shared by every kernel
// that uses the same slab; two such kernels must never run at the same time. Kernels of one stream
// are serialised (the decode kernel is never launched as a programmatic dependent), so calls on
// one stream are safe, and calls on different streams use different slabs. A CUDA graph keeps the
// slab of the stream it was captured on: replays of graphs captured on one stream must not overlap
// each other or eager calls on that stream (replay them on one stream, as the engine does). A
// destroyed stream's handle, when reused by a new stream, inherits its slab: destroy a stream only
// after its work has finished. Every launch leaves its counters at zero (the last arriver resets
// its group's counter), so no memset runs per call (a memset node costs ~1.6 us in a graph on the
// H200, bench/cuda_kernels_notes.md run 4).
#include <cuda_runtime.h>

#include <array>
#include <mutex>

#include "attention_launch.h"
#include "cuda_check.h"

namespace pagedllm::cuda::detail {
namespace {

constexpr int kMaxDevices = 64;

struct DeviceCounters {
  int* base = nullptr;
  std::array<cudaStream_t, kSplitCounterSlabs> owners{};
  int used = 0;
};

std::mutex g_mutex;
std::array<DeviceCounters, kMaxDevices> g_devices;

void allocate_zeroed(DeviceCounters& d) {
  const size_t bytes = sizeof(int) * kSplitCountersPerSlab * kSplitCounterSlabs;
  int* base = nullptr;
  PAGEDLLM_CUDA_CHECK(cudaMalloc(&base, bytes));
  cudaStream_t s = nullptr;
  cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaMemsetAsync(base, 0, bytes, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  if (s != nullptr) cudaStreamDestroy(s);
  if (err != cudaSuccess) {
    cudaFree(base);
    PAGEDLLM_CUDA_CHECK(err);
  }
  d.base = base;
}

}  // namespace

int* split_counters_for(cudaStream_t stream, int64_t needed) {
  if (needed <= 0 || needed > kSplitCountersPerSlab) return nullptr;
  int dev = 0;
  PAGEDLLM_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceCounters& d = g_devices[dev];
  if (d.base == nullptr) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    PAGEDLLM_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    if (status != cudaStreamCaptureStatusNone) return nullptr;  // no allocation inside a capture
    allocate_zeroed(d);
  }
  for (int i = 0; i < d.used; ++i)
    if (d.owners[i] == stream) return d.base + static_cast<int64_t>(i) * kSplitCountersPerSlab;
  if (d.used == kSplitCounterSlabs) return nullptr;
  d.owners[d.used] = stream;
  return d.base + static_cast<int64_t>(d.used++) * kSplitCountersPerSlab;
}

}  // namespace pagedllm::cuda::detail
