// cuda/gemv.cu — GEMV for decode steps with few tokens (pagedllm/gemv.h):
// y [M, N] = x [M, K] @ W [N, K]^T (+ bias) (+ residual), M <= 8, where x is the input itself, or
// RMSNorm(h) of the input h, or SiLU(gate) * up of a fused gate_up input.
//
// Work split. A CTA owns a tile of 16 * TILES weight rows and a range of K (the whole K, or 1/S
// of it when S CTAs of a cluster split K). Its warps split that K range into groups of 32 * U
// columns (warp w takes groups w, w + W, ...). Per group a lane loads, for each 16-row tile, 16
// bytes of row g and 16 bytes of row g + 8 (g = lane / 4) at column k = group + 32 u + 8 t
// (t = lane % 4, u < U): each load instruction reads 64 contiguous bytes of 8 rows, and U * 2 *
// TILES 16-byte loads per lane are in flight before the first use. Weights are streamed with
// ld.global.nc.L1::no_allocate (read once, kept out of L1); x (read by every tile) is cached.
//
// Math on the tensor cores: mma.sync m16n8k16 (fp32 accumulation) with A = 16 weight rows and
// B = x^T, the tokens as the n = 8 columns (rows of B >= M are zero). The 8 elements a lane
// loads feed two MMAs: within one MMA the logical k index is a permutation of the physical
// columns, the same for A and B (lane t holds physical k0 + 0..3 for logical 2t, 2t+1, 2t+8,
// 2t+9 of the first MMA and k0 + 4..7 for the second), so the sum over k is unchanged.
// A lane's accumulators: c0, c1 = rows g, tokens 2t, 2t+1; c2, c3 = row g + 8.
// The per-warp partial sums meet in shared memory; across a cluster, rank 0 adds the other CTAs'
// sums through distributed shared memory (sm_90). Rank 0 adds the bias and rounds once.
//
// Fusions (GemvFusion in pagedllm/gemv.h). Prologue: with a norm weight or SiLU-and-mul, every CTA
// stages its x (tokens x its K range) in shared memory once, after the PDL wait, and the main loop
// reads x from there instead of global memory. RMSNorm: pass 1 reads h's whole rows (L2), keeps
// the CTA's range raw in shared memory and sums squares per token (fp32); a CTA reduction gives
// inv = rsqrt(sumsq / K + eps) (the rms_norm kernel's formula); pass 2 rewrites the range as
// T(T(h * inv) * g), rms_norm's roundings. SiLU: x = T(T(SiLU(gate)) * up), silu_and_mul's
// roundings. Rows are padded so that the 8 token rows a warp reads at once fall on different banks.
// When M x K does not fit the shared-memory budget the launcher splits K over more cluster CTAs.
// (Measured on the H200, bench/gpu_engine_notes.md "GEMV fusions": the staged prologue costs
// more than the separate rms_norm kernel it replaces, whose latency PDL already hides behind the
// GEMV's first weight loads; computing the norm on the fly instead — operand T(h * g), sums of
// squares from the lanes' own loads, inv in the epilogue — was slower still. The model therefore
// keeps these fusions off by default.)
// Epilogue: with a residual [M, N], y = T(T(acc + bias) + residual) — the rounding of a gemv
// followed by the residual add of fused_add_rms_norm. Each output element is read and written by
// one thread, so the residual may be y itself (in-place update of a residual stream).
//
// Programmatic dependent launch (cuda/pdl.cuh): the kernel lets the next kernel launch at once,
// issues the loads of its first two groups of weights — they do not depend on the previous
// kernel — and only then waits for the previous grid before reading x. (Optionally, config
// prefetch = 1, it first asks L2 for its whole weight slice with cp.async.bulk.prefetch; measured
// slower on the H200 except on the smallest matrices, so off by default. Copying two more groups
// per warp into shared memory by cp.async before the wait measured 0.32 ms per Llama-3-8B token
// slower in the model on the H200 and was removed: bench/gpu_engine_notes.md "Session 11".)
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "device_guard.h"
#include "fp8_kv.cuh"
#include "gemv_cuda.h"
#include "layer_ops_common.cuh"
#include "pagedllm/errors.h"
#include "pagedllm/layer_ops.h"
#include "pdl.cuh"

