// cuda/attention_fp32.cu — paged attention for float32 caches on CUDA cores (decode with
// split-K partials, and varlen causal prefill), plus the flash-decoding split-K reduction used by
// every dtype.
//
// float32 has no tensor-core path with float32 accuracy, and float32 KV caches are a
// correctness/debugging configuration, so this kernel favours simplicity: one CTA per (query
// row, query head [, partition]); each warp walks keys w, w+4, ... with an online softmax
// (Milakov & Gimelshein 2018), lanes split the head dimension, and the warps are merged at the
// end.
#include <cstdlib>

#include "launch_utils.cuh"

namespace pagedllm::cuda::detail {
namespace {

constexpr int kFp32Warps = 4;

template <int D>
__global__ void __launch_bounds__(128) attention_fp32_kernel(const AttnParams p) {
  constexpr int KD = (D + 31) / 32;  // head dims per lane
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x, head = blockIdx.y, split = blockIdx.z;
  const int kv_head = head / p.group;

  int seq, pos;
  if (p.query_start_loc == nullptr) {  // decode: row = sequence
    seq = row;
    pos = p.seq_lens[seq] - 1;
  } else {  // prefill: find b with query_start_loc[b] <= row < query_start_loc[b+1]
    int lo = 0, hi = p.num_seqs;  // answer in [lo, hi)
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (p.query_start_loc[mid] <= row) lo = mid; else hi = mid;
    }
    seq = lo;
    const int qlen = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
    pos = p.seq_lens[seq] - qlen + (row - p.query_start_loc[seq]);
  }
  int start = p.sliding_window > 0 ? max(0, pos - p.sliding_window + 1) : 0;
  int end = pos + 1;
  if (p.num_splits > 1) {
    start = max(start, split * p.partition_tokens);
    end = min(end, (split + 1) * p.partition_tokens);
  }

  __shared__ float sq[D];
  __shared__ float sO[kFp32Warps][D];
  __shared__ float sM[kFp32Warps], sL[kFp32Warps];
  const int64_t qrow = static_cast<int64_t>(row) * p.num_heads + head;
  const float* q = static_cast<const float*>(p.query) + qrow * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) sq[d] = q[d];
  __syncthreads();

  const int32_t* bt = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  const float* kc = static_cast<const float*>(p.key_cache);
  const float* vc = static_cast<const float*>(p.value_cache);
  float m = neg_inf(), l = 0.f, acc[KD];
#pragma unroll
  for (int i = 0; i < KD; ++i) acc[i] = 0.f;

  for (int key = start + warp; key < end; key += kFp32Warps) {
    const int64_t off = kv_row_offset(bt, key, kv_head, p, D);
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < KD; ++i) {
      const int d = lane + 32 * i;
      if (d < D) dot += sq[d] * kc[off + d];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const float s = score_log2(dot, p.scale, p.scale_log2, p.soft_cap);
    const float m_new = fmaxf(m, s);
    const float corr = exp2f(m - m_new);
    const float e = exp2f(s - m_new);
    l = l * corr + e;
#pragma unroll
    for (int i = 0; i < KD; ++i) {
      const int d = lane + 32 * i;
      acc[i] = acc[i] * corr + (d < D ? e * vc[off + d] : 0.f);
    }
    m = m_new;
  }

#pragma unroll
  for (int i = 0; i < KD; ++i) {
    const int d = lane + 32 * i;
    if (d < D) sO[warp][d] = acc[i];
  }
  if (lane == 0) {
    sM[warp] = m;
    sL[warp] = l;
  }
  __syncthreads();

  float mmax = neg_inf();
#pragma unroll
  for (int w = 0; w < kFp32Warps; ++w) mmax = fmaxf(mmax, sM[w]);
  float f[kFp32Warps], lsum = 0.f;
#pragma unroll
  for (int w = 0; w < kFp32Warps; ++w) {
    f[w] = mmax == neg_inf() ? 0.f : exp2f(sM[w] - mmax);
    lsum += f[w] * sL[w];
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kFp32Warps; ++w) o += f[w] * sO[w][d];
    o = lsum > 0.f ? o / lsum : 0.f;
    if (p.num_splits == 1) {
      static_cast<float*>(p.out)[qrow * D + d] = o;
    } else {
      p.partial_out[(qrow * p.num_splits + split) * D + d] = o;
      if (d == 0) {
        p.partial_max[qrow * p.num_splits + split] = mmax;
        p.partial_sum[qrow * p.num_splits + split] = lsum;
      }
    }
  }
}

template <int D>
void launch_fp32_typed(const AttnParams& p, cudaStream_t stream) {
  const bool decode = p.query_start_loc == nullptr;
  dim3 grid(p.num_rows, p.num_heads, decode ? p.num_splits : 1);
  attention_fp32_kernel<D><<<grid, 32 * kFp32Warps, 0, stream>>>(p);
  PAGEDLLM_CUDA_CHECK_LAUNCH();
}

