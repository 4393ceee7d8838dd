// cuda/paged_prefill.cu — variable-length causal attention over the paged KV cache on tensor
// cores (bf16 / fp16): chunked prefill, prefix-cache hits and decode rows in one launch.
// FlashAttention-2 (Dao 2023, algorithm 1) per query tile, with GQA packing: a tile is 16 x warps
// rows of (query token, query head of one KV head's group), token-major, so each K/V tile read
// from the cache serves every query head of the group. 4 warps x 16 rows (8 x 16 for d128); K/V
// tiles of kBC tokens go through a 2-stage cp.async pipeline shared by the CTA. Causal and
// sliding-window masks are applied per row; warps skip KV tiles entirely outside their rows' range.
//
// Grid: x = an upper bound on the number of query tiles (sum over sequences of
// ceil(q_len * G / rows) <= T*G/rows + B), y = KV head. Each CTA finds its (sequence, tile) by a
// warp prefix scan over query_start_loc — no host-side knowledge of q lengths is needed, so the
// launch never syncs and is graph-capturable. Surplus CTAs exit at once.
//
// FP8 caches (p.kv_fp8): K/V rows of codes go through the same ring (half the bytes), and the CTA
// decodes each stage into float16 tiles (exact) before the mma steps, which then run in float16
// (a bfloat16 query tile is converted once); k_scale joins the softmax scale, v_scale the output.
#include <string>

#include "attention_launch.h"
#include "cuda_check.h"
#include "fp8_kv.cuh"