namespace pagedllm::cuda {
namespace {

namespace cg = cooperative_groups;
using layer_ops::from_float;
using layer_ops::ld_weight16;
using layer_ops::rotate_pair;
using layer_ops::round_to;
using layer_ops::to_float;

/// Where x comes from: the input itself, RMSNorm of the input, or SiLU(gate) * up of the input;
/// the last two are staged in shared memory.
enum class Prologue { kNone, kNorm, kSilu };

struct GemvParams {
  const void* x;         // kNone: x [M, K]; kNorm: h [M, K]; kSilu: gate_up [M, 2K]
  const void* w;
  const void* bias;      // nullptr: none
  const void* norm_w;    // kNorm: g [K]
  const void* residual;  // nullptr: none; else [M, N], contiguous, may equal y
  void* y;
  int64_t ldx;           // input row stride in elements
  int M, N, K;
  int splits;            // CTAs (one cluster) per row tile, each over k_per_split columns
  int k_per_split;       // a multiple of 32
  int prefetch;          // 1: L2-prefetch the CTA's weight slice before waiting for the previous grid
  int ldxs;              // staged x row stride in elements (kNorm / kSilu)
  float eps;             // kNorm
  // rope epilogue (GemvRope; none unless rope_counters != nullptr or rope_paired): rotary + KV-cache
  // write of out = qkv
  int* rope_counters;    // [Hq + 2 Hkv] arrivals per head, zero between launches
  const int64_t* rope_positions;
  const void* rope_cos;  // [max_position, rot_half]
  const void* rope_sin;
  void* rope_query_out;  // [M, Hq, D]
  void* rope_key_cache;  // [num_blocks, Hkv, block_size, D]
  void* rope_value_cache;
  const int64_t* rope_slots;
  int64_t rope_num_slots;
  int rope_heads, rope_kv_heads, rope_head_size, rope_rot_half, rope_block_size;
  int rope_paired;       // 1: query / key rows in the rotary_paired_row order (no counters)
  int rope_kv_fp8;       // 0, or an FP8 cache (fp8_kv.cuh's kind): codes of key / k_scale, value / v_scale
  const float* rope_k_scale;  // nullptr: 1.0
  const float* rope_v_scale;
  int out_f32;           // 1: y is float32, each element rounded to T first (no residual, no rope)
  int silu_paired;       // 1: w in the gate_up_paired_row order; y [M, N / 2] = SiLU(gate) * up
};

template <typename T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};
template <>
struct Mma<__half> {
  __device__ __forceinline__ static void run(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};


/// 16 bytes of activations (written by the previous kernel: read after pdl_wait, coherently).
__device__ __forceinline__ uint4 ld_act16(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

template <typename T>
union Pack8 {
  uint4 u;
  T e[8];
};

/// Elements k..k+7 of a row, one at a time (zero past k_end): rows not 16-byte aligned or K tails.
template <typename T>
__device__ __forceinline__ uint4 load8_scalar(const T* row, int k, int k_end) {
  Pack8<T> r;
#pragma unroll
  for (int e = 0; e < 8; ++e) r.e[e] = k + e < k_end ? row[k + e] : from_float<T>(0.f);
  return r.u;
}

/// Elements k..k+7 of a weight row (zero past k_end).
template <typename T, bool kVec>
__device__ __forceinline__ uint4 load_w(const T* row, int k, int k_end) {
  if constexpr (kVec) return ld_weight16(row + k);
  else return load8_scalar(row, k, k_end);
}

/// Elements k..k+7 of an activation row (zero past k_end).
template <typename T, bool kVec>
__device__ __forceinline__ uint4 load_act(const T* row, int k, int k_end) {
  if constexpr (kVec) return ld_act16(row + k);
  else return load8_scalar(row, k, k_end);
}

/// SiLU(gate) * up for 8 elements, rounded as silu_and_mul (cuda/activation.cu) rounds.
template <typename T>
__device__ __forceinline__ uint4 silu_mul8(uint4 gate, uint4 up) {
  Pack8<T> g, u;
  g.u = gate;
  u.u = up;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float x = to_float(g.e[e]);
    const float silu = round_to<T>(x / (1.f + expf(-x)));
    g.e[e] = from_float<T>(silu * to_float(u.e[e]));
  }
  return g.u;
}

/// One group's registers: U chunks of 8 columns of each tile's rows g and g + 8, and (when x is
/// not staged in shared memory) of x.
template <int TILES, int U, bool kRegX>
struct Frag {
  uint4 w[TILES][2][U];
  uint4 x[kRegX ? U : 1];
};

__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}

/// Stage x for columns [k_begin, k_end) of every token into xs [M][ldxs] (zero-padded to a
/// multiple of 8 columns), after the PDL wait. kNorm: x = T(T(h * inv) * g) with inv = rsqrt(
/// sum(h^2) / K + eps) over the whole row (`scratch`: warps * 8 floats, free until the caller's
/// next barrier). kSilu: x = T(T(SiLU(gate)) * up). Ends with a barrier.
template <typename T, bool kVec, Prologue kPro>
__device__ __forceinline__ void stage_x(const GemvParams& p, T* xs, int k_begin, int k_end, float* scratch) {
  const T* in = static_cast<const T*>(p.x);
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int klen8 = (k_end - k_begin + 7) / 8 * 8;
  if constexpr (kPro == Prologue::kSilu) {
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      if (m >= p.M) break;
      const T* row = in + static_cast<int64_t>(m) * p.ldx;
      for (int c = tid * 8; c < klen8; c += nthreads * 8) {
        const int k = k_begin + c;
        const uint4 v = silu_mul8<T>(load_act<T, kVec>(row, k, k_end), load_act<T, kVec>(row + p.K, k, k_end));
        *reinterpret_cast<uint4*>(xs + m * p.ldxs + c) = v;
      }
    }
  } else {
    // pass 1: sums of squares over whole rows; the CTA's own columns kept raw in xs
    float ss[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) ss[m] = 0.f;
    for (int k = tid * 8; k < p.K; k += nthreads * 8) {
      Pack8<T> h[8];
#pragma unroll
      for (int m = 0; m < 8; ++m)
        if (m < p.M) h[m].u = load_act<T, kVec>(in + static_cast<int64_t>(m) * p.ldx, k, p.K);
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        if (m >= p.M) break;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float v = to_float(h[m].e[e]);
          ss[m] += v * v;
        }
        // k and k_begin are multiples of 8; the K tail past k_end is zero from load_act
        if (k >= k_begin && k < k_end) *reinterpret_cast<uint4*>(xs + m * p.ldxs + (k - k_begin)) = h[m].u;
      }
    }
    const int lane = tid & 31, warp = tid >> 5, num_warps = nthreads >> 5;
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      if (m >= p.M) break;
      float v = ss[m];
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) scratch[warp * 8 + m] = v;
    }
    __syncthreads();
    float inv[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      if (m >= p.M) break;
      float s = 0.f;
      for (int w = 0; w < num_warps; ++w) s += scratch[w * 8 + m];
      inv[m] = rsqrtf(s / static_cast<float>(p.K) + p.eps);
    }
    // pass 2: normalise the staged columns in place (after the barrier above: pass 1 stored them)
    const T* g = static_cast<const T*>(p.norm_w);
    for (int k = k_begin + tid * 8; k < k_end; k += nthreads * 8) {
      Pack8<T> gv;
      gv.u = load_act<T, kVec>(g, k, k_end);
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        if (m >= p.M) break;
        Pack8<T>* x = reinterpret_cast<Pack8<T>*>(xs + m * p.ldxs + (k - k_begin));
        Pack8<T> v = *x;
#pragma unroll
        for (int e = 0; e < 8; ++e)
          v.e[e] = from_float<T>(round_to<T>(to_float(v.e[e]) * inv[m]) * to_float(gv.e[e]));
        *x = v;
      }
    }
  }
  __syncthreads();
}