template <typename T>
__device__ __forceinline__ void store(T* p, float v) {
  if constexpr (std::is_same_v<T, float>) *p = v;
  else *p = TypeTraits<T>::from_float(v);
}

constexpr int kReduceThreads = 256;

/// One CTA per (sequence, query head) row. Thread (split group sg, column group cg) sums
/// float4 columns 4cg..4cg+3 over splits sg, sg + NSG, ...; the NSG group sums are then added in
/// shared memory. Many independent loads per thread, unlike a per-column loop over all splits.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads) splitk_reduce_kernel(const AttnParams p, int D) {
  // Launched as a programmatic dependent of the decode kernel (when enabled): wait here until it
  // has completed and its partials are visible. Without the launch attribute this is a no-op.
  pdl_wait();
  // ... and let the next kernel (the O projection's GEMV, itself a programmatic dependent) launch
  // and start streaming its weights while this one runs.
  pdl_launch_dependents();
  extern __shared__ float smem[];  // [kReduceThreads * 4] group sums, then [num_splits] weights
  float* s_acc = smem;
  float* s_w = smem + kReduceThreads * 4;
  __shared__ float s_total;
  const int64_t row = blockIdx.x;  // b * Hq + h
  const int S = p.num_splits;
  const float* pm = p.partial_max + row * S;
  const float* ps = p.partial_sum + row * S;
  if (threadIdx.x < 32) {
    float mmax = neg_inf();
    for (int s = threadIdx.x; s < S; s += 32) mmax = fmaxf(mmax, pm[s]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mmax = fmaxf(mmax, __shfl_xor_sync(0xffffffffu, mmax, o));
    float total = 0.f;
    for (int s = threadIdx.x; s < S; s += 32) {
      const float w = mmax == neg_inf() ? 0.f : ps[s] * exp2f(pm[s] - mmax);
      s_w[s] = w;
      total += w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (threadIdx.x == 0) s_total = total;
  }
  __syncthreads();
  const int cols = D / 4;                    // float4 columns
  const int groups = kReduceThreads / cols;  // split groups
  const int cg = threadIdx.x % cols, sg = threadIdx.x / cols;
  const float4* po = reinterpret_cast<const float4*>(p.partial_out + row * S * D);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (sg < groups) {
#pragma unroll 4
    for (int s = sg; s < S; s += groups) {
      const float w = s_w[s];
      const float4 v = po[static_cast<int64_t>(s) * cols + cg];
      if (w != 0.f) {  // empty partitions hold zeros; skip them exactly
        acc.x += w * v.x;
        acc.y += w * v.y;
        acc.z += w * v.z;
        acc.w += w * v.w;
      }
    }
    reinterpret_cast<float4*>(s_acc)[sg * cols + cg] = acc;
  }
  __syncthreads();
  const float inv = s_total > 0.f ? 1.f / s_total : 0.f;
  T* out = static_cast<T*>(p.out) + row * D;
  for (int d = threadIdx.x; d < D; d += kReduceThreads) {
    float o = 0.f;
    for (int g = 0; g < groups; ++g) o += s_acc[g * D + d];
    store(out + d, o * inv);
  }
}

constexpr int kReduceRowsPerCta = 8;  // one warp per row

/// One WARP per (sequence, query head) row, 8 rows per CTA, no shared memory or CTA barrier:
/// lanes take the partitions 32 at a time for the max and the weights, then each lane sums its
/// float4 columns (lane, lane + 32, ...) over all partitions with the weights broadcast by
/// shuffle (independent loads, unrolled). Empty partitions hold zeros and weight 0.
template <typename T, int D>
__global__ void __launch_bounds__(32 * kReduceRowsPerCta) splitk_reduce_warp_kernel(const AttnParams p) {
  pdl_wait();  // as splitk_reduce_kernel
  pdl_launch_dependents();
  constexpr int kCols = D / 4;                   // float4 columns
  constexpr int kPerLane = (kCols + 31) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kReduceRowsPerCta + threadIdx.x / 32;
  if (row >= static_cast<int64_t>(p.num_rows) * p.num_heads) return;
  const int S = p.num_splits;
  const float* pm = p.partial_max + row * S;
  const float* ps = p.partial_sum + row * S;
  float mmax = neg_inf();
  for (int s = lane; s < S; s += 32) mmax = fmaxf(mmax, pm[s]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mmax = fmaxf(mmax, __shfl_xor_sync(0xffffffffu, mmax, o));
  const float base = mmax == neg_inf() ? 0.f : mmax;
  const float4* po = reinterpret_cast<const float4*>(p.partial_out + row * S * D);
  float4 acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  float total = 0.f;
  for (int s0 = 0; s0 < S; s0 += 32) {
    const int s = s0 + lane;
    const float w = s < S ? ps[s] * exp2f(pm[s] - base) : 0.f;  // -inf max (empty): weight 0
    total += w;
    const int n = min(32, S - s0);
#pragma unroll 4
    for (int i = 0; i < n; ++i) {
      const float wi = __shfl_sync(0xffffffffu, w, i);
      const float4* src = po + static_cast<int64_t>(s0 + i) * kCols;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int c = lane + 32 * j;
        if (c < kCols) {
          const float4 v = src[c];
          acc[j].x += wi * v.x;
          acc[j].y += wi * v.y;
          acc[j].z += wi * v.z;
          acc[j].w += wi * v.w;
        }
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  const float inv = total > 0.f ? 1.f / total : 0.f;
  T* out = static_cast<T*>(p.out) + row * D;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int c = lane + 32 * j;
    if (c < kCols) {
      store(out + 4 * c, acc[j].x * inv);
      store(out + 4 * c + 1, acc[j].y * inv);
      store(out + 4 * c + 2, acc[j].z * inv);
      store(out + 4 * c + 3, acc[j].w * inv);
    }
  }
}

/// Which reduction: one warp per row for at most kWarpReduceMaxSplits partitions (its lanes walk
/// the partitions in sequence, so a long walk is a latency chain), one CTA per row beyond (its
/// split groups walk them in parallel). H200, run 5: warp rows faster at 8 x 4,096 (4 splits:
/// 40.0 against 44.1 us) and 64 x 4,096 (2 splits: 258.8 against 261.3 us), CTA rows at
/// 1 x 4,096 (32 splits: 13.3 against 15.2 us). PAGEDLLM_REDUCE=cta or =warp forces one (for
/// benchmarking; read once).
bool reduce_per_cta(int num_splits) {
  static const int forced = [] {
    const char* v = std::getenv("PAGEDLLM_REDUCE");
    if (v == nullptr) return 0;
    return std::string(v) == "cta" ? 1 : std::string(v) == "warp" ? 2 : 0;
  }();
  if (forced != 0) return forced == 1;
  return num_splits > kWarpReduceMaxSplits;
}

template <typename T>
void launch_reduce_typed(int head_size, const AttnParams& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.num_rows) * p.num_heads;
  if (reduce_per_cta(p.num_splits)) {
    static std::atomic<uint64_t> smem_raised{0};
    const size_t smem = (kReduceThreads * 4 + static_cast<size_t>(p.num_splits)) * sizeof(float);
    launch_pdl(splitk_reduce_kernel<T>, dim3(static_cast<unsigned>(rows)), dim3(kReduceThreads), smem, stream,
               smem_raised, true, p, head_size);
    return;
  }
  dispatch_head_size(head_size, "CUDA split-K reduce", [&](auto d) {
    static std::atomic<uint64_t> smem_raised{0};
    const auto ctas = static_cast<unsigned>((rows + kReduceRowsPerCta - 1) / kReduceRowsPerCta);
    launch_pdl(splitk_reduce_warp_kernel<T, decltype(d)::value>, dim3(ctas), dim3(32 * kReduceRowsPerCta), 0,
               stream, smem_raised, true, p);
  });
}

template <int D>
int fp32_units() {
  static std::atomic<int> cached{0};
  static std::atomic<uint64_t> smem_raised{0};  // static shared memory only: nothing to raise
  return resident_ctas(cached, attention_fp32_kernel<D>, 32 * kFp32Warps, 0, smem_raised);
}

}  // namespace

int attention_fp32_units(int head_size) {
  return dispatch_head_size(head_size, "CUDA fp32 attention", [](auto d) { return fp32_units<decltype(d)::value>(); });
}

void launch_attention_fp32(int head_size, const AttnParams& p, cudaStream_t stream) {
  dispatch_head_size(head_size, "CUDA fp32 attention", [&](auto d) { launch_fp32_typed<decltype(d)::value>(p, stream); });
}

void launch_splitk_reduce(DType dtype, int head_size, const AttnParams& p, cudaStream_t stream) {
  // Programmatic dependent launch (sm_90): the reduction's launch overlaps the decode kernel's
  // tail; pdl_wait() in the kernel keeps the data dependency. PAGEDLLM_NO_PDL=1 turns it off.
  switch (dtype) {
    case DType::kFloat32: return launch_reduce_typed<float>(head_size, p, stream);
    case DType::kBFloat16: return launch_reduce_typed<__nv_bfloat16>(head_size, p, stream);
    case DType::kFloat16: return launch_reduce_typed<__half>(head_size, p, stream);
    default: throw std::runtime_error(std::string("CUDA split-K reduce: unsupported dtype ") + dtype_name(dtype));
  }
}

}  // namespace pagedllm::cuda::detail
