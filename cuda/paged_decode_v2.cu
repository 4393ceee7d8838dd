// cuda/paged_decode_v2.cu — decode paged attention on tensor cores (bf16 / fp16, head sizes up
// to 128) with persistent work items owned by teams of 1, 2 or 4 warps.
//
// A work item is (sequence, KV head, up to 16 query heads of its group, partition of the
// context); the group's query heads are the 16 rows of an m16n8k16 A operand, so each
// (block, KV head) tile is read once for all of them. Unlike the CTA-per-item kernel
// (paged_decode.cu), the grid is sized to the device's occupancy and each team of WPI warps
// takes items first, first + T, first + 2T, ... (T = teams in the grid). Every warp streams its
// share of the item's 16-token tiles (tiles w, w + WPI, ...) through a private ring that runs on
// across item boundaries — the tiles of the next item are already in flight while the current
// one finishes — so the memory pipe never drains between items. Q goes straight from global
// memory into the A fragments. Each item ends with an online-softmax state (FlashAttention-2,
// Dao 2023); with WPI > 1 the team merges its warps' states in shared memory (one barrier pair
// per item). The result is written as the output row (one partition) or as flash-decoding
// partials (Dao et al. 2023) that launch_splitk_reduce combines, or that the last partition of
// each group to finish combines in this kernel (p.split_counters; see combine_splits). WPI = 1
// needs no barrier across warps (only __syncwarp around the split-K arrival) and suits many
// items; larger teams finish an item sooner and so need fewer partitions (no
// reduction at 64 x 4,096 with pairs; fewer partials at batch 1 with whole CTAs). Partitions
// either follow the block-table width (partition_tokens) or split each sequence's own context
// into equal whole tiles (even_splits, the default for this kernel).
//
// Tile loads (template LOAD): kLoadTma (head size 128 on sm_90, the default there): a tile that
// lies whole in one block arrives as 2-D TMA boxes (cp.async.bulk.tensor; 64 columns x 16 rows,
// 128-byte swizzle, no padding) issued by one lane and completing on the ring slot's mbarrier;
// other tiles (block edges, the sequence's last tile) go by cp.async into the same swizzled
// layout. kLoadCpAsync: 16-byte cp.async per lane into padded rows (other head sizes, other GPUs,
// or PAGEDLLM_DECODE_TMA=0). TMA was 3% faster at 64 x 4,096 on the H200 (run 4, notes).
#include <cuda.h>  // CUtensorMap and its enums (types only; the encoder is fetched at run time)

#include <cstdlib>
#include <string>

#include "fp8_kv.cuh"
#include "launch_utils.cuh"

