// cuda/attention_common.cuh — internal device helpers shared by the CUDA attention kernels:
// dtype traits, cp.async (sm_80+ asynchronous global->shared copies), ldmatrix and the
// mma.sync m16n8k16 tensor-core instruction (PTX ISA, "Warp-level matrix multiply-accumulate"),
// TMA 2-D tensor copies on mbarriers (sm_90), the warp-tile steps of the decode kernels (Q K^T,
// online softmax, P V on one 16-row m16n8k16 tile), and the parameter block every attention
// kernel takes.
//
// Fragment layouts used throughout (PTX ISA, m16n8k16 with .bf16/.f16 operands, f32 accumulate);
// g = lane / 4 ("group"), t = lane % 4 ("thread in group"):
//   A 16x16 (row-major): a0 = (row g,   cols 2t..2t+1)   a1 = (row g+8, cols 2t..2t+1)
//                        a2 = (row g,   cols 2t+8..+9)   a3 = (row g+8, cols 2t+8..+9)
//   B 16x8  (k x n):     b0 = (k 2t..2t+1, col g)        b1 = (k 2t+8..2t+9, col g)
//   C 16x8  (f32):       c0,c1 = (row g, cols 2t, 2t+1)  c2,c3 = (row g+8, cols 2t, 2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace pagedllm::cuda::detail {

/// Everything an attention kernel needs, by value (raw device pointers; sizes in elements).
struct AttnParams {
  void* out = nullptr;                       // [rows, Hq, D]
  const void* query = nullptr;               // [rows, Hq, D]
  const void* key_cache = nullptr;           // [num_blocks, Hkv, block_size, D]
  const void* value_cache = nullptr;         // same
  const int32_t* block_tables = nullptr;     // [B, max_blocks_per_seq]
  const int32_t* seq_lens = nullptr;         // [B]
  const int32_t* query_start_loc = nullptr;  // [B+1]; nullptr for decode (one row per sequence)
  int num_seqs = 0;                          // B
  int num_rows = 0;                          // T (prefill) or B (decode)
  int num_heads = 0;                         // Hq
  int num_kv_heads = 0;                      // Hkv
  int group = 1;                             // Hq / Hkv
  int block_size = 16;                       // power of two
  int block_shift = 4;                       // log2(block_size)
  int max_blocks_per_seq = 0;                // M
  float scale_log2 = 0.f;                    // softmax scale * log2(e)  (no soft-cap)
  float scale = 0.f;                         // softmax scale
  float soft_cap = 0.f;                      // 0 = off
  int sliding_window = 0;                    // 0 = off
  // Decode split-K (flash-decoding): partition p covers positions [p*partition_tokens, ...).
  int num_splits = 1;
  int partition_tokens = 0;
  float* partial_out = nullptr;              // [B, Hq, num_splits, D], normalised per partition
  float* partial_max = nullptr;              // [B, Hq, num_splits], log2 domain (-inf: empty)
  float* partial_sum = nullptr;              // [B, Hq, num_splits]
  // Rows of the cache viewed as [rows, head_size] (num_blocks * Hkv * block_size), for TMA maps.
  int64_t cache_rows = 0;
  // Decode v2 only. even_splits: partition each sequence's own context (its window, when one is
  // set) into num_splits partitions of equal whole 16-token tiles, instead of fixed partitions of
  // partition_tokens (which follow the block-table width); partition_tokens is then unused.
  int even_splits = 0;
  // Decode v2 only, num_splits > 1: when set, the partitions of a (sequence, KV head, head chunk)
  // group are combined inside the decode kernel by the last one to finish (arrival counter
  // split_counters[group index = item / num_splits], zero on entry and reset to zero by that last arriver), and
  // no reduction kernel runs. nullptr: the partials are left for launch_splitk_reduce.
  int* split_counters = nullptr;
  // Decode v2 only (AttentionOptions::early_context_loads): tiles wholly before each sequence's
  // last token may be loaded before pdl_wait.
  int early_context_loads = 0;
  // FP8 caches (decode v2 and prefill): 1 = float8_e4m3fn, 2 = float8_e5m2 (0: the query's dtype).
  // The kernels read the codes as float16 tiles (mma in float16), multiply the softmax scale by
  // *k_scale and the output by *v_scale (nullptr: 1.0), read on the device at run time.
  int kv_fp8 = 0;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
};

/// The softmax scales and the output factor of a kernel over a cache of FP8 kind KV (0: none): an
/// FP8 cache's *k_scale joins the softmax scale and *v_scale the output (read from the device:
/// call after the kernel's pdl_wait, as a previous kernel may have written them).
struct KernelScales {
  float scale, scale_log2, out;
};
template <int KV>
__device__ __forceinline__ KernelScales kernel_scales(const AttnParams& p) {
  if constexpr (KV == 0) {
    return {p.scale, p.scale_log2, 1.f};
  } else {
    const float ks = p.k_scale == nullptr ? 1.f : __ldg(p.k_scale);
    return {p.scale * ks, p.scale_log2 * ks, p.v_scale == nullptr ? 1.f : __ldg(p.v_scale)};
  }
}