/// 2 bytes of out written by another CTA of this grid: from L2 (ld.global.cg), never a stale L1 line.
template <typename T>
__device__ __forceinline__ T load_cg(const T* p) {
  const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
  return *reinterpret_cast<const T*>(&bits);
}

/// A head row the rope epilogue writes: elements of T (query_out, or a 16-bit cache), or an FP8
/// cache's codes of value / scale (fp8_kv.cuh). Null (`ptr == nullptr`) when nothing is written.
template <typename T>
struct RopeDst {
  void* ptr = nullptr;
  int kind = 0;
  float scale = 1.f;
  __device__ __forceinline__ void put(int j, T v) const {
    if (kind == 0) static_cast<T*>(ptr)[j] = v;
    else static_cast<uint8_t*>(ptr)[j] = fp8::encode(to_float(v), scale, kind);
  }
};

/// Where head `head` (of the Hq + 2 Hkv heads of out) of token m goes: query_out, or its slot of the
/// key or value cache; a null RopeDst for a key / value head whose slot is < 0 or past the pool.
template <typename T>
__device__ __forceinline__ RopeDst<T> rope_dst(const GemvParams& p, int head, int m) {
  const int Hq = p.rope_heads, Hkv = p.rope_kv_heads, D = p.rope_head_size;
  if (head < Hq) return {static_cast<T*>(p.rope_query_out) + (static_cast<int64_t>(m) * Hq + head) * D, 0, 1.f};
  const int64_t slot = p.rope_slots[m];
  if (slot < 0 || slot >= p.rope_num_slots) return {};
  const bool is_key = head < Hq + Hkv;
  const int kv = is_key ? head - Hq : head - Hq - Hkv;
  const int64_t block = slot / p.rope_block_size, row = slot % p.rope_block_size;
  const int64_t offset = ((block * Hkv + kv) * p.rope_block_size + row) * D;
  void* cache = is_key ? p.rope_key_cache : p.rope_value_cache;
  if (p.rope_kv_fp8 == 0) return {static_cast<T*>(cache) + offset, 0, 1.f};
  return {static_cast<uint8_t*>(cache) + offset, p.rope_kv_fp8,
          fp8::load_scale(is_key ? p.rope_k_scale : p.rope_v_scale)};
}