namespace pagedllm::cuda::detail {
namespace {

template <typename T, int D, int W, int NS, int KV = 0>
struct PrefillCfg {
  static constexpr int kWarps = W;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16 * kWarps;            // packed (token, head) rows per CTA
  static constexpr int kBC = D <= 128 ? 64 : 32;        // keys per KV tile
  static constexpr int kStages = NS;
  static constexpr bool kFp8 = KV != 0;                 // FP8 cache: rows of codes, decoded per tile
  static constexpr int kRow = D + 8;                    // smem row stride in 16-bit elements (16 B pad)
  static constexpr int kChunks = D / 8;                 // 16-byte chunks of a Q row
  static constexpr int kRingRowBytes = kFp8 ? D + 16 : kRow * int(sizeof(T));  // a K / V ring row
  static constexpr int kKVChunkElems = kFp8 ? 16 : 8;   // cache elements per 16-byte copy
  static constexpr int kKVChunks = D / kKVChunkElems;
  static constexpr int kStageBytes = 2 * kBC * kRingRowBytes;
  static constexpr int kConvBytes = kFp8 ? 2 * kBC * kRow * 2 : 0;  // FP8: the current tiles in float16
  static constexpr size_t kSmemBytes = kRows * kRow * sizeof(T) + kStages * kStageBytes + kConvBytes;
};

template <typename T, int D, int W, int NS, int KV>
__global__ void __launch_bounds__(32 * W) paged_prefill_mma_kernel(const AttnParams p) {
  using C = PrefillCfg<T, D, W, NS, KV>;
  // T: query / output dtype; MT: the mma operands (float16 for an FP8 cache, whose tiles are
  // decoded to float16 in shared memory); CT: the cache's element type.
  using MT = std::conditional_t<KV == 0, T, __half>;
  using CT = std::conditional_t<KV == 0, T, uint8_t>;
  using TT = TypeTraits<T>;
  constexpr int KSTEPS = D / 16;
  constexpr int NT = C::kBC / 8;  // n8 tiles of scores per KV tile
  constexpr bool kQInRegs = D <= 128;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  unsigned char* sRing = smem_raw + C::kRows * C::kRow * sizeof(T);
  MT* sConv = reinterpret_cast<MT*>(sRing + C::kStages * C::kStageBytes);
  __shared__ int s_item[2];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int G = p.group;
  const int32_t* qsl = p.query_start_loc;

  // ---- which (sequence, query tile) this CTA computes
  if (warp == 0) {
    const int target = blockIdx.x;
    int base = 0;
    bool found = false;
    for (int b0 = 0; b0 < p.num_seqs; b0 += 32) {
      const int b = b0 + lane;
      int nt = 0;
      if (b < p.num_seqs) nt = ((qsl[b + 1] - qsl[b]) * G + C::kRows - 1) / C::kRows;
      int incl = nt;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += v;
      }
      const bool hit = nt > 0 && target >= base + incl - nt && target < base + incl;
      const unsigned mask = __ballot_sync(0xffffffffu, hit);
      if (mask) {
        if (hit) {
          s_item[0] = b;
          s_item[1] = nt - 1 - (target - (base + incl - nt));  // latest (longest) tiles first
        }
        found = true;
        break;
      }
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (!found && lane == 0) s_item[0] = -1;
  }
  __syncthreads();
  const int seq = s_item[0];
  if (seq < 0) return;
  const int tile = s_item[1];

  const int kv_head = blockIdx.y;
  const int qs = qsl[seq];
  const int qlen = qsl[seq + 1] - qs;
  const int ctx0 = p.seq_lens[seq] - qlen;  // position of the chunk's first query token
  const int total_rows = qlen * G;
  const int row0 = tile * C::kRows;
  const int32_t* bt = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  const CT* kc = static_cast<const CT*>(p.key_cache);
  const CT* vc = static_cast<const CT*>(p.value_cache);
  const T* qbase = static_cast<const T*>(p.query);

  // ---- Q tile -> shared memory
  for (int c = threadIdx.x; c < C::kRows * C::kChunks; c += C::kThreads) {
    const int r = c / C::kChunks, col = c % C::kChunks;
    const int R = row0 + r;
    const bool valid = R < total_rows;
    const int i = R / G, j = R % G;
    const T* src = valid ? qbase + ((static_cast<int64_t>(qs) + i) * p.num_heads + kv_head * G + j) * D + col * 8
                         : qbase;
    cp_async_16(sQ + r * C::kRow + col * 8, src, valid);
  }
  cp_async_commit();

  // ---- the CTA's key range
  const int last_row = min(row0 + C::kRows, total_rows) - 1;
  const int kv_hi = ctx0 + last_row / G + 1;
  const int kv_lo = p.sliding_window > 0 ? max(0, ctx0 + row0 / G - p.sliding_window + 1) : 0;
  const int n_kv_tiles = (kv_hi - kv_lo + C::kBC - 1) / C::kBC;

  // ---- this warp's rows
  const int wrow0 = row0 + warp * 16;
  const bool warp_active = wrow0 < total_rows;
  const int w_first_pos = ctx0 + wrow0 / G;
  const int w_last_pos = ctx0 + (min(wrow0 + 15, total_rows - 1)) / G;
  int rpos[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int R = wrow0 + g + 8 * r;
    rpos[r] = R < total_rows ? ctx0 + R / G : -1;
  }

  auto issue = [&](int k, int stage) {
    unsigned char* sK = sRing + stage * C::kStageBytes;
    unsigned char* sV = sK + C::kBC * C::kRingRowBytes;
    const int t0 = kv_lo + k * C::kBC;
#pragma unroll
    for (int c = threadIdx.x; c < C::kBC * C::kKVChunks; c += C::kThreads) {
      const int r = c / C::kKVChunks, col = c % C::kKVChunks;
      const int pos = t0 + r;
      const bool valid = pos < kv_hi;
      const int64_t off = valid ? kv_row_offset(bt, pos, kv_head, p, D) + col * C::kKVChunkElems : 0;
      cp_async_16(sK + r * C::kRingRowBytes + col * 16, kc + off, valid);
      cp_async_16(sV + r * C::kRingRowBytes + col * 16, vc + off, valid);
    }
  };

#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {
    if (s < n_kv_tiles) issue(s, s);
    cp_async_commit();
  }
  cp_async_wait<C::kStages - 1>();  // the Q group
  __syncthreads();
  if constexpr (KV != 0 && !std::is_same_v<T, MT>) {  // bf16 queries meet float16 tiles: Q to float16
    uint32_t* q32 = reinterpret_cast<uint32_t*>(sQ);
    for (int i = threadIdx.x; i < C::kRows * C::kRow / 2; i += C::kThreads) q32[i] = to_mma_pair<T, MT>(q32[i]);
    __syncthreads();
  }
  const KernelScales scales = kernel_scales<KV>(p);  // an FP8 cache's scales
  const float sc = scales.scale, sc_log2 = scales.scale_log2, out_scale = scales.out;