namespace pagedllm::cuda::detail {
namespace {

enum LoadKind : int { kLoadCpAsync = 0, kLoadTma = 1 };

/// The K and V caches viewed as [cache_rows, head_size] 2-D tensors (kLoadTma; unused otherwise).
struct TmaMaps {
  CUtensorMap k;
  CUtensorMap v;
};

template <typename T, int D, int W, int NS, int LOAD, int KV = 0>
struct DecodeV2Cfg {
  static constexpr int kWarps = W;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTile = 16;
  static constexpr int kStages = NS;
  static constexpr bool kSwizzled = LOAD == kLoadTma;
  static constexpr bool kFp8 = KV != 0;  // FP8 cache: ring rows of codes (fp8_fragments below)
  static constexpr int kRow = D + 8;  // padded layout (16-bit elements): 16-byte pad, conflict-free ldmatrix
  static constexpr int kElem = kFp8 ? 1 : int(sizeof(T));              // bytes of a cache element
  static constexpr int kRowBytes = kFp8 ? D + 16 : kRow * int(sizeof(T));  // a padded ring row
  static constexpr int kChunkElems = 16 / kElem;                         // elements per 16-byte copy
  static constexpr int kChunks = D / kChunkElems;
  static constexpr int kBoxes = D / 64;  // swizzled layout: 64-column boxes of 16 rows x 128 B
  static constexpr int kStageBytes = kSwizzled ? 2 * kBoxes * 2048 : 2 * kTile * kRowBytes;
  static constexpr int kWarpBytes = kStages * kStageBytes;
  static constexpr size_t kSmemBytes =
      kWarps * kWarpBytes + (kSwizzled ? 1024 + kWarps * kStages * sizeof(uint64_t) : 0);
  // Items shared by several warps: the warps' softmax states are merged through [kWarps][16]
  // maxima, [kWarps][16] sums and [kWarps][rows][D] accumulators (rows = min(16, group)) after
  // the rings and barriers.
  static constexpr size_t kMergeOffset = kWarps * kWarpBytes + (kSwizzled ? kWarps * kStages * sizeof(uint64_t) : 0);
  static constexpr size_t merge_bytes(int rows) { return (kWarps * 32 + size_t(kWarps) * rows * D) * sizeof(float); }
  static_assert(!kSwizzled || D % 64 == 0, "TMA boxes need head_size % 64 == 0");
  static_assert(!kSwizzled || !kFp8, "FP8 caches load by cp.async");
};

struct DecodeItem {
  int seq, kv_head, h0, nrows, split, start, end, ntiles, seq_len;
  int group;  // (sequence, KV head, head chunk) index: the item's split-K arrival counter
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
  it.group = (it.seq * p.num_kv_heads + it.kv_head) * head_chunks + hc;
  it.h0 = it.kv_head * p.group + hc * 16;
  it.nrows = min(16, p.group - hc * 16);
  const int seq_len = p.seq_lens[it.seq];
  int start = p.sliding_window > 0 ? max(0, seq_len - p.sliding_window) : 0;
  int end = seq_len;
  if (splits > 1) {
    if (p.even_splits) {  // equal whole tiles of this sequence's own range [start, seq_len)
      const int lo = start & ~15;
      const int per = ((end - lo + 15) / 16 + splits - 1) / splits * 16;
      const int s0 = lo + it.split * per;
      start = max(start, s0);
      end = min(end, s0 + per);
    } else {
      start = max(start, it.split * p.partition_tokens);
      end = min(end, (it.split + 1) * p.partition_tokens);
    }
  }
  it.start = start;
  it.end = end;
  it.seq_len = seq_len;
  it.ntiles = end > start ? (end - start + 15) / 16 : 0;
  it.bt = p.block_tables + static_cast<int64_t>(it.seq) * p.max_blocks_per_seq;
  return it;
}

/// combine_splits' last step: the weighted sum `o` of 4 output columns divided by the total weight
/// `total` (0 when every partition was empty: the row is written as zeros), rounded to T and stored
/// as one 8-byte store at `dst` (4 elements of T, 8-byte aligned).
template <typename T>
__device__ __forceinline__ void store_combined(T* dst, const float4& o, float total) {
  const float inv = total > 0.f ? 1.f / total : 0.f;
  *reinterpret_cast<uint2*>(dst) =
      make_uint2(TypeTraits<T>::pack(o.x * inv, o.y * inv), TypeTraits<T>::pack(o.z * inv, o.w * inv));
}

// In-kernel split-K combine (p.split_counters set, num_splits > 1), the last-arriver pattern of
// the CUDA samples' threadFenceReduction: every team writes its partition's partials, then (after
// the team's barrier, which orders those stores before it) one thread adds one to its group's
// arrival counter with an acquire-release atomic at GPU scope (as CUTLASS's GenericBarrier; it
// measured faster than a __threadfence in every thread, bench/cuda_kernels_notes.md run 8); the team that
// sees num_splits - 1 is the last, reads all the group's partials from L2 (ld.global.cg: never a stale
// L1 line), combines them with launch_splitk_reduce's formula and resets the counter to zero for the
// next launch. The partials go in chunks of kChunk partitions, every load of a chunk issued before
// any use (one L2 round trip per chunk; a chunk of 16 raised the kernel to 255 registers), merged
// across chunks as online-softmax states (FlashAttention-2's rescaling by exp2(old max - new max)).
// The order of partitions is fixed, so the result does not depend on which team came last; the
// reduction kernel sums the weights in another order, so the two are not bitwise equal.
// `tid` / `nthreads`: this thread's index within the team and the team's size.
template <typename T, int D>
__device__ __forceinline__ void combine_splits(const AttnParams& p, const DecodeItem& it, int tid, int nthreads) {
  constexpr int kCols = D / 4;  // float4 columns
  constexpr int kChunk = 8;     // partitions per L2 round trip
  const int S = p.num_splits;
  const int64_t row0 = static_cast<int64_t>(it.seq) * p.num_heads + it.h0;
  for (int idx = tid; idx < it.nrows * kCols; idx += nthreads) {
    const int r = idx / kCols, c = idx % kCols;
    const int64_t prow = (row0 + r) * S;
    float mmax = neg_inf(), total = 0.f;  // running maximum, and the weights' sum relative to it
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < S; s0 += kChunk) {
      float pm[kChunk], ps[kChunk];
      float4 pv[kChunk];
#pragma unroll
      for (int s = 0; s < kChunk; ++s) {
        if (s0 + s < S) {
          pm[s] = __ldcg(p.partial_max + prow + s0 + s);
          ps[s] = __ldcg(p.partial_sum + prow + s0 + s);
          pv[s] = __ldcg(reinterpret_cast<const float4*>(p.partial_out + (prow + s0 + s) * D) + c);
        }
      }
      float cmax = mmax;
#pragma unroll
      for (int s = 0; s < kChunk; ++s)
        if (s0 + s < S) cmax = fmaxf(cmax, pm[s]);
      if (cmax == neg_inf()) continue;  // every partition so far empty: nothing to add
      // The state so far, rescaled to the new maximum (0 while it is empty: mmax = -inf).
      const float f = exp2f(mmax - cmax);
      total *= f;
      o.x *= f;
      o.y *= f;
      o.z *= f;
      o.w *= f;
      mmax = cmax;
#pragma unroll
      for (int s = 0; s < kChunk; ++s) {
        if (s0 + s < S) {
          const float w = ps[s] * exp2f(pm[s] - cmax);
          total += w;
          o.x += w * pv[s].x;
          o.y += w * pv[s].y;
          o.z += w * pv[s].z;
          o.w += w * pv[s].w;
        }
      }
    }
    store_combined(static_cast<T*>(p.out) + (row0 + r) * D + 4 * c, o, total);
  }
}

/// f(d, a, b) for the pairs of adjacent output dims (d, d + 1) that this lane's accumulator holds
/// for its row r (0: row g, 1: row g + 8): tile n's columns 2t, 2t + 1 = dims 8n + 2t, + 1, or
/// with an FP8 cache (fp8_pv's tiles 2c + o = dims 16c + 2g + o) the columns j = 2t, 2t + 1 of
/// tiles 2c and 2c + 1 = dims 16c + 2j and 16c + 2j + 1.
template <bool kFp8, int D, typename F>
__device__ __forceinline__ void acc_pairs(const float (&acc)[D / 8][4], int r, F&& f) {
  const int t = (threadIdx.x % 32) % 4;
  if constexpr (kFp8) {
#pragma unroll
    for (int c = 0; c < D / 16; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e) f(16 * c + 4 * t + 2 * e, acc[2 * c][2 * r + e], acc[2 * c + 1][2 * r + e]);
  } else {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) f(8 * n + 2 * t, acc[n][2 * r], acc[n][2 * r + 1]);
  }
}