/// The rope epilogue (GemvRope) of one row tile [row0, row0 + rows): the CTA whose arrival completes
/// the tile's head rotates that head of every token, from out (L2), as rotary_kernel<T, true> does
/// (same rotate_pair roundings, features past 2 * rot_half copied): query heads into query_out, key
/// heads into the key cache, value heads copied into the value cache (slots < 0 or past the pool
/// write nothing), and resets the head's counter for the next launch. Rows per tile divide D.
/// `flag`: a word of the kernel's dynamic shared memory no thread reads any more (no static
/// shared memory here: the staged prologues opt into the device's whole per-CTA maximum).
template <typename T>
__device__ void rope_epilogue(const GemvParams& p, int row0, int rows, int* flag) {
  const int D = p.rope_head_size, half = p.rope_rot_half;
  const int head = row0 / D;
  __threadfence();  // this CTA's out rows are visible device-wide before its arrival counts
  __syncthreads();  // (and every thread is done with the shared partial sums under `flag`)
  if (threadIdx.x == 0) *flag = atomicAdd(p.rope_counters + head, 1) == D / rows - 1;
  __syncthreads();
  if (!*flag) return;
  __threadfence();  // the other tiles' rows, published before their arrivals, are visible now
  if (threadIdx.x == 0) p.rope_counters[head] = 0;
  const int Hq = p.rope_heads, Hkv = p.rope_kv_heads;
  const T* y = static_cast<const T*>(p.y);
  for (int m = 0; m < p.M; ++m) {
    const T* x = y + static_cast<int64_t>(m) * p.N + static_cast<int64_t>(head) * D;
    const RopeDst<T> dst = rope_dst<T>(p, head, m);
    if (dst.ptr == nullptr) continue;
    if (head >= Hq + Hkv) {  // a value head: copied
      for (int j = threadIdx.x; j < D; j += blockDim.x) dst.put(j, load_cg(x + j));
      continue;
    }
    const int64_t pos = p.rope_positions[m];
    const T* cos_row = static_cast<const T*>(p.rope_cos) + pos * half;
    const T* sin_row = static_cast<const T*>(p.rope_sin) + pos * half;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
      T y1, y2;
      rotate_pair<T>(load_cg(x + j), load_cg(x + j + half), to_float(cos_row[j]), to_float(sin_row[j]), y1, y2);
      dst.put(j, y1);
      dst.put(j + half, y2);
    }
    for (int j = 2 * half + threadIdx.x; j < D; j += blockDim.x) dst.put(j, load_cg(x + j));
  }
}

/// The rope epilogue with paired rows (GemvRope::paired_rows) of one CTA's rows [row0, row0 +
/// rows): the weight's query and key rows come in the rotary_paired_row order, so rows r and r + 8
/// of each 16-row tile are the two features (j, j + rot_half) of a rotary pair. Each pair is
/// rotated from `red` (the CTA's reduced sums [tile][row][token], before the bias; rounded as
/// the y written above) by one thread — rotate_pair's roundings, so bit-equal to rope_epilogue on
/// the unpermuted weight — and written in the standard order to query_out or the key cache;
/// value rows (not permuted) are copied to the value cache. No counters, no other CTA involved.
template <typename T>
__device__ void rope_paired_epilogue(const GemvParams& p, int row0, int rows, const float* red) {
  const int D = p.rope_head_size, half = p.rope_rot_half;
  const int Hq = p.rope_heads, Hkv = p.rope_kv_heads;
  const T* bias = static_cast<const T*>(p.bias);
  auto element = [&](int row, int m) {  // out[m, row] as the epilogue rounds it
    const int local = row - row0;
    float v = red[(local / 16) * 128 + (local % 16) * 8 + m];
    if (bias != nullptr) v += to_float(bias[row]);
    return from_float<T>(v);
  };
  for (int e = threadIdx.x; e < rows / 2 * 8; e += blockDim.x) {
    const int m = e % 8, pair = e / 8;
    const int row = row0 + (pair / 8) * 16 + pair % 8;  // the pair's first row; the second is row + 8
    if (m >= p.M || row >= p.N) continue;
    const int head = row / D, within = row % D;
    const RopeDst<T> dst = rope_dst<T>(p, head, m);
    if (dst.ptr == nullptr) continue;
    const T x1 = element(row, m), x2 = element(row + 8, m);
    if (head >= Hq + Hkv) {  // a value head: its rows are in the standard order
      dst.put(within, x1);
      dst.put(within + 8, x2);
      continue;
    }
    const int j = 8 * (within / 16) + within % 16;  // the pair's feature j < half (rotary_paired_row)
    const int64_t pos = p.rope_positions[m];
    T y1, y2;
    rotate_pair<T>(x1, x2, to_float(static_cast<const T*>(p.rope_cos)[pos * half + j]),
                   to_float(static_cast<const T*>(p.rope_sin)[pos * half + j]), y1, y2);
    dst.put(j, y1);
    dst.put(j + half, y2);
  }
}

/// The SiLU-and-mul epilogue of a gate_up projection in layer_ops.h's gate_up_paired_row order:
/// `red` holds the CTA's sums [tiles][16 rows][8 tokens] for rows row0 ..; rows r and r + 8 of
/// each 16-row tile are the gate and up of output column row0 / 2 + 8 * tile + r. Rounds as gemv
/// followed by silu_and_mul (cuda/activation.cu): the products (plus bias) to T, then
/// T(T(SiLU(gate)) * up).
template <typename T>
__device__ __forceinline__ void silu_paired_epilogue(const GemvParams& p, int row0, int tiles, const float* red) {
  T* y = static_cast<T*>(p.y);
  const T* bias = static_cast<const T*>(p.bias);
  const int half = p.N / 2;  // output columns (p.N % 16 == 0)
  for (int j = threadIdx.x; j < tiles * 64; j += blockDim.x) {
    const int tile = j / 64, r = (j % 64) / 8, token = j % 8;
    const int row = row0 + 16 * tile + r;  // the gate row; its up row is row + 8
    if (row >= p.N || token >= p.M) continue;
    float gate = red[tile * 128 + r * 8 + token], up = red[tile * 128 + (r + 8) * 8 + token];
    if (bias != nullptr) {
      gate += to_float(bias[row]);
      up += to_float(bias[row + 8]);
    }
    const float x = round_to<T>(gate);
    const float silu = round_to<T>(x / (1.f + expf(-x)));
    y[static_cast<int64_t>(token) * half + gate_up_paired_column(row)] = from_float<T>(silu * round_to<T>(up));
  }
}

