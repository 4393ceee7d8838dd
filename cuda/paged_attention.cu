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
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "attention_launch.h"
#include "cuda_check.h"
#include "device_guard.h"
#include "kernels.h"
#include "pagedllm/errors.h"

namespace pagedllm::cuda {
namespace detail {

namespace {

constexpr int kMaxDevices = 64;

int current_device() {
  int d = 0;
  PAGEDLLM_CUDA_CHECK(cudaGetDevice(&d));
  return d;
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
  p.cache_rows = key_cache.size(0) * key_cache.size(1) * key_cache.size(2);
  p.scale = scale;
  p.scale_log2 = scale * kLog2e;
  p.soft_cap = options.soft_cap;
  p.sliding_window = options.sliding_window;
  return p;
}

enum class DecodeKernel { kV1, kV2, kFp32 };

/// PAGEDLLM_DECODE_KERNEL=v1 selects the CTA-per-item decode kernel for every head size (for
/// benchmarking the two; read once).
bool force_v1() {
  static const bool v1 = [] {
    const char* v = std::getenv("PAGEDLLM_DECODE_KERNEL");
    return v != nullptr && std::string(v) == "v1";
  }();
  return v1;
}

/// Automatic flash-decoding split count. A wave-aware cost model: with `units` work units running
/// at once (warps for v2, CTAs otherwise) and base = the work items of one partition, S splits
/// give ceil(base * S / units) waves, each as long as the longest partition (in rounds of
/// `tokens_per_round` tokens) plus a fixed per-item cost; a split also costs the reduction.
/// The cheapest S (the smallest on ties) wins; partitions are kept >= `min_partition` tokens.
int64_t choose_splits(DecodeKernel kind, DType dtype, int head_size, const AttnParams& p) {
  const int64_t chunks = (p.group + 15) / 16;
  int64_t base, units, tokens_per_round, min_partition;
  switch (kind) {
    case DecodeKernel::kV2:
      base = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * chunks;
      units = decode_v2_units(dtype, head_size);
      tokens_per_round = 16;
      min_partition = 64;
      break;
    case DecodeKernel::kV1:
      base = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * chunks;
      units = decode_v1_units(dtype, head_size);
      tokens_per_round = 64;
      min_partition = 128;
      break;
    default:
      base = static_cast<int64_t>(p.num_seqs) * p.num_heads;
      units = attention_fp32_units(head_size);
      tokens_per_round = 4;
      min_partition = 64;
      break;
  }
  const int64_t max_blocks = p.max_blocks_per_seq;
  const int64_t max_ctx = max_blocks * p.block_size;
  const int64_t s_max = std::clamp<int64_t>(max_ctx / min_partition, 1, 1024);
  int64_t best_s = 1;
  double best_cost = 0;
  for (int64_t s = 1; s <= s_max; ++s) {
    const int64_t part_tokens = (max_blocks + s - 1) / s * p.block_size;
    const int64_t waves = (base * s + units - 1) / units;
    const int64_t rounds = (part_tokens + tokens_per_round - 1) / tokens_per_round + 1 + (s > 1 ? 1 : 0);
    const double cost = static_cast<double>(waves) * static_cast<double>(rounds);
    if (s == 1 || cost < best_cost) {
      best_cost = cost;
      best_s = s;
    }
  }
  return best_s;
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

  // Which decode kernel: v2 (persistent per-warp items) for bf16/fp16 up to d128, the
  // CTA-per-item kernel for d256 (or when PAGEDLLM_DECODE_KERNEL=v1), float32 on CUDA cores.
  const DecodeKernel kind = dtype == DType::kFloat32                               ? DecodeKernel::kFp32
                            : decode_v2_supports(dtype, head_size) && !force_v1() ? DecodeKernel::kV2
                                                                                  : DecodeKernel::kV1;

  // Flash-decoding split: partitions of whole blocks.
  int64_t splits = 1;
  if (options.split_k > 0) {
    splits = std::min<int64_t>(options.split_k, 1024);
  } else if (options.split_k < 0 && max_blocks > 0) {
    splits = choose_splits(kind, dtype, head_size, p);
  }
  if (splits > 1 && max_blocks > 0) {
    const int64_t blocks_per_part = (max_blocks + splits - 1) / splits;
    p.partition_tokens = static_cast<int>(blocks_per_part * p.block_size);
    // Keep the requested count: partitions past the context are empty.
    p.num_splits = static_cast<int>(splits);
  }
  auto launch = [&] {
    switch (kind) {
      case DecodeKernel::kFp32: return launch_attention_fp32(head_size, p, stream);
      case DecodeKernel::kV2: return launch_decode_v2(dtype, head_size, p, stream);
      case DecodeKernel::kV1: return launch_decode_mma(dtype, head_size, p, stream);
    }
  };

  if (p.num_splits == 1) return launch();

  keep_pool_memory();
  const size_t rows = static_cast<size_t>(p.num_seqs) * p.num_heads * p.num_splits;
  const size_t bytes = rows * (head_size + 2) * sizeof(float);
  void* workspace = nullptr;
  PAGEDLLM_CUDA_CHECK(cudaMallocAsync(&workspace, bytes, stream));
  p.partial_out = static_cast<float*>(workspace);
  p.partial_max = p.partial_out + rows * head_size;
  p.partial_sum = p.partial_max + rows;
  try {
    launch();
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
