// Launchers and AMX kernels of pagedllm/cpu_linear.h.
//
// amx_linear: the output is computed in 32 x 32 blocks (2 x 2 tiles of 16 x 16 float32
// accumulators, tmm0-3), the x rows as two A tiles (tmm4-5), the packed weight as two B tiles
// (tmm6-7): per 32-wide K step, 4 tile loads feed 4 TDPBF16PS. Threads split the column
// pair-blocks, claimed dynamically in runs of consecutive pair-blocks (a sequential weight stream
// per run, software-prefetched 8 KB ahead): on a shared host one core may run at half the other's
// speed (a busy SMT sibling on its AMX unit), and a static split then waits for the slower one.
// Rows go in row blocks of kRowBlock; within one, a pair-block's weight is taken kKBlock K steps
// (32 KB) at a time and every 32-row chunk of the row block multiplies that K block while it is in
// L1 (the chunks' float32 sums wait in a 32 KB buffer between K blocks). So at decode sizes
// (M <= 256) the weight is read from DRAM exactly once per call. A last chunk of fewer than 32 rows
// is computed from a zero-padded copy; chunks of at most 16 rows skip tmm5.
#include "pagedllm/cpu_linear.h"

// GCC 12 warns "__Y may be used uninitialized" inside its own AVX-512 intrinsics (their unused
// pass-through operand is _mm512_undefined_ps()): a known false positive (as in cpu_qk_pv.h).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_silu.h"
#include "cpu_vec.h"
#include "kernel_checks.h"
#include "pagedllm/attention.h"

namespace pagedllm {

namespace {

constexpr int64_t kTile = 32;       // output columns per pair-block, inputs per K step, rows per chunk
constexpr int64_t kRowBlock = 256;  // rows per row block (the x block stays in L2 while the weight streams)
constexpr int64_t kKBlock = 16;     // K steps per K block (a pair-block's 32 KB of weight stays in L1)
constexpr int64_t kClaimsPerThread = 8;  // dynamic-schedule claims per thread and row block

#if PAGEDLLM_HAVE_AMX
using cpu::amx_available;
using cpu::load_amx_tile_config;

/// out rows [0, rows) and columns [n0, n0 + 32) from the four accumulator tiles (+ bias), rounded
/// to bfloat16 (nearest even). A float32 out receives those rounded values widened, by streaming
/// stores where its row segments are 64-byte aligned (a large output, e.g. the logits, is not read
/// back soon enough to be worth the cache lines).
template <typename Out>
inline void store_block(float (*acc)[kTile], int64_t rows, Out* out, int64_t ldo, const float* bias) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(acc[r]), b0);
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(acc[r] + 16), b1);
    const __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);  // round to nearest even
    if constexpr (std::is_same_v<Out, cpu::bf16>) {
      _mm512_storeu_si512(reinterpret_cast<void*>(out + r * ldo), (__m512i)v);
    } else {
      const __m512i h = (__m512i)v;  // 32 bf16: lo in the low 256 bits
      const __m512 wlo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
      const __m512 whi =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
      float* o = out + r * ldo;
      if (reinterpret_cast<std::uintptr_t>(o) % 64 == 0) {
        _mm512_stream_ps(o, wlo);
        _mm512_stream_ps(o + 16, whi);
      } else {
        _mm512_storeu_ps(o, wlo);
        _mm512_storeu_ps(o + 16, whi);
      }
    }
  }
}