/// atom.add with acquire-release semantics at GPU scope (PTX ISA, "Memory Consistency Model"):
/// returns the old value. After a CTA (or warp) barrier, one thread's release covers the stores
/// of every thread before the barrier (cumulativity); its acquire covers the loads that other
/// threads make after a barrier that follows it (so the caller must place one there).
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* addr, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(addr), "r"(v) : "memory");
  return old;
}

template <typename T>
struct TypeTraits;
template <>
struct TypeTraits<__nv_bfloat16> {
  static constexpr bool kIsBF16 = true;
  __device__ static uint32_t pack(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }
};
template <>
struct TypeTraits<__half> {
  static constexpr bool kIsBF16 = false;
  __device__ static uint32_t pack(float a, float b) {
    __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ static float to_float(__half v) { return __half2float(v); }
  __device__ static __half from_float(float v) { return __float2half(v); }
};

/// A query element pair (2 x bf16 or fp16 in one register) as the pair of MT (the mma operand type:
/// float16 for FP8 caches), through float.
template <typename T, typename MT>
__device__ __forceinline__ uint32_t to_mma_pair(uint32_t v) {
  if constexpr (std::is_same_v<T, MT>) {
    return v;
  } else {
    const T* x = reinterpret_cast<const T*>(&v);
    return TypeTraits<MT>::pack(TypeTraits<T>::to_float(x[0]), TypeTraits<T>::to_float(x[1]));
  }
}

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

/// tanh(x) = 1 - 2 / (e^{2x} + 1) through ex2.approx (relative error ~2^-22). Under
/// --use_fast_math, tanhf becomes tanh.approx.f32 (~2^-11), too coarse for float32 caches.
__device__ __forceinline__ float tanh_accurate(float x) {
  const float e = exp2f(2.f * kLog2e * x);  // inf for large x -> 1, 0 for very negative x -> -1
  return 1.f - 2.f / (e + 1.f);
}

/// The attention score of a raw q.k in the log2 domain (scale, optional soft-cap applied).
__device__ __forceinline__ float score_log2(float qk, float scale, float scale_log2, float soft_cap) {
  if (soft_cap > 0.f) return soft_cap * tanh_accurate(qk * scale / soft_cap) * kLog2e;
  return qk * scale_log2;
}

/// Offset (elements) of the row holding position `pos` of a sequence for KV head `kv_head`.
__device__ __forceinline__ int64_t kv_row_offset(const int32_t* block_table, int pos, int kv_head,
                                                 const AttnParams& p, int head_size) {
  const int64_t block = block_table[pos >> p.block_shift];
  const int row = pos & (p.block_size - 1);
  return ((block * p.num_kv_heads + kv_head) * p.block_size + row) * static_cast<int64_t>(head_size);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// 16-byte asynchronous copy global -> shared (L2 only, .cg); when !valid nothing is read and
/// zeros are written. kPrefetch: L2 prefetch size hint in bytes (0, 128 or 256) for the line
/// around the address — the K/V tiles are contiguous runs of block_size * head_size elements.
template <int kPrefetch = 128>
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_size = valid ? 16 : 0;
  if constexpr (kPrefetch == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
                 "l"(gmem), "r"(src_size));
  } else if constexpr (kPrefetch == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
                 "l"(gmem), "r"(src_size));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(src_size));
  }
}
// ---- Hopper bulk tensor copies (TMA) completing on an mbarrier (sm_90; no-ops elsewhere).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PAGEDLLM_HAS_TMA 1
#else
#define PAGEDLLM_HAS_TMA 0
#endif

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
#if PAGEDLLM_HAS_TMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}
/// Make mbarrier initialisation visible to the async proxy (the copy engine).
__device__ __forceinline__ void mbarrier_init_fence() {
#if PAGEDLLM_HAS_TMA
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
/// Order this thread's earlier generic-proxy shared-memory accesses before later async-proxy ones.
__device__ __forceinline__ void fence_proxy_async() {
#if PAGEDLLM_HAS_TMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
/// One arrival that also expects `bytes` of transactions in the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if PAGEDLLM_HAS_TMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}
/// Spin until the phase with the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#if PAGEDLLM_HAS_TMA
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
#endif
}
/// 2-D tiled tensor copy global -> shared of the box at coordinates (x, y) (x = innermost) of the
/// tensor map at generic address `tmap` (a __grid_constant__ kernel parameter); completion is
/// counted on `bar` in bytes.
__device__ __forceinline__ void tma_load_2d(void* smem, const void* tmap, int x, int y, uint64_t* bar) {
#if PAGEDLLM_HAS_TMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_addr(smem)),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(x), "r"(y), "r"(smem_addr(bar))
      : "memory");
#endif
}