/// WPI warps per work item. WPI == 1: a work item per warp (items first, first + W, ... for W
/// warps in the grid). WPI > 1 (2, or W_ for a whole CTA): the CTA's warps form W_ / WPI teams,
/// team j of CTA b takes items b * (W_ / WPI) + j, + gridDim.x * (W_ / WPI), ...; warp w of a team
/// takes the item's tiles w, w + WPI, ... through its own ring, and the team's states are merged
/// in shared memory at the end of each item (a barrier pair of the team per item; no split-K
/// reduction needed for a single partition). merge_rows = min(16, group) (WPI > 1 only).
template <typename T, int D, int W_, int NS, int PF, int LOAD, int WPI, int KV>
__global__ void __launch_bounds__(32 * W_) paged_decode_v2_kernel(const AttnParams p, int num_items,
                                                                  int head_chunks, int merge_rows,
                                                                  const __grid_constant__ TmaMaps maps) {
  using C = DecodeV2Cfg<T, D, W_, NS, LOAD, KV>;
  // T: the query / output dtype. An FP8 cache (KV = 1 E4M3, 2 E5M2) is read as float16 tiles, so
  // the mma operands (MT) are float16; CT: the cache's element type.
  using MT = std::conditional_t<KV == 0, T, __half>;
  using CT = std::conditional_t<KV == 0, T, uint8_t>;
  constexpr int KSTEPS = D / 16;
  constexpr int S = C::kStages;
  constexpr bool kTma = LOAD == kLoadTma && PAGEDLLM_HAS_TMA;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Let a programmatic dependent (the split-K reduction) be scheduled now; it waits for this
  // grid's completion itself (pdl_wait). No-op without a dependent launch.
  pdl_launch_dependents();
  if constexpr (kTma) {
    if (threadIdx.x == 0) {  // fetch the two descriptors into the TMA unit's cache early
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.k)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.v)) : "memory");
    }
  }
  // Launched as a programmatic dependent (launch_pdl): the CTAs may be resident while the previous
  // kernel (the rotary / cache write) still runs. Every global read and write comes after pdl_wait
  // below, except with p.early_context_loads: then the item lookups (sequence lengths, block
  // tables) and the ring's first tiles that lie wholly before their sequence's last token — which
  // the previous kernels do not write — are issued before it.
  if (!p.early_context_loads) pdl_wait();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  unsigned char* smem = smem_raw;
  if constexpr (C::kSwizzled) {  // the 128-byte swizzle pattern repeats every 1024 bytes
    const uint32_t a = smem_addr(smem_raw);
    smem += ((a + 1023u) & ~1023u) - a;
  }
  unsigned char* ring = smem + warp * C::kWarpBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + C::kWarps * C::kWarpBytes) + warp * S;
  uint32_t tma_slots = 0, phases = 0;  // per ring slot: filled by TMA; parity to wait for next
  if constexpr (kTma) {
    if (lane < S) mbarrier_init(bars + lane, 1);
    mbarrier_init_fence();
    __syncwarp();
  }
  // Shared-memory address of row r, column c (the first of a 16-byte chunk) of the K (kv = 0) or
  // V (kv = 1) tile in ring slot `slot`, in cache elements.
  auto ring_at = [&](int slot, int kv, int r, int c) -> CT* {
    if constexpr (C::kSwizzled) {
      const int box = c / 64, chunk = (c % 64) / 8;
      return reinterpret_cast<CT*>(ring + slot * C::kStageBytes + (kv * C::kBoxes + box) * 2048 + r * 128 +
                                   ((chunk ^ (r & 7)) << 4));
    } else {
      return reinterpret_cast<CT*>(ring + slot * C::kStageBytes + (kv * C::kTile + r) * C::kRowBytes) + c;
    }
  };

  // Items first, first + istride, ...; within an item this warp takes tiles k0, k0 + kstep, ...
  static_assert(W_ % WPI == 0, "teams must divide the CTA");
  constexpr int kTeams = W_ / WPI;
  const int team = warp / WPI;
  const int istride = gridDim.x * kTeams;
  const int first = blockIdx.x * kTeams + team;
  const int k0 = warp % WPI;
  constexpr int kstep = WPI;
  const CT* kc = static_cast<const CT*>(p.key_cache);
  const CT* vc = static_cast<const CT*>(p.value_cache);

  // ---- issue cursor: the next (item, tile) whose K/V go into the ring
  int ii = first, ik = k0, slot_issue = 0;
  DecodeItem iitem{};
  if (ii < num_items) iitem = decode_item(p, ii, head_chunks);
  auto skip_exhausted = [&]() {
    while (ii < num_items && ik >= iitem.ntiles) {
      ii += istride;
      ik = k0;
      if (ii < num_items) iitem = decode_item(p, ii, head_chunks);
    }
  };
  skip_exhausted();
  auto issue_next = [&]() {
    if (ii < num_items) {
      const int t0 = iitem.start + ik * C::kTile;
      const int row0 = t0 & (p.block_size - 1);
      if (row0 + C::kTile <= p.block_size && t0 + C::kTile <= iitem.end) {
        // The whole tile lies in one block (the common case): one block-table lookup, and the
        // tile is one contiguous run of kTile rows.
        const int64_t off = kv_row_offset(iitem.bt, t0, iitem.kv_head, p, D);
        if constexpr (kTma) {
          uint64_t* bar = bars + slot_issue;
          fence_proxy_async();  // the slot was last read by ldmatrix (generic proxy)
          __syncwarp();
          if (lane == 0) {
            const int y = static_cast<int>(off / D);
            mbarrier_arrive_expect_tx(bar, C::kStageBytes);
#pragma unroll
            for (int b = 0; b < C::kBoxes; ++b) {
              tma_load_2d(ring_at(slot_issue, 0, 0, 64 * b), &maps.k, 64 * b, y, bar);
              tma_load_2d(ring_at(slot_issue, 1, 0, 64 * b), &maps.v, 64 * b, y, bar);
            }
          }
          tma_slots |= 1u << slot_issue;
        } else {
          const CT* kb = kc + off;
          const CT* vb = vc + off;
          constexpr int E = C::kChunkElems;
#pragma unroll
          for (int c = lane; c < C::kTile * C::kChunks; c += 32) {
            const int r = c / C::kChunks, col = c % C::kChunks;
            cp_async_16<PF>(ring_at(slot_issue, 0, r, col * E), kb + r * D + col * E, true);
            cp_async_16<PF>(ring_at(slot_issue, 1, r, col * E), vb + r * D + col * E, true);
          }
        }
      } else {
        if constexpr (kTma) tma_slots &= ~(1u << slot_issue);
#pragma unroll
        for (int c = lane; c < C::kTile * C::kChunks; c += 32) {
          const int r = c / C::kChunks, col = c % C::kChunks;
          const int pos = t0 + r;
          const bool valid = pos < iitem.end;
          const int64_t off = valid ? kv_row_offset(iitem.bt, pos, iitem.kv_head, p, D) + col * C::kChunkElems : 0;
          cp_async_16<PF>(ring_at(slot_issue, 0, r, col * C::kChunkElems), kc + off, valid);
          cp_async_16<PF>(ring_at(slot_issue, 1, r, col * C::kChunkElems), vc + off, valid);
        }
      }
      slot_issue = slot_issue + 1 == S ? 0 : slot_issue + 1;
      ik += kstep;
      skip_exhausted();
    }
    cp_async_commit();  // one group per call (possibly empty) keeps wait_group counting exact
  };

  // The ring's first S - 1 tiles; with early_context_loads those before the first tile that holds
  // its sequence's last token (written by the previous kernel) are requested before the wait.
  int issued = 0;
  if (p.early_context_loads) {
    auto next_is_early = [&]() {
      return ii < num_items && min(iitem.start + ik * C::kTile + C::kTile, iitem.end) < iitem.seq_len;
    };
    for (; issued < S - 1 && next_is_early(); ++issued) issue_next();
    pdl_wait();
  }
  for (; issued < S - 1; ++issued) issue_next();

  // ---- FP8 caches: mma fragments straight from the ring of codes (no float16 copy of the tile).
  // ldmatrix of a tile of codes read as 16-bit pairs gives lane (g, t), per 8 x 16-code matrix:
  //   K (non-trans): the codes of key g, dims 16c + 4t .. 4t+3 of 16-dim chunk c. The head dim is
  //     taken in that order on both sides of Q K^T (the query fragments too, as loaded above): k
  //     indices {2t, 2t+1} of an m16n8k16 step are dims 4t, 4t+1 (b0) and {2t+8, 2t+9} are 4t+2,
  //     4t+3 (b1) — a dot product does not depend on the order of its terms.
  //   V (trans): codes (keys 2t, 2t+1) x (dims 16c + 2g, 16c + 2g + 1); byte permutes split
  //     them into the (key 2t, key 2t+1) pairs of dim 2g (the B fragment of an "even" n8 tile) and
  //     of dim 2g + 1 ("odd"). So acc tile 2c + o holds the dims {16c + 2g + o}; acc_pairs walks
  //     the output in pairs of adjacent dims either way.
  // Each pair of codes becomes a float16 pair by a byte permute and, for E4M3, one cvt
  // (fp8_kv.cuh's codes_to_half2_exact).
  auto fp8_qk = [&](float(&s)[2][4], const uint32_t(&qf)[KSTEPS][4], int slot_) {
    const int key = (lane % 8) + 8 * ((lane / 8) % 2);  // this lane's ldmatrix row: matrices (keys 0-7 | 8-15)
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk += 2) {
      if (kk + 1 < KSTEPS) {  // x4: (keys 0-7, 8-15) x (k-steps kk, kk + 1)
        uint32_t r[4];
        ldmatrix_x4(r, ring_at(slot_, 0, key, 16 * (kk + lane / 16)));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint32_t a[4] = {qf[kk + i / 2][0], qf[kk + i / 2][1], qf[kk + i / 2][2], qf[kk + i / 2][3]};
          mma_16816<MT>(s[i % 2], a, fp8::codes_to_half2_exact<KV>(r[i], 0x1404), fp8::codes_to_half2_exact<KV>(r[i], 0x3424));
        }
      } else {  // x2: (keys 0-7, 8-15) x k-step kk (head size 80)
        uint32_t r[2];
        ldmatrix_x2(r, ring_at(slot_, 0, key, 16 * kk));
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          uint32_t a[4] = {qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]};
          mma_16816<MT>(s[i], a, fp8::codes_to_half2_exact<KV>(r[i], 0x1404), fp8::codes_to_half2_exact<KV>(r[i], 0x3424));
        }
      }
    }
  };
  auto fp8_pv = [&](float(&acc_)[D / 8][4], const float(&s)[2][4], int slot_) {
    uint32_t pa[4];
    pa[0] = TypeTraits<MT>::pack(s[0][0], s[0][1]);
    pa[1] = TypeTraits<MT>::pack(s[0][2], s[0][3]);
    pa[2] = TypeTraits<MT>::pack(s[1][0], s[1][1]);
    pa[3] = TypeTraits<MT>::pack(s[1][2], s[1][3]);
    const int key = (lane % 8) + 8 * ((lane / 8) % 2);
    // (keys 2t, 2t+1) x (dims 2g, 2g+1) of one chunk -> the (b0 or b1) of chunk tiles even, odd
    // bytes 0, 2 (dim 2g of keys 2t, 2t+1) and 1, 3 (dim 2g + 1)
    auto pv_chunk = [&](int c, uint32_t lo_keys, uint32_t hi_keys) {
      mma_16816<MT>(acc_[2 * c], pa, fp8::codes_to_half2_exact<KV>(lo_keys, 0x2404), fp8::codes_to_half2_exact<KV>(hi_keys, 0x2404));
      mma_16816<MT>(acc_[2 * c + 1], pa, fp8::codes_to_half2_exact<KV>(lo_keys, 0x3414),
                    fp8::codes_to_half2_exact<KV>(hi_keys, 0x3414));
    };
#pragma unroll
    for (int c = 0; c < D / 16; c += 2) {
      if (c + 1 < D / 16) {  // x4.trans: (keys 0-7, 8-15) x (chunks c, c + 1)
        uint32_t r[4];
        ldmatrix_x4_trans(r, ring_at(slot_, 1, key, 16 * (c + lane / 16)));
        pv_chunk(c, r[0], r[1]);
        pv_chunk(c + 1, r[2], r[3]);
      } else {  // x2.trans: chunk c alone (head size 80)
        uint32_t r[2];
        ldmatrix_x2_trans(r, ring_at(slot_, 1, key, 16 * c));
        pv_chunk(c, r[0], r[1]);
      }
    }
  };

  // An FP8 cache's scales (after pdl_wait above)
  const KernelScales scales = kernel_scales<KV>(p);
  const float sc = scales.scale, sc_log2 = scales.scale_log2, out_scale = scales.out;

  // Shared items: merge the team's (max, sum, accumulator) states of rows 0 .. nrows-1 (as
  // paged_decode.cu) and write the output or the partition's partials. Team barrier: the whole
  // CTA (WPI == W_) or named barrier 1 + team over the team's 32 * WPI threads.
  auto team_sync = [&]() {
    if constexpr (WPI == W_) {
      __syncthreads();
    } else {
      static_assert(WPI == 1 || W_ / WPI == 2, "named barriers 1 and 2: two teams per CTA");
      if (team == 0) asm volatile("bar.sync 1, %0;\n" ::"n"(32 * WPI) : "memory");
      else asm volatile("bar.sync 2, %0;\n" ::"n"(32 * WPI) : "memory");
    }
  };
  __shared__ int s_last_arriver[kTeams];  // WPI > 1: the team's arrival result, shared by the team

  auto merge_warps_and_store = [&](const DecodeItem& it, const float(&m)[2], const float(&l)[2],
                                   const float(&acc)[D / 8][4], int mrows) {
    float* s_m = reinterpret_cast<float*>(smem + C::kMergeOffset);  // [kWarps][16]
    float* s_l = s_m + C::kWarps * 16;                                // [kWarps][16]
    float* s_o = s_l + C::kWarps * 16;                                // [kWarps][mrows][D]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = g + 8 * r;
      if (row >= it.nrows) continue;
      float* o = s_o + (warp * mrows + row) * D;
      acc_pairs<C::kFp8, D>(acc, r, [&](int d, float a, float b) { *reinterpret_cast<float2*>(o + d) = make_float2(a, b); });
      if (t == 0) {
        s_m[warp * 16 + row] = m[r];
        s_l[warp * 16 + row] = l[r];
      }
    }
    team_sync();
    const int64_t row0 = static_cast<int64_t>(it.seq) * p.num_heads + it.h0;
    const int w0 = team * WPI;  // the team's first warp
    for (int idx = threadIdx.x - 32 * w0; idx < it.nrows * D; idx += 32 * WPI) {
      const int r = idx / D, d = idx % D;
      float mmax = neg_inf();
#pragma unroll
      for (int w = w0; w < w0 + WPI; ++w) mmax = fmaxf(mmax, s_m[w * 16 + r]);
      float lsum = 0.f, o = 0.f;
      if (mmax != neg_inf()) {
#pragma unroll
        for (int w = w0; w < w0 + WPI; ++w) {
          const float f = exp2f(s_m[w * 16 + r] - mmax);
          lsum += f * s_l[w * 16 + r];
          o += f * s_o[(w * mrows + r) * D + d];
        }
      }
      const int64_t row = row0 + r;
      if constexpr (KV != 0) o *= out_scale;  // an FP8 cache's v_scale (the partials carry it too)
      if (p.num_splits == 1) {
        static_cast<T*>(p.out)[row * D + d] = TypeTraits<T>::from_float(lsum > 0.f ? o / lsum : 0.f);
      } else {
        const int64_t prow = row * p.num_splits + it.split;
        p.partial_out[prow * D + d] = lsum > 0.f ? o / lsum : 0.f;
        if (d == 0) {
          p.partial_max[prow] = mmax;
          p.partial_sum[prow] = lsum;
        }
      }
    }
    if (p.num_splits > 1 && p.split_counters != nullptr) {
      const int tid = threadIdx.x - 32 * w0;
      int* counter = p.split_counters + it.group;
      team_sync();  // orders the team's partial stores before tid 0's release
      if (tid == 0) s_last_arriver[team] = atomic_add_acq_rel_gpu(counter, 1) == p.num_splits - 1;
      team_sync();  // the last team's reads come after the acquire; the merge buffers are reused next
      if (s_last_arriver[team]) {
        combine_splits<T, D>(p, it, tid, 32 * WPI);
        if (tid == 0) *counter = 0;
      }
      return;
    }
    team_sync();  // the merge buffers are reused by the next item
  };

  const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;  // K (non-trans)
  const int v_row = (lane % 8) + ((lane / 8) % 2) * 8, v_col = (lane / 16) * 8;   // V (trans)
  int slot = 0;

  for (int ci = first; ci < num_items; ci += istride) {
    const DecodeItem it = decode_item(p, ci, head_chunks);

    // Q rows h0 .. h0+nrows-1 straight into the A fragments (rows >= nrows are zero).
    uint32_t qf[KSTEPS][4];
    {
      const T* q = static_cast<const T*>(p.query) + (static_cast<int64_t>(it.seq) * p.num_heads + it.h0) * D;
      const bool lo = g < it.nrows, hi = g + 8 < it.nrows;
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        if constexpr (C::kFp8) {  // the head dim in fp8_qk's order: k {2t, 2t+1, 2t+8, 2t+9} = dims 4t .. 4t+3
          const int c0 = kk * 16 + 4 * t;
          const uint2 a = lo ? *reinterpret_cast<const uint2*>(q + g * D + c0) : make_uint2(0u, 0u);
          const uint2 b = hi ? *reinterpret_cast<const uint2*>(q + (g + 8) * D + c0) : make_uint2(0u, 0u);
          qf[kk][0] = to_mma_pair<T, MT>(a.x);
          qf[kk][1] = to_mma_pair<T, MT>(b.x);
          qf[kk][2] = to_mma_pair<T, MT>(a.y);
          qf[kk][3] = to_mma_pair<T, MT>(b.y);
        } else {
          const int c0 = kk * 16 + 2 * t;
          qf[kk][0] = lo ? *reinterpret_cast<const uint32_t*>(q + g * D + c0) : 0u;
          qf[kk][1] = hi ? *reinterpret_cast<const uint32_t*>(q + (g + 8) * D + c0) : 0u;
          qf[kk][2] = lo ? *reinterpret_cast<const uint32_t*>(q + g * D + c0 + 8) : 0u;
          qf[kk][3] = hi ? *reinterpret_cast<const uint32_t*>(q + (g + 8) * D + c0 + 8) : 0u;
        }
      }
    }

    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

    const int my_tiles = it.ntiles > k0 ? (it.ntiles - k0 + kstep - 1) / kstep : 0;
    for (int k = 0; k < my_tiles; ++k) {
      issue_next();
      cp_async_wait<S - 1>();
      if constexpr (kTma) {
        if (tma_slots & (1u << slot)) {
          mbarrier_wait(bars + slot, (phases >> slot) & 1u);
          phases ^= 1u << slot;
        }
      }
      __syncwarp();
      const int t0 = it.start + (k0 + k * kstep) * C::kTile;

      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      if constexpr (C::kFp8) {
        fp8_qk(s, qf, slot);
      } else {
        mma_qk<MT, KSTEPS, 2>(
            s,
            [&](int kk, uint32_t(&a)[4]) {
              a[0] = qf[kk][0]; a[1] = qf[kk][1]; a[2] = qf[kk][2]; a[3] = qf[kk][3];
            },
            [&](int kk, int) { return ring_at(slot, 0, b_row, kk * 16 + b_col); });
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = t0 + 8 * j + 2 * t + (e & 1);
          s[j][e] = pos < it.end ? score_log2(s[j][e], sc, sc_log2, p.soft_cap) : neg_inf();
        }
      online_softmax_update(s, m, l, acc);
      if constexpr (C::kFp8) fp8_pv(acc, s, slot);
      else mma_pv<MT, D>(acc, s, 0, [&](int np) { return ring_at(slot, 1, v_row, np * 16 + v_col); });
      slot = slot + 1 == S ? 0 : slot + 1;
      __syncwarp();
    }

    // ---- this item's rows: the output (one partition) or the flash-decoding partials
    row_sums(l);
    if constexpr (WPI > 1) {
      merge_warps_and_store(it, m, l, acc, merge_rows);
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        if (row >= it.nrows) continue;
        const float inv = l[r] > 0.f ? out_scale / l[r] : 0.f;  // out_scale: 1, or an FP8 cache's v_scale
        const int64_t grow = static_cast<int64_t>(it.seq) * p.num_heads + it.h0 + row;
        if (p.num_splits == 1) {
          T* dst = static_cast<T*>(p.out) + grow * D;
          acc_pairs<C::kFp8, D>(acc, r, [&](int d, float a, float b) {
            *reinterpret_cast<uint32_t*>(dst + d) = TypeTraits<T>::pack(a * inv, b * inv);
          });
        } else {
          const int64_t prow = grow * p.num_splits + it.split;
          float* dst = p.partial_out + prow * D;
          acc_pairs<C::kFp8, D>(acc, r, [&](int d, float a, float b) {
            *reinterpret_cast<float2*>(dst + d) = make_float2(a * inv, b * inv);
          });
          if (t == 0) {
            p.partial_max[prow] = m[r];
            p.partial_sum[prow] = l[r];
          }
        }
      }
      if (p.num_splits > 1 && p.split_counters != nullptr) {  // last-arriver combine, as above
        __syncwarp();  // orders the warp's partial stores before lane 0's release
        int* counter = p.split_counters + it.group;
        int last = 0;
        if (lane == 0) last = atomic_add_acq_rel_gpu(counter, 1) == p.num_splits - 1;
        if (__shfl_sync(0xffffffffu, last, 0)) {  // uniform: every lane takes lane 0's answer
          __syncwarp();  // orders the other lanes' reads after lane 0's acquire
          combine_splits<T, D>(p, it, lane, 32);
          if (lane == 0) *counter = 0;
        }
      }
    }
  }
  cp_async_wait<0>();
}