/// One 32-row chunk (rows <= 32 valid; a = its first row, lda in elements) times K steps
/// [kb0, kb1) of pair-block w (two 1 KB tiles per step), accumulated into acc (started from zero
/// when first). prefetch: pull the weight stream kPrefetchAhead bytes ahead into L1.
template <bool kTwoRowTiles>
inline void chunk_times_pair(const cpu::bf16* a, int64_t lda, const cpu::bf16* w, int64_t kb0, int64_t kb1,
                             bool first, const char* prefetch_end, bool prefetch, float (*acc)[kTile]) {
  constexpr int64_t kPrefetchAhead = 8192;
  constexpr int64_t kAccStride = kTile * 4;
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (kTwoRowTiles) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, &acc[0][0], kAccStride);
    _tile_loadd(1, &acc[0][16], kAccStride);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(2, &acc[16][0], kAccStride);
      _tile_loadd(3, &acc[16][16], kAccStride);
    }
  }
  const int64_t a_stride = lda * 2;
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const cpu::bf16* wt = w + kb * 2 * 512;
    if (prefetch) {
      const char* p = reinterpret_cast<const char*>(wt) + kPrefetchAhead;
      if (p + 2048 <= prefetch_end)
        for (int l = 0; l < 2048; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
    }
    _tile_loadd(4, a + kb * kTile, a_stride);
    _tile_loadd(6, wt, 64);
    _tile_loadd(7, wt + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(5, a + 16 * lda + kb * kTile, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, &acc[0][0], kAccStride);
  _tile_stored(1, &acc[0][16], kAccStride);
  if constexpr (kTwoRowTiles) {
    _tile_stored(2, &acc[16][0], kAccStride);
    _tile_stored(3, &acc[16][16], kAccStride);
  }
}
#endif  // PAGEDLLM_HAVE_AMX

void check_amx(const char* op) {
  PAGEDLLM_CHECK(amx_linear_supported(), op,
                 ": Intel AMX-BF16 is not available (CPU, OS tile permission or a build without "
                 "-march=native); use torch.nn.functional.linear instead");
}

}  // namespace

bool amx_linear_supported() {
#if PAGEDLLM_HAVE_AMX
  return amx_available();
#else
  return false;
#endif
}

std::vector<int64_t> amx_packed_weight_shape(int64_t N, int64_t K) {
  PAGEDLLM_CHECK(N > 0 && K > 0 && N % kTile == 0 && K % kTile == 0, "amx_linear: weight shape [", N, ", ", K,
                 "] is not supported: out_features and in_features must be positive multiples of 32");
  return {N / kTile, K / kTile, 2, 16, kTile};
}

void amx_pack_linear_weight(const TensorView& packed, const TensorView& weight) {
  const char* op = "amx_pack_linear_weight";
  check_amx(op);
  PAGEDLLM_CHECK(weight.device == DeviceType::kCPU && packed.device == DeviceType::kCPU, op,
                 ": weight and packed must be on the cpu, got ", detail::device_str(weight), " and ",
                 detail::device_str(packed));
  detail::check_ndim(op, "weight", weight, 2, "[out_features, in_features]");
  detail::check_dtype(op, "weight", weight, DType::kBFloat16);
  detail::check_dtype(op, "packed", packed, DType::kBFloat16);
  PAGEDLLM_CHECK(weight.size(1) <= 1 || weight.stride(1) == 1, op, ": weight rows must be contiguous, got ",
                 weight.describe());
  const int64_t N = weight.size(0), K = weight.size(1);
  const std::vector<int64_t> shape = amx_packed_weight_shape(N, K);
  PAGEDLLM_CHECK(packed.ndim == 5 && std::equal(shape.begin(), shape.end(), packed.shape), op,
                 ": packed must have shape [", detail::join(shape), "] for a weight of [", N, ", ", K, "], got ",
                 packed.describe());
  detail::check_contiguous(op, "packed", packed);
  const auto* w = weight.ptr<const cpu::bf16>();
  auto* p = packed.ptr<cpu::bf16>();
  const int64_t ld = weight.stride(0), ksteps = K / kTile;
#pragma omp parallel for num_threads(get_num_threads()) schedule(static)
  for (int64_t pb = 0; pb < N / kTile; ++pb)
    for (int64_t kb = 0; kb < ksteps; ++kb)
      for (int64_t h = 0; h < 2; ++h) {
        cpu::bf16* tile = p + ((pb * ksteps + kb) * 2 + h) * 512;
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t n = 0; n < 16; ++n)
            for (int64_t j = 0; j < 2; ++j)
              tile[r * 32 + 2 * n + j] = w[(pb * kTile + 16 * h + n) * ld + kb * kTile + 2 * r + j];
      }
}

