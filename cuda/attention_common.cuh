// cuda/attention_common.cuh — internal device helpers shared by the CUDA attention kernels:
// dtype traits, cp.async (sm_80+ asynchronous global->shared copies), ldmatrix and the
// mma.sync m16n8k16 tensor-core instruction (PTX ISA, "Warp-level matrix multiply-accumulate"),
// and the parameter block every attention kernel takes.
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
};

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

constexpr float kLog2e = 1.4426950408889634f;

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
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
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

/// Offset (elements) of the row holding position `pos` of a sequence for KV head `kv_head`.
__device__ __forceinline__ int64_t kv_row_offset(const int32_t* block_table, int pos, int kv_head,
                                                 const AttnParams& p, int head_size) {
  const int64_t block = block_table[pos >> p.block_shift];
  const int row = pos & (p.block_size - 1);
  return ((block * p.num_kv_heads + kv_head) * p.block_size + row) * static_cast<int64_t>(head_size);
}

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

}  // namespace pagedllm::cuda::detail