// ---- TMA descriptors (cuTensorMapEncodeTiled through the runtime's driver entry point, so the
// library needs no link against libcuda).
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
    PAGEDLLM_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &status));
#else
    PAGEDLLM_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &status));
#endif
    if (status != cudaDriverEntryPointSuccess || f == nullptr)
      throw std::runtime_error("CUDA decode: cuTensorMapEncodeTiled is not available from the driver");
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

/// [rows, D] view of a cache with 64-column x 16-row boxes and the 128-byte swizzle.
template <typename T, int D>
CUtensorMap cache_map(const void* cache, int64_t rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(D * sizeof(T))};
  const cuuint32_t box[2] = {64, 16};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUtensorMapDataType type =
      TypeTraits<T>::kIsBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encode_tiled()(&map, type, 2, const_cast<void*>(cache), dims, strides, box, elem_strides,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("CUDA decode: cuTensorMapEncodeTiled failed with code " + std::to_string(static_cast<int>(r)));
  return map;
}

/// One kernel configuration: W warps per CTA, an NS-deep ring per warp, L2 prefetch hint PF,
/// tile loads LOAD. With cp.async, 4 x 3 with the 128-byte hint won on the H200 in run 3 (270 us at
/// 64 x 4096 against 274-286 us for 2 x 6, 3 x 4, a 256-byte or no hint, and cp.async.bulk row
/// copies); 4 x 5 and cp.async without the zero-fill operand lost in run 4. With TMA tiles, 4 x 2
/// beat 4 x 3 in run 8d (253.5-253.8 against 255.7 us at 64 x 4,096; see bench/cuda_kernels_notes.md).
template <typename T, int D, int W = kDecodeV2Warps, int NS = 3, int PF = 128, int LOAD = kLoadCpAsync, int KV = 0>
struct V2 {
  using C = DecodeV2Cfg<T, D, W, NS, LOAD, KV>;
  static_assert(W == 4, "teams of 1, 2 and 4 warps are instantiated");
  template <int WPI>
  static constexpr auto kernel() { return paged_decode_v2_kernel<T, D, W, NS, PF, LOAD, WPI, KV>; }
  static constexpr size_t kMaxSmem = C::kSmemBytes + C::merge_bytes(16);