namespace {

/// The operands every entry point shares, validated: x [M, K] (row stride ldx) and the packed weight.
struct GemmOperands {
  const cpu::bf16* x = nullptr;
  int64_t ldx = 0, M = 0, K = 0;
  const cpu::bf16* w = nullptr;
  int64_t pairs = 0;  // column pair-blocks in the packed weight (N / 32)
};

/// Checks x and packed for op (each entry point checks its own out); returns the operands.
GemmOperands check_operands(const char* op, const TensorView& x, const TensorView& packed) {
  check_amx(op);
  for (const TensorView* t : {&x, &packed})
    PAGEDLLM_CHECK(t->device == DeviceType::kCPU, op, ": tensors must be on the cpu, got ", t->describe());
  detail::check_ndim(op, "x", x, 2, "[num_tokens, in_features]");
  detail::check_ndim(op, "packed", packed, 5, "[out_features / 32, in_features / 32, 2, 16, 32]");
  for (auto [name, t] : {std::pair{"x", &x}, std::pair{"packed", &packed}})
    detail::check_dtype(op, name, *t, DType::kBFloat16);
  detail::check_contiguous(op, "packed", packed);
  PAGEDLLM_CHECK(packed.size(0) > 0 && packed.size(1) > 0 && packed.size(2) == 2 && packed.size(3) == 16 &&
                     packed.size(4) == kTile,
                 op, ": packed must have shape [N / 32, K / 32, 2, 16, 32] with N, K > 0, got ", packed.describe());
  const int64_t K = packed.size(1) * kTile;
  detail::check_dim(op, "x", x, 1, K, "in_features, must match packed");
  PAGEDLLM_CHECK(K <= 1 || x.stride(1) == 1, op, ": x must have a contiguous last dimension, got ", x.describe());
  return {x.ptr<const cpu::bf16>(), x.stride(0), x.size(0), K, packed.ptr<const cpu::bf16>(), packed.size(0)};
}

/// Checks op's out: a [M, cols] cpu matrix (layout names it) with a contiguous last dimension,
/// not overlapping x (out is written column block by column block while x is still being read).
void check_out_matrix(const char* op, const TensorView& out, const TensorView& x, const GemmOperands& g,
                      int64_t cols, const char* layout, const char* cols_what) {
  PAGEDLLM_CHECK(out.device == DeviceType::kCPU, op, ": tensors must be on the cpu, got ", out.describe());
  detail::check_ndim(op, "out", out, 2, layout);
  detail::check_dim(op, "out", out, 0, g.M, "num_tokens, must match x");
  detail::check_dim(op, "out", out, 1, cols, cols_what);
  PAGEDLLM_CHECK(cols <= 1 || out.stride(1) == 1, op, ": out must have a contiguous last dimension, got ",
                 out.describe());
  PAGEDLLM_CHECK(!detail::overlaps(out, x), op, ": out must not overlap x, got out ", out.describe(), " and x ",
                 x.describe());
}

/// bias as float32 [n] (empty when none), after checking it is a contiguous float32/bfloat16 [n] cpu view.
std::vector<float> bias_as_float(const char* op, const TensorView* bias, int64_t n) {
  std::vector<float> f;
  if (bias == nullptr) return f;
  PAGEDLLM_CHECK(bias->device == DeviceType::kCPU && bias->ndim == 1 && bias->size(0) == n &&
                     (bias->size(0) <= 1 || bias->stride(0) == 1) &&
                     (bias->dtype == DType::kFloat32 || bias->dtype == DType::kBFloat16),
                 op, ": bias must be a contiguous float32 or bfloat16 [", n, "] cpu tensor, got ", bias->describe());
  f.resize(n);
  if (bias->dtype == DType::kFloat32)
    std::memcpy(f.data(), bias->ptr<const float>(), n * sizeof(float));
  else
    cpu::to_float_row(bias->ptr<const cpu::bf16>(), f.data(), static_cast<int>(n));
  return f;
}

#if PAGEDLLM_HAVE_AMX
/// A 64-byte aligned float32 buffer of `n` floats (movable: data points into the heap block).
struct AlignedFloats {
  std::vector<float> buf;
  float* data;
  explicit AlignedFloats(int64_t n) : buf(n + 16) {
    data = buf.data() + ((64 - reinterpret_cast<std::uintptr_t>(buf.data()) % 64) % 64) / sizeof(float);
  }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  AlignedFloats(AlignedFloats&&) noexcept = default;
};

/// Threads for `units` units of work (what amx_gemm runs with; callers size per-thread state by it).
int gemm_threads(int64_t units) { return static_cast<int>(std::min<int64_t>(get_num_threads(), units)); }

/// The shared driver. Threads claim `units` dynamically (runs of ~1/kClaimsPerThread of a thread's
/// share); for each row block [m0, m1) of kRowBlock rows and each claimed unit u it calls
/// body(tid, u, m0, m1, multiply, acc), where multiply(pb, a) computes rows [m0, m1) of
/// pair-block pb into a ([kRowBlock][32] float32) and acc[0 .. kNumAcc) are the thread's buffers.
/// finish(tid) runs once per thread at the end, inside the parallel region. threads:
/// gemm_threads(units), taken once by the caller (tid < threads).
template <int kNumAcc, class Body, class Finish>
void amx_gemm(const GemmOperands& g, int64_t units, int threads, Body&& body, Finish&& finish) {
  const int64_t M = g.M, K = g.K, ksteps = K / kTile, pair_elems = ksteps * 2 * 512;
  const char* w_end = reinterpret_cast<const char*>(g.w + g.pairs * pair_elems);
  // The last chunk of fewer than 32 rows comes from a zero-padded copy (tile loads read 16 rows).
  const int64_t full_rows = M / kTile * kTile, tail_rows = M - full_rows;
  std::vector<cpu::bf16> tail;
  if (tail_rows > 0) {
    tail.assign(kTile * K, cpu::bf16{0});
    for (int64_t r = 0; r < tail_rows; ++r)
      std::memcpy(tail.data() + r * K, g.x + (full_rows + r) * g.ldx, K * sizeof(cpu::bf16));
  }
  // Units per claim: about kClaimsPerThread claims per thread, so that a thread slowed by another
  // tenant hands its remaining runs to the others.
  const int64_t run = std::max<int64_t>(1, units / (int64_t{threads} * kClaimsPerThread));
#pragma omp parallel num_threads(threads)
  {
    load_amx_tile_config();
    const int tid = omp_get_thread_num();
    // float32 accumulators of the row block's chunks for one pair-block (32 KB), kept across
    // K blocks: a pair-block's K block of weight (kKBlock steps, 32 KB) stays in L1 while every
    // chunk of the row block uses it.
    AlignedFloats acc_mem(kNumAcc * kRowBlock * kTile);
    float(*acc[kNumAcc])[kTile];
    for (int i = 0; i < kNumAcc; ++i) acc[i] = reinterpret_cast<float(*)[kTile]>(acc_mem.data + i * kRowBlock * kTile);
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      auto multiply = [&](int64_t pb, float (*out)[kTile]) {
        const cpu::bf16* wp = g.w + pb * pair_elems;
        for (int64_t kb0 = 0; kb0 < ksteps; kb0 += kKBlock) {
          const int64_t kb1 = std::min(ksteps, kb0 + kKBlock);
          for (int64_t mc = m0; mc < m1; mc += kTile) {
            const bool padded = mc >= full_rows;
            const cpu::bf16* a = padded ? tail.data() : g.x + mc * g.ldx;
            const int64_t lda = padded ? K : g.ldx;
            const bool prefetch = mc == m0;  // later chunks find the K block in L1/L2
            if (std::min(kTile, m1 - mc) > 16)
              chunk_times_pair<true>(a, lda, wp, kb0, kb1, kb0 == 0, w_end, prefetch, out + (mc - m0));
            else
              chunk_times_pair<false>(a, lda, wp, kb0, kb1, kb0 == 0, w_end, prefetch, out + (mc - m0));
          }
        }
      };
#pragma omp for schedule(dynamic, run) nowait
      for (int64_t u = 0; u < units; ++u) body(tid, u, m0, m1, multiply, acc);
    }
    finish(tid);
    _tile_release();
  }
}

