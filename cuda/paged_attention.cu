// cuda/paged_attention.cu — pagedllm::cuda::paged_attention / paged_prefill_attention: build the
// kernel parameters from the (already validated) views, choose the flash-decoding split, and
// dispatch by dtype: bf16 / fp16 to the tensor-core kernels (paged_decode.cu, paged_prefill.cu),
// float32 to the CUDA-core kernel (attention_fp32.cu).
//
// Split-K workspace: the partials of a split decode are allocated with cudaMallocAsync on the
// caller's stream and freed with cudaFreeAsync after the reduction, so the call stays
// asynchronous and CUDA-graph capturable (captured as memory-allocation nodes). The device's
// default memory pool keeps freed memory (release threshold raised once per device), so
// steady-state calls do not go back to the driver. The partitions are combined by the reduction
// kernel or, for decode v2 where that measured faster, inside the decode kernel by the last
// partition of each group to finish (arrival counters from cuda/split_counters.cu, no extra
// kernel and no memset).
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
#include "fp8_kv.cuh"
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
  p.early_context_loads = options.early_context_loads ? 1 : 0;
  p.kv_fp8 = fp8::kind_of(key_cache.dtype);
  if (p.kv_fp8 != 0) {
    p.k_scale = fp8::scale_ptr(options.kv_scales.k_scale);
    p.v_scale = fp8::scale_ptr(options.kv_scales.v_scale);
    if (query.size(2) > 128)
      throw InvalidArgument("CUDA attention: FP8 KV caches support head sizes up to 128, got " +
                            std::to_string(query.size(2)) + " (use kv_cache_dtype='auto')");
  }
  return p;
}

enum class DecodeKernel { kV1, kV2, kV2Pair, kV2Cta, kFp32 };  // v2: 1, 2, all warps of a CTA per item

/// PAGEDLLM_DECODE_KERNEL=v1 selects the CTA-per-item decode kernel for every head size (for
/// benchmarking the two; read once).
bool force_v1() {
  static const bool v1 = [] {
    const char* v = std::getenv("PAGEDLLM_DECODE_KERNEL");
    return v != nullptr && std::string(v) == "v1";
  }();
  return v1;
}

/// PAGEDLLM_DECODE_MODE=warp, =pair or =cta forces v2's work items onto single warps, pairs of
/// warps or whole CTAs (for testing and benchmarking each; read once); otherwise the cost model
/// chooses.
int forced_v2_mode() {  // 0 = model, 1 = warp, 2 = pair, 3 = CTA items
  static const int mode = [] {
    const char* v = std::getenv("PAGEDLLM_DECODE_MODE");
    if (v == nullptr) return 0;
    if (std::string(v) == "warp") return 1;
    if (std::string(v) == "pair") return 2;
    if (std::string(v) == "cta") return 3;
    return 0;
  }();
  return mode;
}

/// PAGEDLLM_DECODE_EVEN=0 keeps v2's partitions fixed by the block-table width (for
/// benchmarking; read once).
bool even_splits_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("PAGEDLLM_DECODE_EVEN");
    return v == nullptr || std::string(v) != "0";
  }();
  return on;
}

/// How split-K partitions are combined: the reduction kernel after the decode kernel, or the last
/// partition of each group inside the decode kernel (v2 only; AttnParams::split_counters).
/// PAGEDLLM_SPLITK_COMBINE=kernel or =inkernel forces one wherever it is possible (for testing and
/// benchmarking; read once); otherwise in_kernel_combine_pays decides.
int forced_combine() {  // 0 = model, 1 = reduction kernel, 2 = in-kernel
  static const int mode = [] {
    const char* v = std::getenv("PAGEDLLM_SPLITK_COMBINE");
    if (v == nullptr) return 0;
    if (std::string(v) == "kernel") return 1;
    if (std::string(v) == "inkernel") return 2;
    return 0;
  }();
  return mode;
}

