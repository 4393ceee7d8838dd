// ShmCommunicator (pagedllm/cpu_comm.h): one-shot all-reduce / all-gather through shared memory.
#include "pagedllm/cpu_comm.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>

#include "cpu_vec.h"
#include "pagedllm/errors.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAGEDLLM_CPU_RELAX() _mm_pause()
#else
#define PAGEDLLM_CPU_RELAX() ((void)0)
#endif

namespace pagedllm {

namespace {

constexpr std::size_t kLine = 64;
constexpr int kMaxWorld = 64;
constexpr int kSpinsBeforeYield = 4096;

std::atomic_ref<std::int64_t> atomic(std::int64_t* p) { return std::atomic_ref<std::int64_t>(*p); }

// dst[i] = sum over ranks r (in order) of src[r][i], float32 accumulation, one rounding.
template <typename T>
void sum_ranks(T* __restrict dst, const unsigned char* const* src, int world, std::int64_t n) {
  constexpr std::int64_t kBlock = 1024;
  float acc[kBlock];
  for (std::int64_t start = 0; start < n; start += kBlock) {
    const int len = static_cast<int>(std::min(kBlock, n - start));
    const T* first = reinterpret_cast<const T*>(src[0]) + start;
#pragma omp simd
    for (int i = 0; i < len; ++i) acc[i] = cpu::to_float(first[i]);
    for (int r = 1; r < world; ++r) {
      const T* s = reinterpret_cast<const T*>(src[r]) + start;
#pragma omp simd
      for (int i = 0; i < len; ++i) acc[i] += cpu::to_float(s[i]);
    }
#pragma omp simd
    for (int i = 0; i < len; ++i) dst[start + i] = cpu::from_float<T>(acc[i]);
  }
}

}  // namespace

std::size_t ShmCommunicator::region_bytes(int world_size, std::size_t buffer_bytes) {
  return kLine + static_cast<std::size_t>(world_size) * (kLine + 2 * buffer_bytes);
}

ShmCommunicator::ShmCommunicator(void* region, std::size_t region_bytes_, int rank, int world_size,
                                 std::size_t buffer_bytes)
    : region_(static_cast<unsigned char*>(region)), rank_(rank), world_size_(world_size), buffer_bytes_(buffer_bytes) {
  PAGEDLLM_CHECK(region != nullptr, "ShmCommunicator: region is null");
  PAGEDLLM_CHECK(world_size >= 1 && world_size <= kMaxWorld, "ShmCommunicator: world_size=", world_size,
                 " is outside [1, ", kMaxWorld, "]");
  PAGEDLLM_CHECK(rank >= 0 && rank < world_size, "ShmCommunicator: rank=", rank, " is outside [0, ", world_size, ")");
  PAGEDLLM_CHECK(buffer_bytes >= kLine && buffer_bytes % kLine == 0, "ShmCommunicator: buffer_bytes=", buffer_bytes,
                 " must be a positive multiple of ", kLine);
  PAGEDLLM_CHECK(reinterpret_cast<std::uintptr_t>(region) % 8 == 0, "ShmCommunicator: region is not 8-byte aligned");
  const std::size_t need = region_bytes(world_size, buffer_bytes);
  PAGEDLLM_CHECK(region_bytes_ >= need, "ShmCommunicator: the region has ", region_bytes_, " bytes, world_size=",
                 world_size, " and buffer_bytes=", buffer_bytes, " need ", need);
  // a communicator may be rebuilt over a region that earlier rounds used: continue from there
  round_ = atomic(flag(rank_)).load(std::memory_order_acquire);
}

std::int64_t* ShmCommunicator::flag(int r) const {
  return reinterpret_cast<std::int64_t*>(region_ + kLine + static_cast<std::size_t>(r) * kLine);
}

unsigned char* ShmCommunicator::buffer(int r, std::int64_t round) const {
  const std::size_t base = kLine + static_cast<std::size_t>(world_size_) * kLine;
  return region_ + base + (static_cast<std::size_t>(r) * 2 + static_cast<std::size_t>(round & 1)) * buffer_bytes_;
}

void ShmCommunicator::abort() { atomic(reinterpret_cast<std::int64_t*>(region_)).store(1, std::memory_order_release); }

bool ShmCommunicator::aborted() const {
  return atomic(reinterpret_cast<std::int64_t*>(region_)).load(std::memory_order_acquire) != 0;
}

void ShmCommunicator::publish_and_wait(std::int64_t round) {
  atomic(flag(rank_)).store(round, std::memory_order_release);
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    auto f = atomic(flag(r));
    int spins = 0;
    while (f.load(std::memory_order_acquire) < round) {
      if (++spins < kSpinsBeforeYield) {
        PAGEDLLM_CPU_RELAX();
        continue;
      }
      if (aborted()) {
        throw std::runtime_error("ShmCommunicator: the collective was aborted (a tensor-parallel rank stopped)");
      }
      sched_yield();
      spins = kSpinsBeforeYield - 64;  // check the abort flag every 64 yields' worth of spins
    }
  }
  // every rank's contribution is here: the result is valid even if a rank aborted since (a rank
  // that raises right after this collective must not turn its peers' completed one into an error)
}