  const int a_row = (lane % 8) + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;
  const MT* sQw = reinterpret_cast<const MT*>(sQ) + warp * 16 * C::kRow;
  uint32_t qf[kQInRegs ? KSTEPS : 1][4];
  if constexpr (kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) ldmatrix_x4(qf[kk], sQw + a_row * C::kRow + kk * 16 + a_col);
  }
  const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;
  const int v_row = (lane % 8) + ((lane / 8) % 2) * 8, v_col = (lane / 16) * 8;

  float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  for (int k = 0; k < n_kv_tiles; ++k) {
    if (k + C::kStages - 1 < n_kv_tiles) issue(k + C::kStages - 1, (k + C::kStages - 1) % C::kStages);
    cp_async_commit();
    cp_async_wait<C::kStages - 1>();
    __syncthreads();
    const unsigned char* stage = sRing + (k % C::kStages) * C::kStageBytes;
    if constexpr (C::kFp8) {  // the stage's codes -> float16 tiles in sConv (exact), for ldmatrix
      for (int c = threadIdx.x; c < 2 * C::kBC * C::kKVChunks; c += C::kThreads) {
        const int r = c / C::kKVChunks, col = c % C::kKVChunks;  // r < 2 kBC: K rows, then V rows
        uint4 lo, hi;
        fp8::decode16_half<KV>(*reinterpret_cast<const uint4*>(stage + r * C::kRingRowBytes + col * 16), lo, hi);
        uint4* dst = reinterpret_cast<uint4*>(sConv + r * C::kRow + col * 16);
        dst[0] = lo;
        dst[1] = hi;
      }
      __syncthreads();
    }

    const int t0 = kv_lo + k * C::kBC;
    const bool in_range = warp_active && t0 <= w_last_pos &&
                          (p.sliding_window <= 0 || t0 + C::kBC - 1 > w_first_pos - p.sliding_window);
    if (in_range) {
      const MT* sK = C::kFp8 ? sConv : reinterpret_cast<const MT*>(stage);
      const MT* sV = sK + C::kBC * C::kRow;
      float s[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t a[4];
        if constexpr (kQInRegs) {
          a[0] = qf[kk][0]; a[1] = qf[kk][1]; a[2] = qf[kk][2]; a[3] = qf[kk][3];
        } else {
          ldmatrix_x4(a, sQw + a_row * C::kRow + kk * 16 + a_col);
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, sK + (np * 16 + b_row) * C::kRow + kk * 16 + b_col);
          mma_16816<MT>(s[2 * np], a, b[0], b[1]);
          mma_16816<MT>(s[2 * np + 1], a, b[2], b[3]);
        }
      }

      const bool need_mask = t0 + C::kBC - 1 > w_first_pos ||
                             (p.sliding_window > 0 && t0 <= w_last_pos - p.sliding_window);
      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = score_log2(s[j][e], sc, sc_log2, p.soft_cap);
          if (need_mask) {
            const int key = t0 + 8 * j + 2 * t + (e & 1);
            const int rp = rpos[e >> 1];
            const bool ok = key <= rp && (p.sliding_window <= 0 || key > rp - p.sliding_window);
            if (!ok) v = neg_inf();
          }
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
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][e] = exp2f(s[j][e] - base[e >> 1]);
          l[e >> 1] += s[j][e];
        }