/// Where the in-kernel combine measured faster than the reduction kernel on the H200 (bench/
/// cuda_kernels_notes.md, runs 7 and 8): whole-CTA items with at most 16 partitions (run 8, with
/// the acquire-release arrival: 1 x 300 with a 32-block table, 8 splits, 6.77 against 8.05 us;
/// 1 x 4,096 with 8 / 16 splits 15.14 / 12.78 against 16.37 / 12.84; 1 x 16 with 2 / 8 / 16 splits
/// 6.09 / 6.29 / 7.11 against 6.38 / 7.12 / 7.26). Not for warp items, where it lost or tied
/// (8 x 4,096 with 16 splits: 48.8 against 45.4 us; 1 x 16 with 2: 6.88 against 5.69; 64 x 4,096 with
/// 2: 256.2 against 257.3 in run 8 but 254.5-256.5 against 252.5-253.8 in run 7), nor for CTA items
/// with more than 16 partitions (1 x 4,096 with 24 / 32: 12.72 / 13.02 against 12.37 / 11.86 in
/// run 8e). With the cost model's half round, 1 x 4,096 ties between 16 partitions in the kernel
/// (11.88-12.06 us in run 8e and the final run) and 32 with the reduction kernel (11.77-11.86) and
/// takes 16; a 300-token context under a 256-block table (1 x 300:w256) takes 16 in the kernel
/// too (7.46 us; 8.3-8.6 with 32 and the reduction kernel in runs 8a/8b, 3-deep rings). Since
/// the combine reads partials in chunks of 8 (run 11), 1 x 4,096 with 16 in the kernel takes
/// 11.34-11.55 us, and 24 / 32 in the kernel (12.01 / 12.05) beat the reduction kernel (12.40 /
/// 12.28) but not 16. The limit stays 16: the wave model would price 32 (two CTAs per SM) lower.
constexpr int64_t kInKernelCtaMaxSplits = 16;
bool in_kernel_combine_pays(DecodeKernel kind, int64_t splits) {
  return kind == DecodeKernel::kV2Cta && splits <= kInKernelCtaMaxSplits;
}

/// The split-K reduction kernel's launch and the gap before it, in rounds, paid once per call (not
/// per wave): at 64 x 4,096 the warp plan with 2 partitions and the reduction kernel measured 1.3%
/// slower than pairs without a split, which the per-wave terms alone priced 0.6% cheaper
/// (bench/cuda_kernels_notes.md run 10).
constexpr double kReductionLaunchRounds = 2.0;

/// Cost of a decode kernel with `s` splits in a wave-aware model: with `units` work units running
/// at once (warps for v2 warp items, CTAs otherwise) and base = the work items of one partition,
/// S splits give ceil(base * S / units) waves, each as long as the longest partition (in rounds
/// of `tokens_per_round` tokens) plus a fixed per-item cost; a split also costs the reduction:
/// for v2, 1 + S / 8 rounds for the warp-row reduction (S <= kWarpReduceMaxSplits; a lane walks
/// S partials) and 2 + S / 64 for the CTA-row one (8 groups walk them), half a round where the
/// in-kernel combine replaces it (CTA items up to in_kernel_max_splits; run 8); 1 round for the
/// others. Partitions are kept >= `min_partition` tokens (returned in s_max). Fitted to runs 4 and 5 on
/// the H200 (bench/cuda_kernels_notes.md): whole-CTA items for short contexts at batch 1
/// (1 x 300 with a 32-block table: 7.9 us against 9.1 us with 8 warp items), warp items where
/// the two are within noise (8 x 4,096, 64 x 4,096) or warp items measured faster (1 x 32,768,
/// 128 splits: 42.6 us in run 4 against 45.3 us with 32 CTA items in run 5). A v2 plan that
/// launches the reduction kernel also pays kReductionLaunchRounds once per call (run 10).
struct CostModel {
  int64_t base = 1, units = 1, tokens_per_round = 16, fixed = 1, min_partition = 64;
  bool v2_reduce = false;  // the v2 reduction costs above; otherwise the reduction is 1 round
  int64_t in_kernel_max_splits = 0;  // up to this many partitions the in-kernel combine: half a round

  double cost(const AttnParams& p, int64_t s) const {
    const int64_t max_blocks = p.max_blocks_per_seq;
    const int64_t part_tokens = (max_blocks + s - 1) / s * p.block_size;
    const int64_t waves = (base * s + units - 1) / units;
    double reduce = 0;
    if (s > 1 && !v2_reduce) reduce = 1;
    else if (s > 1 && s <= in_kernel_max_splits) reduce = 0.5;
    else if (s > 1) reduce = s <= kWarpReduceMaxSplits ? 1.0 + s / 8.0 : 2.0 + s / 64.0;
    const double rounds =
        static_cast<double>((part_tokens + tokens_per_round - 1) / tokens_per_round + fixed) + reduce;
    const bool reduction_kernel = v2_reduce && s > 1 && s > in_kernel_max_splits;
    return static_cast<double>(waves) * rounds + (reduction_kernel ? kReductionLaunchRounds : 0.0);
  }
  int64_t s_max(const AttnParams& p) const {
    const int64_t max_ctx = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
    return std::clamp<int64_t>(max_ctx / min_partition, 1, 1024);
  }
};