template <typename T, int TILES, int U, bool kVec, Prologue kPro>
__global__ void __launch_bounds__(256) gemv_kernel(const GemvParams p) {
  // [warps][TILES * 128] floats: per-warp partial sums (row, token); then, for a staged
  // prologue, x [M][ldxs] of T
  extern __shared__ float red[];
  constexpr int kOut = TILES * 128;
  constexpr bool kStaged = kPro != Prologue::kNone;
  detail::pdl_launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x / p.splits, rank = blockIdx.x - tile * p.splits;
  const int row0 = tile * 16 * TILES;
  const int k_begin = rank * p.k_per_split;
  const int k_end = min(p.K, k_begin + p.k_per_split);
  const T* w = static_cast<const T*>(p.w);
  T* xs = reinterpret_cast<T*>(red + num_warps * kOut);

  // The weights do not depend on the previous kernel: start pulling this CTA's slice into L2.
  if (kVec && p.prefetch && k_begin < k_end && static_cast<int>(threadIdx.x) < 16 * TILES &&
      row0 + static_cast<int>(threadIdx.x) < p.N)
    prefetch_l2(w + static_cast<int64_t>(row0 + threadIdx.x) * p.K + k_begin,
                static_cast<uint32_t>(k_end - k_begin) * sizeof(T));

  const T* wrow[TILES][2];
#pragma unroll
  for (int i = 0; i < TILES; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wrow[i][h] = w + static_cast<int64_t>(min(row0 + 16 * i + 8 * h + g, p.N - 1)) * p.K;
  const bool has_x = g < p.M;
  const T* xrow = static_cast<const T*>(p.x) + static_cast<int64_t>(has_x ? g : 0) * p.ldx;
  const T* xs_row = xs + (has_x ? g : 0) * p.ldxs;  // staged x of token g, from column k_begin

  float acc[TILES][4];
#pragma unroll
  for (int i = 0; i < TILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  // Software pipeline over groups (register double buffer): group j + 2 is loaded while group j
  // is multiplied, so a warp always has one or two groups' loads in flight (without it the
  // compiler places each MMA right after its own loads and the warp waits for every group).
  const int stride = num_warps * 32 * U;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  using F = Frag<TILES, U, !kStaged>;
  auto load_weights = [&](F& f, int kg) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kg + u * 32 + t * 8;
      const bool ok = k < k_end;
#pragma unroll
      for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) f.w[i][h][u] = ok ? load_w<T, kVec>(wrow[i][h], k, k_end) : zero;
    }
  };
  auto load_input = [&](F& f, int kg) {
    if constexpr (!kStaged) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = kg + u * 32 + t * 8;
        f.x[u] = k < k_end && has_x ? load_act<T, kVec>(xrow, k, k_end) : zero;
      }
    }
  };
  auto compute = [&](const F& f, int kg) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      uint4 xv;
      if constexpr (kStaged) {
        const int k = kg + u * 32 + t * 8;
        xv = k < k_end && has_x ? *reinterpret_cast<const uint4*>(xs_row + (k - k_begin)) : zero;
      } else {
        xv = f.x[u];
      }
#pragma unroll
      for (int i = 0; i < TILES; ++i) {
        Mma<T>::run(acc[i], f.w[i][0][u].x, f.w[i][1][u].x, f.w[i][0][u].y, f.w[i][1][u].y, xv.x, xv.y);
        Mma<T>::run(acc[i], f.w[i][0][u].z, f.w[i][1][u].z, f.w[i][0][u].w, f.w[i][1][u].w, xv.z, xv.w);
      }
    }
  };
  F fa, fb;
  int kg = k_begin + warp * 32 * U;
  // The first two groups' weights are requested before waiting for the previous kernel (they do
  // not depend on it); x only after.
  if (kg < k_end) load_weights(fa, kg);
  if (kg + stride < k_end) load_weights(fb, kg + stride);
  if constexpr (kPro == Prologue::kNorm) {  // the norm weight is no output of the previous kernel
    for (int k = k_begin + static_cast<int>(threadIdx.x) * 8; k < k_end; k += blockDim.x * 8)
      asm volatile("prefetch.global.L1 [%0];" ::"l"(static_cast<const T*>(p.norm_w) + k));
  }
  detail::pdl_wait();
  if constexpr (kStaged) {
    stage_x<T, kVec, kPro>(p, xs, k_begin, k_end, red);
  } else {
    if (kg < k_end) load_input(fa, kg);
    if (kg + stride < k_end) load_input(fb, kg + stride);
  }
  while (kg < k_end) {
    compute(fa, kg);
    if (kg + 2 * stride < k_end) {
      load_weights(fa, kg + 2 * stride);
      load_input(fa, kg + 2 * stride);
    }
    kg += stride;
    if (kg >= k_end) break;
    compute(fb, kg);
    if (kg + 2 * stride < k_end) {
      load_weights(fb, kg + 2 * stride);
      load_input(fb, kg + 2 * stride);
    }
    kg += stride;
  }

  // Partial sums of this warp -> shared memory as [tile i][row r][token n].
  float* mine = red + warp * kOut;
