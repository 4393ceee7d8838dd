// cuda/paged_decode.cu — decode paged attention on tensor cores (bf16 / fp16), GQA-aware, with
// flash-decoding split-K partials (Dao et al., "Flash-Decoding for long-context inference", 2023).
//
// One CTA = (partition of the context, KV head, up to 16 query heads of that KV head's group).
// The group's query heads are the 16 rows of an m16n8k16 A operand, so each (block, KV head)
// tile of K and V is read from memory once for all of them. Each of the 4 warps streams its own
// 16-token tiles (tiles w, w+4, ...) through a private NSTAGE-deep cp.async ring in shared
// memory (no CTA barriers in the main loop), keeps an online softmax (FlashAttention-2, Dao 2023,
// algorithm 1) over its tiles, and the warps' states are merged at the end.
#include "launch_utils.cuh"

namespace pagedllm::cuda::detail {
namespace {

template <typename T, int D>
struct DecodeCfg {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTile = 16;                       // tokens per warp tile
  static constexpr int kStages = D <= 128 ? 3 : 2;        // cp.async ring depth per warp
  static constexpr int kRow = D + 8;                      // smem row stride (16 B pad: no bank conflicts)
  static constexpr int kChunks = D / 8;                   // 16-byte chunks per row
  static constexpr int kStageElems = 2 * kTile * kRow;    // K tile then V tile
  static constexpr int kWarpElems = kStages * kStageElems;
  static constexpr size_t kSmemBytes =
      (16 * kRow + kWarps * kWarpElems) * sizeof(T) + kWarps * 2 * 16 * sizeof(float);
  static_assert(16 * D * sizeof(float) <= kWarpElems * sizeof(T), "merge buffer must fit");
};

template <typename T, int D>
__global__ void __launch_bounds__(128) paged_decode_mma_kernel(const AttnParams p) {
  using C = DecodeCfg<T, D>;
  using TT = TypeTraits<T>;
  constexpr int KSTEPS = D / 16;
  constexpr bool kQInRegs = D <= 128;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  T* sW = sQ + 16 * C::kRow + warp * C::kWarpElems;
  float* sML = reinterpret_cast<float*>(sQ + 16 * C::kRow + C::kWarps * C::kWarpElems);

  const int split = blockIdx.x;
  const int head_chunks = (p.group + 15) / 16;
  const int kv_head = blockIdx.y / head_chunks;
  const int h0 = kv_head * p.group + (blockIdx.y % head_chunks) * 16;
  const int nrows = min(16, kv_head * p.group + p.group - h0);
  const int seq = blockIdx.z;
  const int seq_len = p.seq_lens[seq];
  int start = p.sliding_window > 0 ? max(0, seq_len - p.sliding_window) : 0;
  int end = seq_len;
  if (p.num_splits > 1) {
    start = max(start, split * p.partition_tokens);
    end = min(end, (split + 1) * p.partition_tokens);
  }
  const int32_t* bt = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  const T* kc = static_cast<const T*>(p.key_cache);
  const T* vc = static_cast<const T*>(p.value_cache);

  // Query rows (the group's heads are consecutive in [B, Hq, D]) -> shared memory.
  const T* q = static_cast<const T*>(p.query) + (static_cast<int64_t>(seq) * p.num_heads + h0) * D;
  for (int c = threadIdx.x; c < 16 * C::kChunks; c += C::kThreads) {
    const int r = c / C::kChunks, col = c % C::kChunks;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < nrows) v = *reinterpret_cast<const uint4*>(q + r * D + col * 8);
    *reinterpret_cast<uint4*>(sQ + r * C::kRow + col * 8) = v;
  }
  __syncthreads();

  uint32_t qf[kQInRegs ? KSTEPS : 1][4];
  const int a_row = (lane % 8) + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;
  if constexpr (kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) ldmatrix_x4(qf[kk], sQ + a_row * C::kRow + kk * 16 + a_col);
  }

  const int n_tiles = end > start ? (end - start + C::kTile - 1) / C::kTile : 0;
  const int my_tiles = n_tiles > warp ? (n_tiles - warp + C::kWarps - 1) / C::kWarps : 0;