CostModel cost_model(DecodeKernel kind, DType dtype, int head_size, const AttnParams& p) {
  const int64_t chunks = (p.group + 15) / 16;
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * chunks;
  switch (kind) {
    // Shared items pay a merge (barriers, shared memory) and an uneven finish of their warps.
    case DecodeKernel::kV2: return {items, decode_v2_units(dtype, head_size, 1, p.group, p.kv_fp8), 16, 1, 64, true};
    case DecodeKernel::kV2Pair:
      return {items, decode_v2_units(dtype, head_size, 2, p.group, p.kv_fp8), 32, 3, 64, true};
    case DecodeKernel::kV2Cta:  // early context loads: partitions down to two tiles (see plan_decode)
      return {items, decode_v2_units(dtype, head_size, kDecodeV2Warps, p.group, p.kv_fp8), 16 * kDecodeV2Warps, 3,
              p.early_context_loads ? 32 : 64, true, forced_combine() == 1 ? 0 : kInKernelCtaMaxSplits};
    case DecodeKernel::kV1: return {items, decode_v1_units(dtype, head_size), 64, 1, 128};
    default: return {static_cast<int64_t>(p.num_seqs) * p.num_heads, attention_fp32_units(head_size), 4, 1, 64};
  }
}

struct DecodePlan {
  DecodeKernel kind;
  int64_t splits;
};

const char* kind_name(DecodeKernel kind) {
  switch (kind) {
    case DecodeKernel::kV1: return "v1";
    case DecodeKernel::kV2: return "v2-warp";
    case DecodeKernel::kV2Pair: return "v2-pair";
    case DecodeKernel::kV2Cta: return "v2-cta";
    default: return "fp32";
  }
}

thread_local DecodePlanInfo g_last_plan;

/// The kernel and flash-decoding split count. split_k > 0 or == 0 fixes the count (1 for 0);
/// -1: the cheapest count of the cost model (the smallest on ties). v2 kernels: items on warps,
/// pairs of warps or CTAs, whichever the model prices lowest (in that order on ties) unless
/// PAGEDLLM_DECODE_MODE forces one. With early context loads (AttentionOptions::
/// early_context_loads) CTA items take partitions down to 32 tokens and, among counts the model
/// prices equal, the largest that the kernel combines itself: the tiles load before the wait, so
/// more partitions shorten the path after it (H200, batch 1 of Llama-3-8B at 300 tokens in a
/// 32-block table: 16 partitions instead of 8, -0.7 us per layer; bench/gpu_engine_notes.md
/// "Session 11").
DecodePlan plan_decode(DecodeKernel kind, DType dtype, int head_size, const AttnParams& p, int split_k) {
  DecodeKernel kinds[3] = {kind, kind, kind};
  int num_kinds = 1;
  if (kind == DecodeKernel::kV2) {
    const int forced = forced_v2_mode();
    if (forced == 2) kinds[0] = DecodeKernel::kV2Pair;
    else if (forced == 3) kinds[0] = DecodeKernel::kV2Cta;
    else if (forced == 0) {
      kinds[num_kinds++] = DecodeKernel::kV2Pair;
      kinds[num_kinds++] = DecodeKernel::kV2Cta;
    }
  }
  DecodePlan best{kinds[0], 1};
  double best_cost = -1;
  for (int i = 0; i < num_kinds; ++i) {
    const DecodeKernel k = kinds[i];
    const CostModel m = cost_model(k, dtype, head_size, p);
    int64_t lo = 1, hi = 1;
    if (split_k > 0) lo = hi = std::min<int64_t>(split_k, 1024);
    else if (split_k < 0 && p.max_blocks_per_seq > 0) hi = m.s_max(p);
    const bool more_on_ties = p.early_context_loads && k == DecodeKernel::kV2Cta;
    for (int64_t s = lo; s <= hi; ++s) {
      const double c = m.cost(p, s);
      const bool tie_to_more = more_on_ties && c == best_cost && best.kind == k && s <= m.in_kernel_max_splits;
      if (best_cost < 0 || c < best_cost || tie_to_more) {
        best_cost = c;
        best = {k, s};
      }
    }
  }
  return best;
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

void keep_pool_memory(cudaStream_t stream) {
  static std::atomic<bool> done[kMaxDevices] = {};
  const int dev = current_device();
  if (dev < kMaxDevices && done[dev].load()) return;
  // Not allowed while the stream captures a graph (cudaErrorStreamCaptureUnsupported, which would
  // also invalidate the capture): a split decode captured first in a process leaves it to the
  // next call outside a capture.
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  PAGEDLLM_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) return;
  cudaMemPool_t pool;
  PAGEDLLM_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  PAGEDLLM_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  if (dev < kMaxDevices) done[dev].store(true);
}

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