#pragma unroll
  for (int i = 0; i < TILES; ++i) {
    mine[i * 128 + g * 8 + 2 * t] = acc[i][0];
    mine[i * 128 + g * 8 + 2 * t + 1] = acc[i][1];
    mine[i * 128 + (g + 8) * 8 + 2 * t] = acc[i][2];
    mine[i * 128 + (g + 8) * 8 + 2 * t + 1] = acc[i][3];
  }
  __syncthreads();
  for (int j = threadIdx.x; j < kOut; j += blockDim.x) {
    float s = red[j];
    for (int v = 1; v < num_warps; ++v) s += red[v * kOut + j];
    red[j] = s;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.splits > 1) {  // rank 0 adds the other CTAs' sums (distributed shared memory)
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    if (rank == 0) {
      for (int j = threadIdx.x; j < kOut; j += blockDim.x) {
        float s = red[j];
        for (int r = 1; r < p.splits; ++r) s += cluster.map_shared_rank(red, r)[j];
        red[j] = s;
      }
    }
    cluster.sync();  // the other CTAs' shared memory stays alive until rank 0 has read it
  } else {
    __syncthreads();
  }
#else
  __syncthreads();
#endif
  if (rank != 0) return;
  T* y = static_cast<T*>(p.y);
  const T* bias = static_cast<const T*>(p.bias);
  if (p.silu_paired) {  // rows g and g + 8 of each 16-row tile: gate and up of one output column
    silu_paired_epilogue<T>(p, row0, TILES, red);
    return;
  }
  const T* residual = static_cast<const T*>(p.residual);
  for (int j = threadIdx.x; j < kOut; j += blockDim.x) {
    const int row = row0 + (j / 128) * 16 + (j % 128) / 8, token = j % 8;
    if (row < p.N && token < p.M) {
      float v = red[j];
      if (bias != nullptr) v += to_float(bias[row]);
      const int64_t at = static_cast<int64_t>(token) * p.N + row;
      // the residual element is read and then written by this thread only (y may be residual)
      if (residual != nullptr) v = to_float(residual[at]) + round_to<T>(v);
      if (p.out_f32) static_cast<float*>(p.y)[at] = round_to<T>(v);
      else y[at] = from_float<T>(v);
    }
  }
  if (p.rope_paired) rope_paired_epilogue<T>(p, row0, 16 * TILES, red);
  else if (p.rope_counters != nullptr) rope_epilogue<T>(p, row0, 16 * TILES, reinterpret_cast<int*>(red));
}

int device_attr(cudaDeviceAttr attr) {
  static std::atomic<int> cache[2][64] = {};
  const int which = attr == cudaDevAttrMultiProcessorCount ? 0 : 1;
  int dev = 0;
  PAGEDLLM_CUDA_CHECK(cudaGetDevice(&dev));
  const int slot = dev < 64 ? dev : 63;
  int n = cache[which][slot].load();
  if (n == 0) {
    PAGEDLLM_CUDA_CHECK(cudaDeviceGetAttribute(&n, attr, dev));
    cache[which][slot].store(n);
  }
  return n;
}

int sm_count() { return device_attr(cudaDevAttrMultiProcessorCount); }
/// Dynamic shared memory one CTA may opt into on the current device (bytes).
int smem_optin() { return device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin); }

/// Staged x per CTA: auto splits grow until it fits this budget (two CTAs per SM on sm_90).
constexpr int64_t kStageBudget = 100 << 10;

int64_t reduce_bytes(int warps, int tiles) { return static_cast<int64_t>(warps) * tiles * 128 * sizeof(float); }

/// Staged x row stride for k_per_split columns: a multiple of 64 elements plus 32, so that rows
/// lie 64 bytes (mod 128) apart and the 8 token rows of one warp read hit different banks.
int staged_ld(int k_per_split) { return (k_per_split + 63) / 64 * 64 + 32; }

int k_per_split(int K, int splits) { return ((K + splits - 1) / splits + 31) / 32 * 32; }

int64_t staged_bytes(int M, int K, int splits, int elem) {
  return static_cast<int64_t>(M) * staged_ld(k_per_split(K, splits)) * elem;
}

template <typename T, int TILES, int U, bool kVec, Prologue kPro>
void launch_kernel(GemvParams p, int warps, cudaStream_t stream, bool pdl) {
  const auto kernel = gemv_kernel<T, TILES, U, kVec, kPro>;
  const int64_t tiles = (static_cast<int64_t>(p.N) + 16 * TILES - 1) / (16 * TILES);
  size_t smem = static_cast<size_t>(reduce_bytes(warps, TILES));
  if constexpr (kPro != Prologue::kNone) {
    static std::atomic<uint64_t> raised{0};
    smem += static_cast<size_t>(p.M) * p.ldxs * sizeof(T);
    detail::set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), static_cast<size_t>(smem_optin()), raised);
  }
  detail::launch_ex(kernel, dim3(static_cast<unsigned>(tiles * p.splits)), dim3(32 * warps), smem, stream, pdl,
                    static_cast<unsigned>(p.splits), p);
}

