// cuda/paged_decode_v2.cu — decode paged attention on tensor cores (bf16 / fp16, head sizes up
// to 128) with persistent per-warp work items.
//
// A work item is (sequence, KV head, up to 16 query heads of its group, partition of the
// context); the group's query heads are the 16 rows of an m16n8k16 A operand, so each
// (block, KV head) tile is read once for all of them. Unlike the CTA-per-item kernel
// (paged_decode.cu), one WARP owns a whole item and walks its 16-token tiles alone, and a warp
// takes items first, first + W, first + 2W, ... (W = warps in the grid, sized to the device's
// occupancy). The warp's private 3-deep cp.async ring runs on across item boundaries — the tiles of
// the next item are already in flight while the current one finishes — so the memory pipe never
// drains between items, and with no cross-warp merge there is no CTA barrier at all. Q goes
// straight from global memory into the A fragments. Each item ends with an online-softmax state
// (FlashAttention-2, Dao 2023) written as the output row (one partition) or as flash-decoding
// partials (Dao et al. 2023) that launch_splitk_reduce combines.
#include <string>

#include "attention_launch.h"
#include "cuda_check.h"

namespace pagedllm::cuda::detail {
namespace {

template <typename T, int D, int W, int NS>
struct DecodeV2Cfg {
  static constexpr int kWarps = W;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTile = 16;
  static constexpr int kStages = NS;
  static constexpr int kRow = D + 8;  // 16-byte pad: conflict-free ldmatrix
  static constexpr int kChunks = D / 8;
  static constexpr int kStageElems = 2 * kTile * kRow;
  static constexpr int kWarpElems = kStages * kStageElems;
  static constexpr size_t kSmemBytes = kWarps * kWarpElems * sizeof(T);
};

struct DecodeItem {
  int seq, kv_head, h0, nrows, split, start, end, ntiles;
  const int32_t* bt;
};

/// Item index -> (sequence, KV head, head chunk, partition); partition fastest.
__device__ __forceinline__ DecodeItem decode_item(const AttnParams& p, int idx, int head_chunks) {
  DecodeItem it;
  const int splits = p.num_splits;
  it.split = idx % splits;
  idx /= splits;
  const int hc = idx % head_chunks;
  idx /= head_chunks;
  it.kv_head = idx % p.num_kv_heads;
  it.seq = idx / p.num_kv_heads;
  it.h0 = it.kv_head * p.group + hc * 16;
  it.nrows = min(16, p.group - hc * 16);
  const int seq_len = p.seq_lens[it.seq];
  int start = p.sliding_window > 0 ? max(0, seq_len - p.sliding_window) : 0;
  int end = seq_len;
  if (splits > 1) {
    start = max(start, it.split * p.partition_tokens);
    end = min(end, (it.split + 1) * p.partition_tokens);
  }
  it.start = start;
  it.end = end;
  it.ntiles = end > start ? (end - start + 15) / 16 : 0;
  it.bt = p.block_tables + static_cast<int64_t>(it.seq) * p.max_blocks_per_seq;
  return it;
}

template <typename T, int D, int W_, int NS, int PF>
__global__ void __launch_bounds__(32 * W_) paged_decode_v2_kernel(const AttnParams p, int num_items,
                                                                  int head_chunks) {
  using C = DecodeV2Cfg<T, D, W_, NS>;
  using TT = TypeTraits<T>;
  constexpr int KSTEPS = D / 16;
  constexpr int S = C::kStages;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Let a programmatic dependent (the split-K reduction) be scheduled now; it waits for this
  // grid's completion itself (griddepcontrol.wait). No-op without a dependent launch.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  T* ring = reinterpret_cast<T*>(smem_raw) + warp * C::kWarpElems;
  const int W = gridDim.x * C::kWarps;
  const int first = blockIdx.x * C::kWarps + warp;
  const T* kc = static_cast<const T*>(p.key_cache);
  const T* vc = static_cast<const T*>(p.value_cache);

  // ---- issue cursor: the next (item, tile) whose K/V go into the ring
  int ii = first, ik = 0, slot_issue = 0;
  DecodeItem iitem{};
  if (ii < num_items) iitem = decode_item(p, ii, head_chunks);
  auto skip_exhausted = [&]() {
    while (ii < num_items && ik >= iitem.ntiles) {
      ii += W;
      ik = 0;
      if (ii < num_items) iitem = decode_item(p, ii, head_chunks);
    }
  };
  skip_exhausted();
  auto issue_next = [&]() {
    if (ii < num_items) {
      T* sK = ring + slot_issue * C::kStageElems;
      T* sV = sK + C::kTile * C::kRow;
      const int t0 = iitem.start + ik * C::kTile;
      const int row0 = t0 & (p.block_size - 1);
      if (row0 + C::kTile <= p.block_size && t0 + C::kTile <= iitem.end) {
        // The whole tile lies in one block (the common case): one block-table lookup, and the
        // tile is one contiguous run of kTile rows.
        const T* kb = kc + kv_row_offset(iitem.bt, t0, iitem.kv_head, p, D);
        const T* vb = vc + (kb - kc);
#pragma unroll
        for (int c = lane; c < C::kTile * C::kChunks; c += 32) {
          const int r = c / C::kChunks, col = c % C::kChunks;
          cp_async_16<PF>(sK + r * C::kRow + col * 8, kb + r * D + col * 8, true);
          cp_async_16<PF>(sV + r * C::kRow + col * 8, vb + r * D + col * 8, true);
        }
      } else {
#pragma unroll
        for (int c = lane; c < C::kTile * C::kChunks; c += 32) {
          const int r = c / C::kChunks, col = c % C::kChunks;
          const int pos = t0 + r;
          const bool valid = pos < iitem.end;
          const int64_t off = valid ? kv_row_offset(iitem.bt, pos, iitem.kv_head, p, D) + col * 8 : 0;
          cp_async_16<PF>(sK + r * C::kRow + col * 8, kc + off, valid);
          cp_async_16<PF>(sV + r * C::kRow + col * 8, vc + off, valid);
        }
      }
      slot_issue = slot_issue + 1 == S ? 0 : slot_issue + 1;
      ++ik;
      skip_exhausted();
    }
    cp_async_commit();  // one group per call (possibly empty) keeps wait_group counting exact
  };

#pragma unroll
  for (int s = 0; s < S - 1; ++s) issue_next();

  const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;  // K (non-trans)
  const int v_row = (lane % 8) + ((lane / 8) % 2) * 8, v_col = (lane / 16) * 8;   // V (trans)
  int slot = 0;

  for (int ci = first; ci < num_items; ci += W) {
    const DecodeItem it = decode_item(p, ci, head_chunks);

    // Q rows h0 .. h0+nrows-1 straight into the A fragments (rows >= nrows are zero).
    uint32_t qf[KSTEPS][4];
    {
      const T* q = static_cast<const T*>(p.query) + (static_cast<int64_t>(it.seq) * p.num_heads + it.h0) * D;
      const bool lo = g < it.nrows, hi = g + 8 < it.nrows;
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        const int c0 = kk * 16 + 2 * t;
        qf[kk][0] = lo ? *reinterpret_cast<const uint32_t*>(q + g * D + c0) : 0u;
        qf[kk][1] = hi ? *reinterpret_cast<const uint32_t*>(q + (g + 8) * D + c0) : 0u;
        qf[kk][2] = lo ? *reinterpret_cast<const uint32_t*>(q + g * D + c0 + 8) : 0u;
        qf[kk][3] = hi ? *reinterpret_cast<const uint32_t*>(q + (g + 8) * D + c0 + 8) : 0u;
      }
    }

    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

    for (int k = 0; k < it.ntiles; ++k) {
      issue_next();
      cp_async_wait<S - 1>();
      __syncwarp();
      const T* sK = ring + slot * C::kStageElems;
      const T* sV = sK + C::kTile * C::kRow;
      const int t0 = it.start + k * C::kTile;

      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t b[4];
        ldmatrix_x4(b, sK + b_row * C::kRow + kk * 16 + b_col);
        mma_16816<T>(s[0], qf[kk], b[0], b[1]);
        mma_16816<T>(s[1], qf[kk], b[2], b[3]);
      }

      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = t0 + 8 * j + 2 * t + (e & 1);
          const float v = pos < it.end ? score_log2(s[j][e], p.scale, p.scale_log2, p.soft_cap) : neg_inf();
          s[j][e] = v;
          mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
      float base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        base[r] = mx[r] == neg_inf() ? 0.f : mx[r];
        const float corr = exp2f(m[r] - base[r]);
        m[r] = mx[r];
        l[r] *= corr;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          acc[n][2 * r] *= corr;
          acc[n][2 * r + 1] *= corr;
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][e] = exp2f(s[j][e] - base[e >> 1]);
          l[e >> 1] += s[j][e];
        }
      uint32_t pa[4];
      pa[0] = TT::pack(s[0][0], s[0][1]);
      pa[1] = TT::pack(s[0][2], s[0][3]);
      pa[2] = TT::pack(s[1][0], s[1][1]);
      pa[3] = TT::pack(s[1][2], s[1][3]);
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, sV + v_row * C::kRow + np * 16 + v_col);
        mma_16816<T>(acc[2 * np], pa, b[0], b[1]);
        mma_16816<T>(acc[2 * np + 1], pa, b[2], b[3]);
      }
      slot = slot + 1 == S ? 0 : slot + 1;
      __syncwarp();
    }

    // ---- this item's rows: the output (one partition) or the flash-decoding partials
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
      const int row = g + 8 * r;
      if (row >= it.nrows) continue;
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      const int64_t grow = static_cast<int64_t>(it.seq) * p.num_heads + it.h0 + row;
      if (p.num_splits == 1) {
        T* dst = static_cast<T*>(p.out) + grow * D + 2 * t;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
          *reinterpret_cast<uint32_t*>(dst + 8 * n) = TT::pack(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
      } else {
        const int64_t prow = grow * p.num_splits + it.split;
        float* dst = p.partial_out + prow * D + 2 * t;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
          *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
        if (t == 0) {
          p.partial_max[prow] = m[r];
          p.partial_sum[prow] = l[r];
        }
      }
    }
  }
  cp_async_wait<0>();
}