DecodePlanInfo last_decode_plan() { return detail::g_last_plan; }

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

  // Which decode kernel: v2 (persistent items on warps, warp pairs or CTAs) for bf16/fp16 up to d128, the
  // CTA-per-item kernel for d256 (or when PAGEDLLM_DECODE_KERNEL=v1), float32 on CUDA cores.
  // FP8 caches: v2 only (the query is bf16 / fp16 and head_size <= 128, checked).
  const DecodeKernel family = dtype == DType::kFloat32                               ? DecodeKernel::kFp32
                              : p.kv_fp8 != 0                                        ? DecodeKernel::kV2
                              : decode_v2_supports(dtype, head_size) && !force_v1() ? DecodeKernel::kV2
                                                                                    : DecodeKernel::kV1;
  // Flash-decoding split: partitions of whole blocks.
  const DecodePlan plan = plan_decode(family, dtype, head_size, p, options.split_k);
  const DecodeKernel kind = plan.kind;
  const int64_t splits = plan.splits;
  const bool v2 = kind == DecodeKernel::kV2 || kind == DecodeKernel::kV2Pair || kind == DecodeKernel::kV2Cta;
  if (splits > 1 && max_blocks > 0) {
    const int64_t blocks_per_part = (max_blocks + splits - 1) / splits;
    p.partition_tokens = static_cast<int>(blocks_per_part * p.block_size);
    // Keep the requested count: partitions past the context are empty.
    p.num_splits = static_cast<int>(splits);
    // v2 partitions each sequence's own context evenly (every partition busy at any length).
    p.even_splits = v2 && even_splits_enabled() ? 1 : 0;
  }
  // Combine the partitions in the decode kernel when the model (or the environment) says so and
  // the stream has zeroed arrival counters; else the reduction kernel after it.
  const int64_t groups = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * ((p.group + 15) / 16);
  if (v2 && p.num_splits > 1 && forced_combine() != 1 &&
      (forced_combine() == 2 || in_kernel_combine_pays(kind, p.num_splits)))
    p.split_counters = split_counters_for(stream, groups);
  g_last_plan = DecodePlanInfo{kind_name(kind), p.num_splits,
                               p.num_splits == 1 ? "none" : p.split_counters != nullptr ? "in-kernel" : "kernel"};
  auto launch = [&] {
    switch (kind) {
      case DecodeKernel::kFp32: return launch_attention_fp32(head_size, p, stream);
      case DecodeKernel::kV2: return launch_decode_v2(dtype, head_size, p, 1, stream);
      case DecodeKernel::kV2Pair: return launch_decode_v2(dtype, head_size, p, 2, stream);
      case DecodeKernel::kV2Cta: return launch_decode_v2(dtype, head_size, p, kDecodeV2Warps, stream);
      case DecodeKernel::kV1: return launch_decode_mma(dtype, head_size, p, stream);
    }
  };

  if (p.num_splits == 1) return launch();

  const size_t rows = static_cast<size_t>(p.num_seqs) * p.num_heads * p.num_splits;
  const size_t bytes = rows * (head_size + 2) * sizeof(float);
  // The caller's workspace when it is large enough (no memory nodes in a captured graph: measured
  // 0.7 us per decode layer at batch 1 on the H200), else a stream-ordered allocation.
  const bool own = options.workspace == nullptr || options.workspace_bytes < static_cast<int64_t>(bytes) ||
                   reinterpret_cast<std::uintptr_t>(options.workspace) % 16 != 0;  // partials read as float4
  void* workspace = own ? nullptr : options.workspace;
  if (own) {
    keep_pool_memory(stream);
    PAGEDLLM_CUDA_CHECK(cudaMallocAsync(&workspace, bytes, stream));
  }
  p.partial_out = static_cast<float*>(workspace);
  p.partial_max = p.partial_out + rows * head_size;
  p.partial_sum = p.partial_max + rows;
  try {
    launch();
    if (p.split_counters == nullptr) launch_splitk_reduce(dtype, head_size, p, stream);
  } catch (...) {
    if (own) cudaFreeAsync(workspace, stream);
    throw;
  }
  if (own) PAGEDLLM_CUDA_CHECK(cudaFreeAsync(workspace, stream));
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