template <typename T, Prologue kPro>
void dispatch(GemvParams p, int variant, int warps, bool vec, cudaStream_t stream, bool pdl) {
  if (!vec) return launch_kernel<T, 1, 2, false, kPro>(p, warps, stream, pdl);
  switch (variant) {
    case 1: return launch_kernel<T, 1, 4, true, kPro>(p, warps, stream, pdl);
    case 2: return launch_kernel<T, 2, 2, true, kPro>(p, warps, stream, pdl);
    default: return launch_kernel<T, 1, 2, true, kPro>(p, warps, stream, pdl);
  }
}

template <typename T>
void dispatch_prologue(GemvParams p, Prologue pro, int variant, int warps, bool vec, cudaStream_t stream, bool pdl) {
  switch (pro) {
    case Prologue::kNorm: return dispatch<T, Prologue::kNorm>(p, variant, warps, vec, stream, pdl);
    case Prologue::kSilu: return dispatch<T, Prologue::kSilu>(p, variant, warps, vec, stream, pdl);
    default: return dispatch<T, Prologue::kNone>(p, variant, warps, vec, stream, pdl);
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

/// CTAs of 8 warps of gemv_kernel<T, 1, U, vector loads, no prologue> resident per SM on the
/// current device (its registers decide: ~120 for U = 4, ~70 for U = 2 with sm_90 code); cached
/// per process (one device model assumed).
template <typename T, int U>
int gemv_ctas_per_sm() {
  static std::atomic<int> cached{0};
  int n = cached.load();
  if (n == 0) {
    PAGEDLLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, gemv_kernel<T, 1, U, true, Prologue::kNone>, 256, static_cast<size_t>(reduce_bytes(8, 1))));
    n = std::max(n, 1);
    cached.store(n);
  }
  return n;
}

/// Whether `tiles` 16-row tiles fill one wave of variant 3 (U = 2) CTAs but more than one of
/// variant 1 (U = 4), with 8 warps each (the plain kernels' occupancy, also taken for the
/// prologue kernels).
bool one_wave_with_fewer_registers(int64_t tiles, DType dtype) {
  const int64_t sms = sm_count();
  const bool bf16 = dtype == DType::kBFloat16;
  const int64_t v1 = sms * (bf16 ? gemv_ctas_per_sm<__nv_bfloat16, 4>() : gemv_ctas_per_sm<__half, 4>());
  const int64_t v3 = sms * (bf16 ? gemv_ctas_per_sm<__nv_bfloat16, 2>() : gemv_ctas_per_sm<__half, 2>());
  return tiles > v1 && tiles <= v3;
}

/// Smallest cluster split (1, 2, 4, 8; 1 only below sm_90) at or above `from` whose staged x fits
/// next to the reduction buffer in `limit` bytes; 0 if none does.
int staged_splits(int M, int K, int elem, int from, int64_t reduce, int64_t limit, bool hopper) {
  for (int s = std::max(1, from); s <= (hopper ? 8 : 1); s *= 2)
    if (reduce + staged_bytes(M, K, s, elem) <= limit) return s;
  return 0;
}

}  // namespace

bool gemv_stage_fits(int64_t M, int64_t K, int elem_bytes) {
  if (M < 1 || K < 1 || K >= (int64_t{1} << 30)) return false;
  const bool hopper = detail::current_device_major() >= 9;
  return staged_splits(static_cast<int>(M), static_cast<int>(K), elem_bytes, 1, reduce_bytes(8, 2), smem_optin(),
                       hopper) > 0;
}