/// One kernel configuration: W warps per CTA, an NS-deep ring per warp, L2 prefetch hint PF.
/// 4 x 3 with the 128-byte hint won on the H200 (run 3: 270 us at 64 x 4096 against 274-286 us
/// for 2 x 6, 3 x 4, a 256-byte or no hint, and cp.async.bulk row copies; see
/// bench/cuda_kernels_notes.md).
template <typename T, int D, int W = 4, int NS = 3, int PF = 128>
struct V2 {
  using C = DecodeV2Cfg<T, D, W, NS>;
  static constexpr auto kernel() { return paged_decode_v2_kernel<T, D, W, NS, PF>; }

  // Concurrent warps of the grid: occupancy x SMs x warps per CTA (cached per instantiation).
  static int units() {
    static std::atomic<int> cached{0};
    if (cached.load() > 0) return cached.load();
    static std::atomic<uint64_t> smem_raised{0};
    set_max_dynamic_smem(reinterpret_cast<const void*>(kernel()), C::kSmemBytes, smem_raised);
    int per_sm = 0, sms = 0, dev = 0;
    PAGEDLLM_CUDA_CHECK(cudaGetDevice(&dev));
    PAGEDLLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel(), C::kThreads, C::kSmemBytes));
    PAGEDLLM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cached.store(std::max(1, per_sm) * sms * C::kWarps);
    return cached.load();
  }

  static void launch(const AttnParams& p, cudaStream_t stream) {
    const int units_ = units();  // also raises the smem limit
    const int head_chunks = (p.group + 15) / 16;
    const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * head_chunks * p.num_splits;
    if (items > (int64_t{1} << 31) - 1)
      throw std::runtime_error("CUDA decode: too many work items (" + std::to_string(items) + ")");
    const int64_t warps = std::min<int64_t>(units_, items);
    const unsigned ctas = static_cast<unsigned>((warps + C::kWarps - 1) / C::kWarps);
    auto k = kernel();
    k<<<ctas, C::kThreads, C::kSmemBytes, stream>>>(p, static_cast<int>(items), head_chunks);
    PAGEDLLM_CUDA_CHECK_LAUNCH();
  }
};