/// out rows [0, rows), columns [0, 32): silu(gate) * up of the two pair-blocks' accumulators, each
/// first rounded to bfloat16 with its bias (the gate_up projection's output), then as silu_and_mul.
inline void store_silu_block(float (*gate)[kTile], float (*up)[kTile], int64_t rows, cpu::bf16* out, int64_t ldo,
                             const float* bias_gate, const float* bias_up) {
  __m512 bg[2], bu[2];
  for (int h = 0; h < 2; ++h) {
    bg[h] = bias_gate ? _mm512_loadu_ps(bias_gate + 16 * h) : _mm512_setzero_ps();
    bu[h] = bias_up ? _mm512_loadu_ps(bias_up + 16 * h) : _mm512_setzero_ps();
  }
  for (int64_t r = 0; r < rows; ++r) {
    __m512 v[2];
    for (int h = 0; h < 2; ++h) {
      const __m512 g = cpu::round_bf16x16(_mm512_add_ps(_mm512_load_ps(gate[r] + 16 * h), bg[h]));
      const __m512 u = cpu::round_bf16x16(_mm512_add_ps(_mm512_load_ps(up[r] + 16 * h), bu[h]));
      v[h] = cpu::silu_mul16<true>(g, u);
    }
    _mm512_storeu_si512(reinterpret_cast<void*>(out + r * ldo), (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
  }
}
#endif  // PAGEDLLM_HAVE_AMX

}  // namespace

void amx_linear(const TensorView& out, const TensorView& x, const TensorView& packed, const TensorView* bias) {
  const char* op = "amx_linear";
  const GemmOperands g = check_operands(op, x, packed);
  PAGEDLLM_CHECK(out.dtype == DType::kBFloat16 || out.dtype == DType::kFloat32, op,
                 ": out must be bfloat16 or float32, got ", dtype_name(out.dtype));
  const int64_t N = g.pairs * kTile;
  check_out_matrix(op, out, x, g, N, "[num_tokens, out_features]", "out_features, must match packed");
  const std::vector<float> bias_f = bias_as_float(op, bias, N);
  if (g.M == 0) return;
#if PAGEDLLM_HAVE_AMX
  const bool out_f32 = out.dtype == DType::kFloat32;
  auto* o = out.ptr<cpu::bf16>();  // (float* when out_f32)
  auto* of = out.ptr<float>();
  const int64_t ldo = out.stride(0);
  const float* b = bias_f.empty() ? nullptr : bias_f.data();
  amx_gemm<1>(
      g, g.pairs, gemm_threads(g.pairs),
      [&](int, int64_t pb, int64_t m0, int64_t m1, auto& multiply, float (*const* acc)[kTile]) {
        multiply(pb, acc[0]);
        const float* bp = b ? b + pb * kTile : nullptr;
        if (out_f32)
          store_block(acc[0], m1 - m0, of + m0 * ldo + pb * kTile, ldo, bp);
        else
          store_block(acc[0], m1 - m0, o + m0 * ldo + pb * kTile, ldo, bp);
      },
      [&](int) {
        if (out_f32) _mm_sfence();  // this thread's streaming stores are visible before the region ends
      });
#endif
}

void amx_linear_silu_mul(const TensorView& out, const TensorView& x, const TensorView& packed,
                         const TensorView* bias) {
  const char* op = "amx_linear_silu_mul";
  const GemmOperands g = check_operands(op, x, packed);
  PAGEDLLM_CHECK(g.pairs % 2 == 0, op, ": packed must hold the gate and up projections of an intermediate size that "
                 "is a multiple of 32, i.e. an even number of pair-blocks, got ", packed.describe());
  const int64_t I = g.pairs / 2 * kTile;
  detail::check_dtype(op, "out", out, DType::kBFloat16);
  check_out_matrix(op, out, x, g, I, "[num_tokens, intermediate_size]",
                   "intermediate_size, half of packed's out_features");
  const std::vector<float> bias_f = bias_as_float(op, bias, 2 * I);
  if (g.M == 0) return;
#if PAGEDLLM_HAVE_AMX
  auto* o = out.ptr<cpu::bf16>();
  const int64_t ldo = out.stride(0), units = g.pairs / 2;
  const float* b = bias_f.empty() ? nullptr : bias_f.data();
  amx_gemm<2>(
      g, units, gemm_threads(units),
      [&](int, int64_t u, int64_t m0, int64_t m1, auto& multiply, float (*const* acc)[kTile]) {
        multiply(u, acc[0]);          // gate columns 32u ..
        multiply(u + units, acc[1]);  // up columns I + 32u ..
        store_silu_block(acc[0], acc[1], m1 - m0, o + m0 * ldo + u * kTile, ldo, b ? b + u * kTile : nullptr,
                         b ? b + I + u * kTile : nullptr);
      },
      [](int) {});
#endif
}

void amx_linear_argmax(const TensorView& out, const TensorView& x, const TensorView& packed, int64_t vocab,
                       const TensorView* bias) {
  const char* op = "amx_linear_argmax";
  const GemmOperands g = check_operands(op, x, packed);
  const int64_t N = g.pairs * kTile;
  const int64_t n = vocab == 0 ? N : vocab;
  PAGEDLLM_CHECK(n >= 1 && n <= N, op, ": vocab = ", vocab, " must be in [1, ", N, "] (0 = all columns)");
  PAGEDLLM_CHECK(out.device == DeviceType::kCPU, op, ": tensors must be on the cpu, got ", out.describe());
  detail::check_ndim(op, "out", out, 1, "[num_tokens]");
  detail::check_dtype(op, "out", out, DType::kInt64);
  detail::check_contiguous(op, "out", out);
  detail::check_dim(op, "out", out, 0, g.M, "num_tokens, must match x");
  const std::vector<float> bias_f = bias_as_float(op, bias, N);
  if (g.M == 0) return;
#if PAGEDLLM_HAVE_AMX
  const int64_t M = g.M, units = (n + kTile - 1) / kTile;  // pair-blocks that hold vocabulary columns
  const float* b = bias_f.empty() ? nullptr : bias_f.data();
  const int threads = gemm_threads(units);
  // Per thread and row, the best (value, column) once its 16 lanes are merged (nothing yet: -inf
  // at no column, also for a thread OpenMP did not start).
  std::vector<float> best_v(static_cast<size_t>(threads) * M, -std::numeric_limits<float>::infinity());
  std::vector<int32_t> best_i(static_cast<size_t>(threads) * M, INT32_MAX);
  // Per thread and row, 16 lanes of (best value, its column), columns taken in any order.
  std::vector<AlignedFloats> lane_v;
  lane_v.reserve(threads);
  std::vector<std::vector<int32_t>> lane_i(threads, std::vector<int32_t>(M * 16, INT32_MAX));
  for (int t = 0; t < threads; ++t) {
    lane_v.emplace_back(M * 16);
    std::fill(lane_v[t].data, lane_v[t].data + M * 16, -std::numeric_limits<float>::infinity());
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  amx_gemm<1>(
      g, units, threads,
      [&](int tid, int64_t pb, int64_t m0, int64_t m1, auto& multiply, float (*const* acc)[kTile]) {
        float* lv = lane_v[tid].data;
        int32_t* li = lane_i[tid].data();
        multiply(pb, acc[0]);
        const float* bp = b ? b + pb * kTile : nullptr;
        for (int h = 0; h < 2; ++h) {
          const int64_t c0 = pb * kTile + 16 * h;
          if (c0 >= n) break;
          const __mmask16 valid = n - c0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - c0)) - 1u);
          const __m512 bias16 = bp ? _mm512_loadu_ps(bp + 16 * h) : _mm512_setzero_ps();
          const __m512i col = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(c0)), lane);
          for (int64_t r = m0; r < m1; ++r) {
            // the logit as amx_linear stores it: rounded to bfloat16
            const __m512 v = cpu::round_bf16x16(_mm512_add_ps(_mm512_load_ps(acc[0][r - m0] + 16 * h), bias16));
            const __m512 bv = _mm512_load_ps(lv + r * 16);
            const __m512i bi = _mm512_loadu_si512(li + r * 16);
            // a larger value, or an equal one at a smaller column (NaN never wins; a row of -inf
            // keeps its first column)
            const __mmask16 take = valid & (_mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ) |
                                            (_mm512_cmp_ps_mask(v, bv, _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(col, bi)));
            _mm512_store_ps(lv + r * 16, _mm512_mask_mov_ps(bv, take, v));
            _mm512_storeu_si512(li + r * 16, _mm512_mask_mov_epi32(bi, take, col));
          }
        }
      },
      [&](int tid) {
        for (int64_t r = 0; r < M; ++r) {
          float v = -std::numeric_limits<float>::infinity();
          int32_t i = INT32_MAX;
          for (int l = 0; l < 16; ++l) {
            const float lv = lane_v[tid].data[r * 16 + l];
            const int32_t li = lane_i[tid][r * 16 + l];
            if (lv > v || (lv == v && li < i)) v = lv, i = li;
          }
          best_v[tid * M + r] = v;
          best_i[tid * M + r] = i;
        }
      });
  int64_t* o = out.ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    float v = best_v[r];
    int32_t i = best_i[r];
    for (int t = 1; t < threads; ++t) {
      const float tv = best_v[t * M + r];
      const int32_t ti = best_i[t * M + r];
      if (tv > v || (tv == v && ti < i)) v = tv, i = ti;
    }
    o[r] = i == INT32_MAX ? 0 : i;  // a row of NaN only: column 0, as argmax_rows
  }
#endif
}

}  // namespace pagedllm
