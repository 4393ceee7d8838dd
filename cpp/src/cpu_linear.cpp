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

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_amx.h"
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

void amx_linear(const TensorView& out, const TensorView& x, const TensorView& packed, const TensorView* bias) {
  const char* op = "amx_linear";
  check_amx(op);
  for (const TensorView* t : {&out, &x, &packed})
    PAGEDLLM_CHECK(t->device == DeviceType::kCPU, op, ": tensors must be on the cpu, got ", t->describe());
  detail::check_ndim(op, "x", x, 2, "[num_tokens, in_features]");
  detail::check_ndim(op, "out", out, 2, "[num_tokens, out_features]");
  detail::check_ndim(op, "packed", packed, 5, "[out_features / 32, in_features / 32, 2, 16, 32]");
  for (auto [name, t] : {std::pair{"x", &x}, std::pair{"packed", &packed}})
    detail::check_dtype(op, name, *t, DType::kBFloat16);
  PAGEDLLM_CHECK(out.dtype == DType::kBFloat16 || out.dtype == DType::kFloat32, op,
                 ": out must be bfloat16 or float32, got ", dtype_name(out.dtype));
  const bool out_f32 = out.dtype == DType::kFloat32;
  detail::check_contiguous(op, "packed", packed);
  const int64_t M = x.size(0), K = packed.size(1) * kTile, N = packed.size(0) * kTile;
  PAGEDLLM_CHECK(packed.size(0) > 0 && packed.size(1) > 0 && packed.size(2) == 2 && packed.size(3) == 16 &&
                     packed.size(4) == kTile,
                 op, ": packed must have shape [N / 32, K / 32, 2, 16, 32] with N, K > 0, got ", packed.describe());
  detail::check_dim(op, "x", x, 1, K, "in_features, must match packed");
  detail::check_dim(op, "out", out, 0, M, "num_tokens, must match x");
  detail::check_dim(op, "out", out, 1, N, "out_features, must match packed");
  PAGEDLLM_CHECK((K <= 1 || x.stride(1) == 1) && (N <= 1 || out.stride(1) == 1), op,
                 ": x and out must have a contiguous last dimension, got x ", x.describe(), " and out ",
                 out.describe());
  // out is written column block by column block while x is still being read
  PAGEDLLM_CHECK(!detail::overlaps(out, x), op, ": out must not overlap x, got out ", out.describe(), " and x ",
                 x.describe());
  std::vector<float> bias_f;
  if (bias != nullptr) {
    PAGEDLLM_CHECK(bias->device == DeviceType::kCPU && bias->ndim == 1 && bias->size(0) == N &&
                       (bias->size(0) <= 1 || bias->stride(0) == 1) &&
                       (bias->dtype == DType::kFloat32 || bias->dtype == DType::kBFloat16),
                   op, ": bias must be a contiguous float32 or bfloat16 [", N, "] cpu tensor, got ",
                   bias->describe());
    bias_f.resize(N);
    if (bias->dtype == DType::kFloat32)
      std::memcpy(bias_f.data(), bias->ptr<const float>(), N * sizeof(float));
    else
      cpu::to_float_row(bias->ptr<const cpu::bf16>(), bias_f.data(), static_cast<int>(N));
  }
  if (M == 0) return;
#if PAGEDLLM_HAVE_AMX
  const auto* xa = x.ptr<const cpu::bf16>();
  const auto* w = packed.ptr<const cpu::bf16>();
  auto* o = out.ptr<cpu::bf16>();  // (float* when out_f32)
  auto* of = out.ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0), ksteps = K / kTile, pairs = N / kTile;
  const int64_t pair_elems = ksteps * 2 * 512;
  const char* w_end = reinterpret_cast<const char*>(w + pairs * pair_elems);
  // The last chunk of fewer than 32 rows comes from a zero-padded copy (tile loads read 16 rows).
  const int64_t full_rows = M / kTile * kTile, tail_rows = M - full_rows;
  std::vector<cpu::bf16> tail;
  if (tail_rows > 0) {
    tail.assign(kTile * K, cpu::bf16{0});
    for (int64_t r = 0; r < tail_rows; ++r)
      std::memcpy(tail.data() + r * K, xa + (full_rows + r) * ldx, K * sizeof(cpu::bf16));
  }
  const float* b = bias_f.empty() ? nullptr : bias_f.data();
  const int threads = static_cast<int>(std::min<int64_t>(get_num_threads(), pairs));
  // Pair-blocks per claim: about kClaimsPerThread claims per thread, so that a thread slowed by
  // another tenant hands its remaining runs to the others.
  const int64_t run = std::max<int64_t>(1, pairs / (int64_t{threads} * kClaimsPerThread));
#pragma omp parallel num_threads(threads)
  {
    load_amx_tile_config();
    // float32 accumulators of the row block's chunks for one pair-block (32 KB), kept across
    // K blocks: a pair-block's K block of weight (kKBlock steps, 32 KB) stays in L1 while every
    // chunk of the row block uses it.
    std::vector<float> acc_buf(kRowBlock * kTile + 16);
    auto* acc_all = reinterpret_cast<float (*)[kTile]>(
        acc_buf.data() + ((64 - reinterpret_cast<std::uintptr_t>(acc_buf.data()) % 64) % 64) / sizeof(float));
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
#pragma omp for schedule(dynamic, run) nowait
      for (int64_t pb = 0; pb < pairs; ++pb) {
        const cpu::bf16* wp = w + pb * pair_elems;
        for (int64_t kb0 = 0; kb0 < ksteps; kb0 += kKBlock) {
          const int64_t kb1 = std::min(ksteps, kb0 + kKBlock);
          for (int64_t mc = m0; mc < m1; mc += kTile) {
            const int64_t rows = std::min(kTile, m1 - mc);
            const bool padded = mc >= full_rows;
            const cpu::bf16* a = padded ? tail.data() : xa + mc * ldx;
            const int64_t lda = padded ? K : ldx;
            const bool prefetch = mc == m0;  // later chunks find the K block in L1/L2
            float(*acc)[kTile] = acc_all + (mc - m0);
            if (rows > 16)
              chunk_times_pair<true>(a, lda, wp, kb0, kb1, kb0 == 0, w_end, prefetch, acc);
            else
              chunk_times_pair<false>(a, lda, wp, kb0, kb1, kb0 == 0, w_end, prefetch, acc);
          }
        }
        const float* bp = b ? b + pb * kTile : nullptr;
        for (int64_t mc = m0; mc < m1; mc += kTile) {
          if (out_f32)
            store_block(acc_all + (mc - m0), std::min(kTile, m1 - mc), of + mc * ldo + pb * kTile, ldo, bp);
          else
            store_block(acc_all + (mc - m0), std::min(kTile, m1 - mc), o + mc * ldo + pb * kTile, ldo, bp);
        }
      }
    }
    if (out_f32) _mm_sfence();  // this thread's streaming stores are visible before the region ends
    _tile_release();
  }
#endif
}

}  // namespace pagedllm