  auto issue = [&](int k, int stage) {
    T* sK = sW + stage * C::kStageElems;
    T* sV = sK + C::kTile * C::kRow;
    const int t0 = start + (warp + k * C::kWarps) * C::kTile;
    cp_async_kv_rows<T, D, C::kTile, C::kRow, 32>(sK, sV, kc, vc, bt, t0, end, kv_head, p, lane);
  };

#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {
    if (s < my_tiles) issue(s, s);
    cp_async_commit();
  }

  float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;  // K (non-trans)
  const int v_row = (lane % 8) + ((lane / 8) % 2) * 8, v_col = (lane / 16) * 8;   // V (trans)

  for (int k = 0; k < my_tiles; ++k) {
    if (k + C::kStages - 1 < my_tiles) issue(k + C::kStages - 1, (k + C::kStages - 1) % C::kStages);
    cp_async_commit();
    cp_async_wait<C::kStages - 1>();
    __syncwarp();

    const T* sK = sW + (k % C::kStages) * C::kStageElems;
    const T* sV = sK + C::kTile * C::kRow;
    const int t0 = start + (warp + k * C::kWarps) * C::kTile;

    // S = Q K^T for 16 tokens: two n8 tiles.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    mma_qk<T, KSTEPS, 2>(
        s,
        [&](int kk, uint32_t(&a)[4]) {
          if constexpr (kQInRegs) {
            a[0] = qf[kk][0]; a[1] = qf[kk][1]; a[2] = qf[kk][2]; a[3] = qf[kk][3];
          } else {
            ldmatrix_x4(a, sQ + a_row * C::kRow + kk * 16 + a_col);
          }
        },
        [&](int kk, int) { return sK + b_row * C::kRow + kk * 16 + b_col; });

    // Online softmax (log2 domain); rows g and g+8 of this thread.
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = t0 + 8 * j + 2 * t + (e & 1);
        s[j][e] = pos < end ? score_log2(s[j][e], p.scale, p.scale_log2, p.soft_cap) : neg_inf();
      }
    online_softmax_update(s, m, l, acc);

    // O += P V
    mma_pv<T, D>(acc, s, 0, [&](int np) { return sV + v_row * C::kRow + np * 16 + v_col; });
    __syncwarp();
  }
  cp_async_wait<0>();
  __syncwarp();

  // Merge the 4 warps' softmax states.
  row_sums(l);
  float* sO = reinterpret_cast<float*>(sW);  // [16][D] for this warp
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    *reinterpret_cast<float2*>(sO + g * D + 8 * n + 2 * t) = make_float2(acc[n][0], acc[n][1]);
    *reinterpret_cast<float2*>(sO + (g + 8) * D + 8 * n + 2 * t) = make_float2(acc[n][2], acc[n][3]);
  }
  if (t == 0) {
    sML[warp * 32 + g] = m[0];
    sML[warp * 32 + g + 8] = m[1];
    sML[warp * 32 + 16 + g] = l[0];
    sML[warp * 32 + 16 + g + 8] = l[1];
  }
  __syncthreads();

  const float* sO_all = reinterpret_cast<const float*>(sQ + 16 * C::kRow);
  const int64_t warp_stride_f = C::kWarpElems * sizeof(T) / sizeof(float);
  const int64_t row0 = static_cast<int64_t>(seq) * p.num_heads + h0;
  for (int idx = threadIdx.x; idx < nrows * D; idx += C::kThreads) {
    const int r = idx / D, d = idx % D;
    float mmax = neg_inf();
#pragma unroll
    for (int w = 0; w < C::kWarps; ++w) mmax = fmaxf(mmax, sML[w * 32 + r]);
    float lsum = 0.f, o = 0.f;
    if (mmax != neg_inf()) {
#pragma unroll
      for (int w = 0; w < C::kWarps; ++w) {
        const float f = exp2f(sML[w * 32 + r] - mmax);
        lsum += f * sML[w * 32 + 16 + r];
        o += f * sO_all[w * warp_stride_f + r * D + d];
      }
    }
    o = lsum > 0.f ? o / lsum : 0.f;
    const int64_t row = row0 + r;
    if (p.num_splits == 1) {
      static_cast<T*>(p.out)[row * D + d] = TT::from_float(o);
    } else {
      p.partial_out[(row * p.num_splits + split) * D + d] = o;
      if (d == 0) {
        p.partial_max[row * p.num_splits + split] = mmax;
        p.partial_sum[row * p.num_splits + split] = lsum;
      }
    }
  }
}

template <typename T, int D>
void launch_decode_typed(const AttnParams& p, cudaStream_t stream) {
  using C = DecodeCfg<T, D>;
  static std::atomic<uint64_t> smem_raised{0};
  const int head_chunks = (p.group + 15) / 16;
  dim3 grid(p.num_splits, p.num_kv_heads * head_chunks, p.num_seqs);
  launch_checked(paged_decode_mma_kernel<T, D>, grid, C::kThreads, C::kSmemBytes, stream, smem_raised, p);
}

template <typename T, int D>
int v1_units() {
  using C = DecodeCfg<T, D>;
  static std::atomic<int> cached{0};
  static std::atomic<uint64_t> smem_raised{0};
  return resident_ctas(cached, paged_decode_mma_kernel<T, D>, C::kThreads, C::kSmemBytes, smem_raised);
}

}  // namespace

int decode_v1_units(DType dtype, int head_size) {
  return dispatch_mma_dtype(dtype, "CUDA decode", [&](auto tag) {
    using T = typename decltype(tag)::type;
    return dispatch_head_size(head_size, "CUDA decode", [&](auto d) { return v1_units<T, decltype(d)::value>(); });
  });
}

void launch_decode_mma(DType dtype, int head_size, const AttnParams& p, cudaStream_t stream) {
  dispatch_mma_dtype(dtype, "CUDA decode (tensor cores)", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_head_size(head_size, "CUDA decode", [&](auto d) { launch_decode_typed<T, decltype(d)::value>(p, stream); });
  });
}

}  // namespace pagedllm::cuda::detail