#pragma unroll
      for (int kk = 0; kk < C::kBC / 16; ++kk) {
        using MTT = TypeTraits<MT>;
        uint32_t pa[4];
        pa[0] = MTT::pack(s[2 * kk][0], s[2 * kk][1]);
        pa[1] = MTT::pack(s[2 * kk][2], s[2 * kk][3]);
        pa[2] = MTT::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[3] = MTT::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int np = 0; np < D / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, sV + (kk * 16 + v_row) * C::kRow + np * 16 + v_col);
          mma_16816<MT>(acc[2 * np], pa, b[0], b[1]);
          mma_16816<MT>(acc[2 * np + 1], pa, b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  // ---- normalise and write this warp's rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int R = wrow0 + g + 8 * r;
    if (R >= total_rows) continue;
    const float inv = l[r] > 0.f ? out_scale / l[r] : 0.f;  // out_scale: 1, or an FP8 cache's v_scale
    const int i = R / G, j = R % G;
    T* dst = static_cast<T*>(p.out) + ((static_cast<int64_t>(qs) + i) * p.num_heads + kv_head * G + j) * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t*>(dst + 8 * n + 2 * t) = TT::pack(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
  }
}

template <typename T, int D, int W = 4, int NS = 2, int KV = 0>
void launch_prefill_typed(const AttnParams& p, cudaStream_t stream) {
  using C = PrefillCfg<T, D, W, NS, KV>;
  auto kernel = paged_prefill_mma_kernel<T, D, W, NS, KV>;
  static std::atomic<uint64_t> smem_raised{0};
  set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), C::kSmemBytes, smem_raised);
  const int64_t tiles = (static_cast<int64_t>(p.num_rows) * p.group + C::kRows - 1) / C::kRows + p.num_seqs;
  dim3 grid(static_cast<unsigned>(tiles), p.num_kv_heads);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
  PAGEDLLM_CUDA_CHECK_LAUNCH();
}

template <typename T, int KV = 0>
void launch_prefill_dtype(int head_size, const AttnParams& p, cudaStream_t stream) {
  switch (head_size) {
    case 32: return launch_prefill_typed<T, 32, 4, 2, KV>(p, stream);
    case 64: return launch_prefill_typed<T, 64, 4, 2, KV>(p, stream);
    case 80: return launch_prefill_typed<T, 80, 4, 2, KV>(p, stream);
    case 96: return launch_prefill_typed<T, 96, 4, 2, KV>(p, stream);
    // d128: 8 warps (128 query rows per CTA, half the K/V re-reads from L2): 11% faster than 4
    // warps at 4,096 tokens on the H200 (run 1); a 3-stage ring gained nothing (run 2).
    case 128: return launch_prefill_typed<T, 128, 8, 2, KV>(p, stream);
    case 256:
      if constexpr (KV == 0) return launch_prefill_typed<T, 256>(p, stream);
      [[fallthrough]];
    default: throw std::runtime_error("CUDA prefill: unsupported head size " + std::to_string(head_size));
  }
}

template <typename T>
void launch_prefill_cache(int head_size, const AttnParams& p, cudaStream_t stream) {
  if (p.kv_fp8 == 1) return launch_prefill_dtype<T, 1>(head_size, p, stream);
  if (p.kv_fp8 == 2) return launch_prefill_dtype<T, 2>(head_size, p, stream);
  return launch_prefill_dtype<T>(head_size, p, stream);
}

}  // namespace

void launch_prefill_mma(DType dtype, int head_size, const AttnParams& p, cudaStream_t stream) {
  if (dtype == DType::kBFloat16) return launch_prefill_cache<__nv_bfloat16>(head_size, p, stream);
  if (dtype == DType::kFloat16) return launch_prefill_cache<__half>(head_size, p, stream);
  throw std::runtime_error(std::string("CUDA prefill (tensor cores): unsupported dtype ") + dtype_name(dtype));
}

}  // namespace pagedllm::cuda::detail