/// Copy the K and V cache rows of positions t0 .. t0+kRows-1 of one sequence (block table `bt`)
/// for `kv_head` into shared-memory tiles sK / sV (row stride kStride elements) with 16-byte
/// cp.async, by kThreads threads (this one is `tid`); positions >= end are zero-filled.
template <typename T, int D, int kRows, int kStride, int kThreads>
__device__ __forceinline__ void cp_async_kv_rows(T* sK, T* sV, const T* kc, const T* vc, const int32_t* bt,
                                                 int t0, int end, int kv_head, const AttnParams& p, int tid) {
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int c = tid; c < kRows * kChunks; c += kThreads) {
    const int r = c / kChunks, col = c % kChunks;
    const int pos = t0 + r;
    const bool valid = pos < end;
    const int64_t off = valid ? kv_row_offset(bt, pos, kv_head, p, D) + col * 8 : 0;
    cp_async_16(sK + r * kStride + col * 8, kc + off, valid);
    cp_async_16(sV + r * kStride + col * 8, vc + off, valid);
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

/// c += a * b, m16n8k16, f32 accumulators, bf16 or fp16 operands.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (TypeTraits<T>::kIsBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// ---- Warp-level building blocks of the tensor-core kernels (decode and prefill). Each warp owns
// a 16-row m16n8k16 tile of queries; "rows g and g+8" below are this thread's two rows.

/// S += Q K^T over the head dimension for NT n8 tiles of keys: `q_frag(kk, a)` fills the A fragment
/// of head-dim step kk (16 columns), `k_addr(kk, np)` gives this lane's ldmatrix address of the K
/// rows of key tiles 2np, 2np+1 at that step.
template <typename T, int KSTEPS, int NT, typename QFrag, typename KAddr>
__device__ __forceinline__ void mma_qk(float (&s)[NT][4], QFrag&& q_frag, KAddr&& k_addr) {
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    uint32_t a[4];
    q_frag(kk, a);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, k_addr(kk, np));
      mma_16816<T>(s[2 * np], a, b[0], b[1]);
      mma_16816<T>(s[2 * np + 1], a, b[2], b[3]);
    }
  }
}

/// One online-softmax step (FlashAttention-2, Dao 2023, algorithm 1): `s` holds NT n8 tiles of
/// scores in the log2 domain (masked entries -inf). Updates the running row max `m` and sum `l`,
/// rescales the accumulators `acc`, and replaces `s` by the probabilities 2^(s - max). A row with
/// no unmasked score so far keeps max -inf and uses base 0, so it stays all-zero without NaN.
/// Lazy rescaling (exact): when no row max of the warp grew, every factor is exactly 1 (2^0), so
/// the warp skips the multiplies (a warp vote keeps the branch uniform); past the first tiles of a
/// long context that is most tiles.
template <int NT, int NACC>
__device__ __forceinline__ void online_softmax_update(float (&s)[NT][4], float (&m)[2], float (&l)[2],
                                                      float (&acc)[NACC][4]) {
  float mx[2] = {m[0], m[1]};
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
  float base[2], corr[2];
  bool grew = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    base[r] = mx[r] == neg_inf() ? 0.f : mx[r];
    corr[r] = exp2f(m[r] - base[r]);
    grew = grew || mx[r] != m[r];
    m[r] = mx[r];
  }
  if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] *= corr[r];
#pragma unroll
      for (int n = 0; n < NACC; ++n) {
        acc[n][2 * r] *= corr[r];
        acc[n][2 * r + 1] *= corr[r];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[j][e] = exp2f(s[j][e] - base[e >> 1]);
      l[e >> 1] += s[j][e];
    }
}

/// O += P V for the 16 keys of probability tiles 2kk, 2kk+1: P becomes the A operand, V rows come
/// through ldmatrix.trans; `v_addr(np)` gives this lane's address for head-dim columns 16np..+15.
template <typename T, int D, int NT, typename VAddr>
__device__ __forceinline__ void mma_pv(float (&acc)[D / 8][4], const float (&s)[NT][4], int kk, VAddr&& v_addr) {
  using TT = TypeTraits<T>;
  uint32_t pa[4];
  pa[0] = TT::pack(s[2 * kk][0], s[2 * kk][1]);
  pa[1] = TT::pack(s[2 * kk][2], s[2 * kk][3]);
  pa[2] = TT::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  pa[3] = TT::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
  for (int np = 0; np < D / 16; ++np) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, v_addr(np));
    mma_16816<T>(acc[2 * np], pa, b[0], b[1]);
    mma_16816<T>(acc[2 * np + 1], pa, b[2], b[3]);
  }
}

/// The full row sums of this thread's two rows (the 4 threads of a row group hold parts).
__device__ __forceinline__ void row_sums(float (&l)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
}


}  // namespace pagedllm::cuda::detail