void gemv(const TensorView& out, const TensorView& input, const TensorView& weight, const TensorView* bias,
          const GemvFusion& fusion, const GemvConfig& config, std::uintptr_t stream) {
  detail::DeviceGuard guard(input.device_index);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const Prologue pro = fusion.norm_weight != nullptr ? Prologue::kNorm
                       : fusion.silu_and_mul        ? Prologue::kSilu
                                                    : Prologue::kNone;
  GemvParams p{};
  p.x = input.data;
  p.w = weight.data;
  p.bias = bias != nullptr ? bias->data : nullptr;
  p.norm_w = fusion.norm_weight != nullptr ? fusion.norm_weight->data : nullptr;
  p.residual = fusion.residual != nullptr ? fusion.residual->data : nullptr;
  p.eps = fusion.eps;
  p.y = out.data;
  p.out_f32 = out.dtype == DType::kFloat32 ? 1 : 0;
  p.silu_paired = fusion.silu_paired_rows ? 1 : 0;
  p.M = static_cast<int>(input.size(0));
  p.N = static_cast<int>(weight.size(0));
  p.K = static_cast<int>(weight.size(1));
  p.ldx = input.size(0) > 1 ? input.stride(0) : input.size(1);
  const bool vec = p.K % 8 == 0 && p.ldx % 8 == 0 && aligned16(input.data) && aligned16(weight.data) &&
                   (p.norm_w == nullptr || aligned16(p.norm_w));
  const bool hopper = detail::current_device_major() >= 9;
  // Automatic choices, from bench/gemv.py --sweep on the H200 (results/2026-11-29-h200-gemv-run1.json
  // and -run2.json): 16-row tiles with 4 chunks per group and 8 warps were best or within a few %
  // on every Llama-3-8B shape at M = 1 and 8; with short rows (K < 2048) and many row tiles (Qwen2
  // gate_up, LM head) 2 chunks and 4 warps read 10-30% faster; the L2 prefetch lost except on the
  // smallest matrices; a cluster K split paid only when the row tiles alone leave SMs idle (Qwen2
  // down: N = 896).
  const int64_t tiles16 = (static_cast<int64_t>(p.N) + 15) / 16;
  const bool short_rows = p.K < 2048 && tiles16 >= 4 * static_cast<int64_t>(sm_count());
  // Variant 3 (2 chunks: fewer registers, 3 CTAs per SM on the H200 against variant 1's 2) where
  // that makes the row tiles one wave instead of two: Llama-3-8B's qkv (384 tiles on 132 SMs) took
  // 1.9 us less per layer at batch 1 (bench/batch1_graph.py, H200, session 12). Only with every
  // config field automatic (the waves assume 8 warps and no split; such shapes take no automatic
  // split), and whatever the prologue, so that a fused GEMV sums as its unfused pair does.
  const bool one_wave_v3 = vec && !short_rows && config.variant <= 0 && config.warps <= 0 && config.splits <= 0 &&
                           one_wave_with_fewer_registers(tiles16, input.dtype);
  const int variant = !vec ? 3 : config.variant > 0 ? config.variant : short_rows || one_wave_v3 ? 3 : 1;
  const int U = variant == 1 ? 4 : 2, rows = variant == 2 ? 32 : 16;
  const int warps = config.warps > 0 ? config.warps : short_rows ? 4 : 8;
  int splits = config.splits;
  const int64_t tiles = (static_cast<int64_t>(p.N) + rows - 1) / rows;
  if (splits <= 0) {
    splits = 1;
    while (splits < 8 && tiles * splits < sm_count() && p.K / (2 * splits) >= 32 * U * 8) splits *= 2;
  }
  if (!hopper) splits = 1;  // clusters need sm_90
  if (pro != Prologue::kNone) {
    // Staged x: more K splits until it fits the budget (automatic splits) or, for a configured
    // split or where the budget cannot be met, the device's limit.
    const int elem = static_cast<int>(dtype_size(input.dtype));
    const int64_t reduce = reduce_bytes(warps, rows / 16), optin = smem_optin();
    int fit = config.splits > 0 ? 0 : staged_splits(p.M, p.K, elem, splits, reduce,
                                                       std::min<int64_t>(kStageBudget, optin), hopper);
    if (fit == 0) fit = staged_splits(p.M, p.K, elem, splits, reduce, optin, hopper);
    PAGEDLLM_CHECK(fit > 0, "gemv: the fused prologue stages ", p.M, " x ", p.K,
                   " input elements in shared memory, more than this device allows (", optin,
                   " bytes per CTA) even split over ", hopper ? 8 : 1, " CTAs; run rms_norm / silu_and_mul first");
    splits = fit;
    p.ldxs = staged_ld(k_per_split(p.K, splits));
  }
  p.splits = splits;
  p.k_per_split = k_per_split(p.K, splits);
  p.prefetch = config.prefetch >= 0 ? config.prefetch : 0;
  if (const GemvRope* r = fusion.rope; r != nullptr) {  // validated by the launcher (gemv.cpp)
    p.rope_paired = r->paired_rows ? 1 : 0;
    p.rope_kv_fp8 = fp8::kind_of(r->key_cache->dtype);
    p.rope_k_scale = fp8::scale_ptr(r->kv_scales.k_scale);
    p.rope_v_scale = fp8::scale_ptr(r->kv_scales.v_scale);
    p.rope_counters = r->paired_rows ? nullptr : r->counters->ptr<int>();
    p.rope_positions = r->positions->ptr<const int64_t>();
    p.rope_cos = r->cos_cache->data;
    p.rope_sin = r->sin_cache->data;
    p.rope_query_out = r->query_out->data;
    p.rope_key_cache = r->key_cache->data;
    p.rope_value_cache = r->value_cache->data;
    p.rope_slots = r->slot_mapping->ptr<const int64_t>();
    p.rope_num_slots = r->key_cache->size(0) * r->key_cache->size(2);
    p.rope_heads = r->num_heads;
    p.rope_kv_heads = r->num_kv_heads;
    p.rope_head_size = static_cast<int>(r->key_cache->size(3));
    p.rope_rot_half = static_cast<int>(r->cos_cache->size(1));
    p.rope_block_size = static_cast<int>(r->key_cache->size(2));
  }
  const bool pdl = detail::pdl_enabled_for_current_device();
  if (input.dtype == DType::kBFloat16) dispatch_prologue<__nv_bfloat16>(p, pro, variant, warps, vec, s, pdl);
  else dispatch_prologue<__half>(p, pro, variant, warps, vec, s, pdl);
}

}  // namespace pagedllm::cuda