  static size_t smem_bytes(int wpi, int merge_rows) { return C::kSmemBytes + (wpi > 1 ? C::merge_bytes(merge_rows) : 0); }

  // f(kernel) for the instantiation of `wpi` warps per item (1, 2 or W).
  template <typename F>
  static auto with_kernel(int wpi, F&& f) {
    if (wpi == 1) return f(kernel<1>());
    if (wpi == 2) return f(kernel<2>());
    return f(kernel<W>());
  }

  // Raise the kernels' shared-memory limit once per device, to the largest size any takes.
  static void raise_smem() {
    static std::atomic<uint64_t> bits[3] = {};
    set_max_dynamic_smem(reinterpret_cast<const void*>(kernel<1>()), kMaxSmem, bits[0]);
    set_max_dynamic_smem(reinterpret_cast<const void*>(kernel<2>()), kMaxSmem, bits[1]);
    set_max_dynamic_smem(reinterpret_cast<const void*>(kernel<W>()), kMaxSmem, bits[2]);
  }

  // Concurrent work units: teams of `wpi` warps resident at once (the merge buffers of shared
  // items hold merge_rows = min(16, group) rows), cached per team size and row count.
  static int units(int wpi, int merge_rows) {
    static std::atomic<int> cached[3][17] = {};
    raise_smem();
    std::atomic<uint64_t> none{~uint64_t{0}};  // marks the limit as raised already
    const int r = wpi > 1 ? std::clamp(merge_rows, 1, 16) : 0;
    const int k = wpi == 1 ? 0 : wpi == 2 ? 1 : 2;
    const int ctas = with_kernel(wpi, [&](auto kern) {
      return resident_ctas(cached[k][r], kern, C::kThreads, smem_bytes(wpi, r), none);
    });
    return ctas * (W / wpi);
  }

