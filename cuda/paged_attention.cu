// cuda/paged_attention.cu — pagedllm::cuda::paged_attention / paged_prefill_attention: build the
// kernel parameters from the (already validated) views, choose the flash-decoding split, and
// dispatch by dtype: bf16 / fp16 to the tensor-core kernels (paged_decode.cu, paged_prefill.cu),
// float32 to the CUDA-core kernel (attention_fp32.cu).
//
// Split-K workspace: the partials of a split decode are allocated with cudaMallocAsync on the
// caller's stream and freed with cudaFreeAsync after the reduction, so the call stays
// asynchronous and CUDA-graph capturable (captured as memory-allocation nodes). The device's
// default memory pool keeps freed memory (release threshold raised once per device), so
// steady-state calls do not go back to the driver.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "attention_launch.h"
#include "cuda_check.h"
#include "kernels.h"
#include "pagedllm/errors.h"

namespace pagedllm::cuda {
namespace detail {

namespace {

constexpr int kMaxDevices = 64;

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

int current_device() {
  int d = 0;
  PAGEDLLM_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

int multiprocessor_count() {
  static std::atomic<int> cache[kMaxDevices] = {};
  const int dev = current_device();
  if (dev < kMaxDevices && cache[dev].load() > 0) return cache[dev].load();
  int n = 0;
  PAGEDLLM_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (dev < kMaxDevices) cache[dev].store(n);
  return n;
}

void keep_pool_memory() {
  static std::atomic<bool> done[kMaxDevices] = {};
  const int dev = current_device();
  if (dev < kMaxDevices && done[dev].load()) return;
  cudaMemPool_t pool;
  PAGEDLLM_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  PAGEDLLM_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  if (dev < kMaxDevices) done[dev].store(true);
}

AttnParams common_params(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                         const TensorView& value_cache, const TensorView& block_tables,
                         const TensorView& seq_lens, float scale, const AttentionOptions& options) {
  AttnParams p;
  p.out = out.data;
  p.query = query.data;
  p.key_cache = key_cache.data;
  p.value_cache = value_cache.data;
  p.block_tables = block_tables.ptr<int32_t>();
  p.seq_lens = seq_lens.ptr<int32_t>();
  p.num_seqs = static_cast<int>(seq_lens.size(0));
  p.num_rows = static_cast<int>(query.size(0));
  p.num_heads = static_cast<int>(query.size(1));
  p.num_kv_heads = static_cast<int>(key_cache.size(1));
  p.group = p.num_heads / p.num_kv_heads;
  p.block_size = static_cast<int>(key_cache.size(2));
  p.block_shift = 0;
  while ((1 << p.block_shift) < p.block_size) ++p.block_shift;
  if ((1 << p.block_shift) != p.block_size)
    throw std::runtime_error("CUDA attention: block size must be a power of two, got " +
                             std::to_string(p.block_size));
  p.max_blocks_per_seq = static_cast<int>(block_tables.size(1));
  p.scale = scale;
  p.scale_log2 = scale * kLog2e;
  p.soft_cap = options.soft_cap;
  p.sliding_window = options.sliding_window;
  return p;
}

void require_aligned(const TensorView& t, const char* name) {
  if (reinterpret_cast<std::uintptr_t>(t.data) % 16 != 0)
    throw InvalidArgument(std::string("CUDA attention: ") + name + " data pointer must be 16-byte aligned, got " +
                          std::to_string(reinterpret_cast<std::uintptr_t>(t.data)));
}

void require_aligned(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache) {
  require_aligned(out, "out");
  require_aligned(query, "query");
  require_aligned(key_cache, "key_cache");
  require_aligned(value_cache, "value_cache");
}

}  // namespace

void set_max_dynamic_smem(const void* kernel, size_t bytes, std::atomic<uint64_t>& done_devices) {
  if (bytes <= 48 * 1024) return;
  const int dev = current_device();
  const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit != 0 && (done_devices.load() & bit)) return;
  PAGEDLLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes)));
  done_devices.fetch_or(bit);
}

}  // namespace detail

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, float scale, const AttentionOptions& options,
                     std::uintptr_t stream_handle) {
  using namespace detail;
  DeviceGuard guard(query.device_index);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  AttnParams p = common_params(out, query, key_cache, value_cache, block_tables, seq_lens, scale, options);
  require_aligned(out, query, key_cache, value_cache);
  if (p.num_seqs > 65535)
    throw InvalidArgument("CUDA paged_attention: at most 65535 sequences per call, got " + std::to_string(p.num_seqs));
  const int head_size = static_cast<int>(query.size(2));
  const DType dtype = query.dtype;
  const int64_t max_blocks = p.max_blocks_per_seq;
  if (p.num_seqs == 0) return;

  // Flash-decoding split: partitions of whole blocks.
  int64_t splits = 1;
  if (options.split_k > 0) {
    splits = options.split_k;
  } else if (options.split_k < 0 && max_blocks > 0) {
    const int64_t ctas = dtype == DType::kFloat32
                             ? static_cast<int64_t>(p.num_seqs) * p.num_heads
                             : static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * ((p.group + 15) / 16);
    const int64_t target = 2 * static_cast<int64_t>(multiprocessor_count());
    if (ctas < target) {
      constexpr int64_t kMinPartitionTokens = 128;
      const int64_t by_length = std::max<int64_t>(1, max_blocks * p.block_size / kMinPartitionTokens);
      splits = std::min<int64_t>((target + ctas - 1) / ctas, by_length);
    }
  }
  splits = std::min<int64_t>(splits, 1024);
  if (splits > 1 && max_blocks > 0) {
    const int64_t blocks_per_part = (max_blocks + splits - 1) / splits;
    p.partition_tokens = static_cast<int>(blocks_per_part * p.block_size);
    // Keep the requested count: partitions past the context are empty.
    p.num_splits = static_cast<int>(splits);
  }

  if (p.num_splits == 1) {
    if (dtype == DType::kFloat32) launch_attention_fp32(head_size, p, stream);
    else launch_decode_mma(dtype, head_size, p, stream);
    return;
  }

  keep_pool_memory();
  const size_t rows = static_cast<size_t>(p.num_seqs) * p.num_heads * p.num_splits;
  const size_t bytes = rows * (head_size + 2) * sizeof(float);
  void* workspace = nullptr;
  PAGEDLLM_CUDA_CHECK(cudaMallocAsync(&workspace, bytes, stream));
  p.partial_out = static_cast<float*>(workspace);
  p.partial_max = p.partial_out + rows * head_size;
  p.partial_sum = p.partial_max + rows;
  try {
    if (dtype == DType::kFloat32) launch_attention_fp32(head_size, p, stream);
    else launch_decode_mma(dtype, head_size, p, stream);
    launch_splitk_reduce(dtype, head_size, p, stream);
  } catch (...) {
    cudaFreeAsync(workspace, stream);
    throw;
  }
  PAGEDLLM_CUDA_CHECK(cudaFreeAsync(workspace, stream));
}

void paged_prefill_attention(const TensorView& out, const TensorView& query,
                             const TensorView& key_cache, const TensorView& value_cache,
                             const TensorView& block_tables, const TensorView& seq_lens,
                             const TensorView& query_start_loc, float scale,
                             const AttentionOptions& options, std::uintptr_t stream_handle) {
  using namespace detail;
  DeviceGuard guard(query.device_index);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  AttnParams p = common_params(out, query, key_cache, value_cache, block_tables, seq_lens, scale, options);
  p.query_start_loc = query_start_loc.ptr<int32_t>();
  require_aligned(out, query, key_cache, value_cache);
  if (p.num_seqs == 0 || p.num_rows == 0) return;
  const int head_size = static_cast<int>(query.size(2));
  if (query.dtype == DType::kFloat32) launch_attention_fp32(head_size, p, stream);
  else launch_prefill_mma(query.dtype, head_size, p, stream);
}

}  // namespace pagedllm::cuda