void ShmCommunicator::all_reduce(const TensorView& x) {
  PAGEDLLM_CHECK(x.device == DeviceType::kCPU, "all_reduce: x is on ", device_name(x.device), "; expected cpu");
  PAGEDLLM_CHECK(x.dtype == DType::kFloat32 || x.dtype == DType::kBFloat16, "all_reduce: x has dtype ",
                 dtype_name(x.dtype), "; expected float32 or bfloat16");
  if (x.numel() == 0 || world_size_ == 1) return;  // (every rank has the same shape: none communicates)
  PAGEDLLM_CHECK(x.is_contiguous(), "all_reduce: x must be contiguous");
  const std::size_t elem = dtype_size(x.dtype);
  const std::int64_t per_round = static_cast<std::int64_t>(buffer_bytes_ / elem);
  const std::int64_t n = x.numel();
  auto* data = static_cast<unsigned char*>(x.data);
  const unsigned char* src[kMaxWorld];
  for (std::int64_t start = 0; start < n; start += per_round) {
    const std::int64_t len = std::min(per_round, n - start);
    const std::int64_t round = ++round_;
    std::memcpy(buffer(rank_, round), data + start * elem, static_cast<std::size_t>(len) * elem);
    publish_and_wait(round);
    for (int r = 0; r < world_size_; ++r) src[r] = buffer(r, round);
    if (x.dtype == DType::kFloat32) {
      sum_ranks(reinterpret_cast<float*>(data) + start, src, world_size_, len);
    } else {
      sum_ranks(reinterpret_cast<cpu::bf16*>(data) + start, src, world_size_, len);
    }
  }
}

void ShmCommunicator::all_gather(const TensorView& out, const TensorView& in) {
  PAGEDLLM_CHECK(out.device == DeviceType::kCPU && in.device == DeviceType::kCPU,
                 "all_gather: tensors must be on the cpu");
  PAGEDLLM_CHECK(out.dtype == in.dtype, "all_gather: out has dtype ", dtype_name(out.dtype), " but in has ",
                 dtype_name(in.dtype));
  PAGEDLLM_CHECK(out.numel() == in.numel() * world_size_, "all_gather: out has ", out.numel(),
                 " elements; expected world_size x in = ", world_size_, " x ", in.numel());
  if (in.numel() == 0) return;
  PAGEDLLM_CHECK(out.is_contiguous() && in.is_contiguous(), "all_gather: out and in must be contiguous");
  const std::size_t bytes = static_cast<std::size_t>(in.numel()) * dtype_size(in.dtype);
  auto* dst = static_cast<unsigned char*>(out.data);
  const auto* mine = static_cast<const unsigned char*>(in.data);
  if (world_size_ == 1) {
    if (dst != mine) std::memmove(dst, mine, bytes);
    return;
  }
  for (std::size_t start = 0; start < bytes; start += buffer_bytes_) {
    const std::size_t len = std::min(buffer_bytes_, bytes - start);
    const std::int64_t round = ++round_;
    std::memcpy(buffer(rank_, round), mine + start, len);
    publish_and_wait(round);
    for (int r = 0; r < world_size_; ++r) std::memcpy(dst + r * bytes + start, buffer(r, round), len);
  }
}

void ShmCommunicator::barrier() {
  if (world_size_ == 1) return;
  publish_and_wait(++round_);
}

}  // namespace pagedllm