  static void launch(const AttnParams& p, int wpi, cudaStream_t stream) {
    const int merge_rows = std::min(16, p.group);
    const int units_ = units(wpi, merge_rows);
    const int head_chunks = (p.group + 15) / 16;
    const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * head_chunks * p.num_splits;
    if (items > (int64_t{1} << 31) - 1)
      throw std::runtime_error("CUDA decode: too many work items (" + std::to_string(items) + ")");
    const int64_t teams = std::min<int64_t>(units_, items);
    const int per_cta = W / wpi;
    const unsigned ctas = static_cast<unsigned>((teams + per_cta - 1) / per_cta);
    TmaMaps maps{};
    if constexpr (LOAD == kLoadTma) {
      maps.k = cache_map<T, D>(p.key_cache, p.cache_rows);
      maps.v = cache_map<T, D>(p.value_cache, p.cache_rows);
    }
    std::atomic<uint64_t> none{~uint64_t{0}};
    const size_t smem = smem_bytes(wpi, merge_rows);
    with_kernel(wpi, [&](auto kern) {
      // PDL: with a persistent workspace (no free node between them) it saves ~0.6 us per decode
      // layer at batch 1 on the H200 (bench/gpu_engine_notes.md, session 10)
      launch_pdl(kern, ctas, C::kThreads, smem, stream, none, true, p, static_cast<int>(items), head_chunks,
                 merge_rows, maps);
    });
  }
};