/// Calls f(V2<...>{}) with the configuration of (T, head_size).
template <typename T, typename F>
auto with_config(int head_size, F&& f) {
  switch (head_size) {
    case 64: return f(V2<T, 64>{});
    case 80: return f(V2<T, 80>{});
    case 96: return f(V2<T, 96>{});
    case 128: return f(V2<T, 128>{});
    default: throw std::runtime_error("CUDA decode v2: unsupported head size " + std::to_string(head_size));
  }
}

template <typename T>
void launch_v2_dtype(int head_size, const AttnParams& p, cudaStream_t stream) {
  with_config<T>(head_size, [&](auto cfg) { decltype(cfg)::launch(p, stream); });
}

template <typename T>
int units_dtype(int head_size) {
  return with_config<T>(head_size, [&](auto cfg) { return decltype(cfg)::units(); });
}

}  // namespace

bool decode_v2_supports(DType dtype, int head_size) {
  return (dtype == DType::kBFloat16 || dtype == DType::kFloat16) && head_size <= 128;
}

int decode_v2_units(DType dtype, int head_size) {
  return dtype == DType::kBFloat16 ? units_dtype<__nv_bfloat16>(head_size) : units_dtype<__half>(head_size);
}

void launch_decode_v2(DType dtype, int head_size, const AttnParams& p, cudaStream_t stream) {
  if (dtype == DType::kBFloat16) return launch_v2_dtype<__nv_bfloat16>(head_size, p, stream);
  if (dtype == DType::kFloat16) return launch_v2_dtype<__half>(head_size, p, stream);
  throw std::runtime_error(std::string("CUDA decode v2: unsupported dtype ") + dtype_name(dtype));
}

}  // namespace pagedllm::cuda::detail