/// TMA tile loads: on sm_90+, for caches of fewer than 2^31 rows (TMA coordinates are int32),
/// unless PAGEDLLM_DECODE_TMA=0 (read once). `p` == nullptr: the device alone decides.
bool use_tma(const AttnParams* p) {
  static const bool enabled = [] {
    const char* v = std::getenv("PAGEDLLM_DECODE_TMA");
    if (v != nullptr && std::string(v) == "0") return false;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
      return false;
    return major >= 9;
  }();
  return enabled && (p == nullptr || (p->cache_rows > 0 && p->cache_rows < (int64_t{1} << 31)));
}

/// PAGEDLLM_DECODE_FP8_STAGES (2, 3 or 4 = the default; read once).
int fp8_stages() {
  static const int n = [] {
    const char* v = std::getenv("PAGEDLLM_DECODE_FP8_STAGES");
    return v != nullptr && (std::string(v) == "2" || std::string(v) == "3") ? std::stoi(v) : 4;
  }();
  return n;
}

/// Calls f(V2<...>{}) with the configuration of (T, head_size, FP8 kind) and the parameters.
template <typename T, typename F>
auto with_config(int head_size, int kv_fp8, const AttnParams* p, F&& f) {
  // FP8 caches: cp.async rings 4 deep (a stage holds half the bytes of a 16-bit one);
  // PAGEDLLM_DECODE_FP8_STAGES=2 or 3 picks another depth for bf16 queries of head size 128 (A/B
  // runs: 2 was 2-3% faster at 64 x 4,096 on the H200, within the runs' spread; bench/
  // cuda_kernels_notes.md "FP8 KV cache").
  if (kv_fp8 == 1) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      if (head_size == 128 && fp8_stages() == 2) return f(V2<T, 128, kDecodeV2Warps, 2, 128, kLoadCpAsync, 1>{});
      if (head_size == 128 && fp8_stages() == 3) return f(V2<T, 128, kDecodeV2Warps, 3, 128, kLoadCpAsync, 1>{});
    }
    return dispatch_head_size<128>(head_size, "CUDA decode v2 (fp8)", [&](auto d) {
      return f(V2<T, decltype(d)::value, kDecodeV2Warps, 4, 128, kLoadCpAsync, 1>{});
    });
  }
  if (kv_fp8 == 2)
    return dispatch_head_size<128>(head_size, "CUDA decode v2 (fp8)", [&](auto d) {
      return f(V2<T, decltype(d)::value, kDecodeV2Warps, 4, 128, kLoadCpAsync, 2>{});
    });
  // 2-deep TMA rings: 0.8% faster than 3-deep at 64 x 4,096 and 1-2% at batch 1 (run 8d).
  if (head_size == 128 && use_tma(p)) return f(V2<T, 128, 4, 2, 128, kLoadTma>{});
  return dispatch_head_size<128>(head_size, "CUDA decode v2", [&](auto d) { return f(V2<T, decltype(d)::value>{}); });
}

}  // namespace

bool decode_v2_supports(DType dtype, int head_size) {
  return (dtype == DType::kBFloat16 || dtype == DType::kFloat16) && head_size <= 128;
}

int decode_v2_units(DType dtype, int head_size, int warps_per_item, int group, int kv_fp8) {
  return dispatch_mma_dtype(dtype, "CUDA decode v2", [&](auto tag) {
    using T = typename decltype(tag)::type;
    return with_config<T>(head_size, kv_fp8, nullptr,
                          [&](auto cfg) { return decltype(cfg)::units(warps_per_item, std::min(16, group)); });
  });
}

void launch_decode_v2(DType dtype, int head_size, const AttnParams& p, int warps_per_item, cudaStream_t stream) {
  dispatch_mma_dtype(dtype, "CUDA decode v2", [&](auto tag) {
    using T = typename decltype(tag)::type;
    with_config<T>(head_size, p.kv_fp8, &p, [&](auto cfg) { decltype(cfg)::launch(p, warps_per_item, stream); });
  });
}

}  // namespace pagedllm::cuda::detail
