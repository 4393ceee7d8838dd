// Launchers and kernels of pagedllm/cpu_quant_linear.h (W8A8 int8 projections on the CPU).
//
// int8_linear: the activations are quantized once per call (per token, into a uint8 copy offset
// by 128 and a float32 scale per row). Threads claim column units of 32 outputs (two 16-column
// blocks, one zmm of int32 sums each) dynamically; for a unit every block of 8 rows runs over all
// of K, the unit's 32 x K bytes of weight staying in L1/L2 between row blocks, so the weight is read
// from memory once per call. Per 4-element k-group: two 64-byte weight loads, then per row one
// 32-bit broadcast of its four activation bytes and two VPDPBUSD.
#include "pagedllm/cpu_quant_linear.h"

// GCC 12 warns "__Y may be used uninitialized" inside its own AVX-512 intrinsics (a known false
// positive, as in cpu_linear.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_vec.h"
#include "kernel_checks.h"
#include "pagedllm/attention.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGEDLLM_HAVE_VNNI 1
#include <immintrin.h>
#else
#define PAGEDLLM_HAVE_VNNI 0
#endif

namespace pagedllm {

namespace {

constexpr int64_t kCols = 16;   // outputs per column block
constexpr int64_t kGroup = 4;   // k elements per VPDPBUSD lane
constexpr int64_t kRows = 8;    // rows per register block (a claimed unit is two column blocks)
constexpr int64_t kMaxGroup = 65536;  // 255 * 127 * 65536 < 2^31: a group's int32 sum cannot overflow

/// Row m of x: the uint8 codes q + 128 (K bytes) and one scale per group of `group` elements.
// A NaN in a group makes its scale NaN (so every output of the row is NaN, as a float product
// would be), and its code -127 (what the vector conversion of NaN, INT_MIN, clamps to): both
// paths give the same bits.
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

template <typename T>
void quantize_row(const T* x, int64_t K, int64_t group, uint8_t* q, float* scales) {
  for (int64_t k0 = 0, gi = 0; k0 < K; k0 += group, ++gi) {
    float amax = 0.0f;
    bool nan = false;
    for (int64_t k = k0; k < k0 + group; ++k) {
      const float v = cpu::to_float(x[k]);
      nan |= std::isnan(v);
      amax = std::max(amax, std::fabs(v));
    }
    float s = nan ? kNaN : amax / 127.0f;
    if (s == 0.0f) s = 1.0f;  // an all-zero group: codes 0
    scales[gi] = s;
    for (int64_t k = k0; k < k0 + group; ++k) {
      float v = std::nearbyint(cpu::to_float(x[k]) / s);  // round half to even (the default mode)
      v = std::isnan(v) ? -127.0f : std::min(127.0f, std::max(-127.0f, v));
      q[k] = static_cast<uint8_t>(static_cast<int32_t>(v) + 128);
    }
  }
}

struct Operands {
  int64_t M = 0, N = 0, K = 0;
  int64_t group = 0, groups = 0;  // activation group size (elements) and groups per row
  const int8_t* w = nullptr;      // packed [N/16][K/4][16][4]
  const int32_t* comp = nullptr;  // [groups][N]
  const float* w_scale = nullptr; // [N]
};

/// out[m, n0 .. n0 + 16 * blocks) for rows [m0, m0 + rows) from the float sums acc[b][r][16]
/// (sum over groups of s_x * (int sum - comp)): times w_scale, plus bias, one rounding.
template <typename Out>
void store(Out* out, int64_t ldo, int64_t m0, int64_t rows, int64_t n0, int blocks, const float (*acc)[kRows][kCols],
           const Operands& g, const float* bias) {
  for (int b = 0; b < blocks; ++b) {
    const int64_t n = n0 + b * kCols;
    for (int64_t r = 0; r < rows; ++r) {
      Out* o = out + (m0 + r) * ldo + n;
      for (int64_t c = 0; c < kCols; ++c) {
        // one fused multiply-add (never left to contraction: both out dtypes must see the same y)
        const float y = bias ? std::fma(acc[b][r][c], g.w_scale[n + c], bias[n + c]) : acc[b][r][c] * g.w_scale[n + c];
        o[c] = cpu::from_float<Out>(y);
      }
    }
  }
}

/// Portable sums of rows [m0, m0 + rows) x the unit's blocks: per activation group the exact
/// integer sum, then acc = fma(float(sum - comp), s_x, acc) in group order — the VNNI kernel's
/// operations, so the same bits.
[[maybe_unused]] void sums_portable(const uint8_t* xq, const float* sx, int64_t m0, int64_t rows, int64_t nb0,
                                    int blocks, const Operands& g, float (*acc)[kRows][kCols]) {
  const int64_t kgroups = g.K / kGroup, per = g.group / kGroup;
  for (int b = 0; b < blocks; ++b) {
    const int64_t nb = nb0 + b;
    const int8_t* w = g.w + nb * kgroups * kCols * kGroup;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* x = xq + (m0 + r) * g.K;
      for (int64_t c = 0; c < kCols; ++c) {
        float f = 0.0f;
        for (int64_t a = 0; a < g.groups; ++a) {
          int32_t s = 0;
          for (int64_t gi = a * per; gi < (a + 1) * per; ++gi)
            for (int64_t j = 0; j < kGroup; ++j)
              s += static_cast<int32_t>(x[gi * kGroup + j]) * static_cast<int32_t>(w[(gi * kCols + c) * kGroup + j]);
          f = std::fma(static_cast<float>(s - g.comp[a * g.N + nb * kCols + c]), sx[(m0 + r) * g.groups + a], f);
        }
        acc[b][r][c] = f;
      }
    }
  }
}

#if PAGEDLLM_HAVE_VNNI
template <int kR, int kB>
void sums_vnni(const uint8_t* xq, const float* sx, int64_t m0, int64_t nb0, const Operands& g,
               float (*acc)[kRows][kCols]) {
  const int64_t kgroups = g.K / kGroup, per = g.group / kGroup;
  const int8_t* w0 = g.w + nb0 * kgroups * kCols * kGroup;
  const int8_t* w1 = w0 + kgroups * kCols * kGroup;
  // the float sums over groups live in acc (L1): registers hold the int32 sums of one group only
  // (2 x kR of them; float ones beside them would spill at kR = 8)
  for (int r = 0; r < kR; ++r) {
    _mm512_storeu_ps(acc[0][r], _mm512_setzero_ps());
    if constexpr (kB == 2) _mm512_storeu_ps(acc[1][r], _mm512_setzero_ps());
  }
  const uint8_t* x = xq + m0 * g.K;
  for (int64_t a = 0; a < g.groups; ++a) {
    __m512i a0[kR], a1[kR];
    for (int r = 0; r < kR; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
    for (int64_t gi = a * per; gi < (a + 1) * per; ++gi) {
      const __m512i b0 = _mm512_loadu_si512(w0 + gi * kCols * kGroup);
      __m512i b1 = b0;
      if constexpr (kB == 2) b1 = _mm512_loadu_si512(w1 + gi * kCols * kGroup);
      for (int r = 0; r < kR; ++r) {
        int32_t four;
        std::memcpy(&four, x + r * g.K + gi * kGroup, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        a0[r] = cpu::dpbusd(a0[r], xv, b0);
        if constexpr (kB == 2) a1[r] = cpu::dpbusd(a1[r], xv, b1);
      }
    }
    const int32_t* comp = g.comp + a * g.N + nb0 * kCols;
    const __m512i c0 = _mm512_loadu_si512(comp);
    __m512i c1 = c0;
    if constexpr (kB == 2) c1 = _mm512_loadu_si512(comp + kCols);
    for (int r = 0; r < kR; ++r) {
      const __m512 s = _mm512_set1_ps(sx[(m0 + r) * g.groups + a]);
      _mm512_storeu_ps(acc[0][r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a0[r], c0)), s,
                                                  _mm512_loadu_ps(acc[0][r])));
      if constexpr (kB == 2)
        _mm512_storeu_ps(acc[1][r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a1[r], c1)), s,
                                                    _mm512_loadu_ps(acc[1][r])));
    }
  }
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const cpu::bf16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

/// quantize_row with 16 lanes (group % 16 == 0): the same divisions and roundings, the same bytes.
template <typename T>
void quantize_row_vnni(const T* x, int64_t K, int64_t group, uint8_t* q, float* scales) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t k0 = 0, gi = 0; k0 < K; k0 += group, ++gi) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = k0; k < k0 + group; k += 16) {
      const __m512 v = load16(x + k);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, _mm512_andnot_ps(sign, v));
    }
    float s = nan ? kNaN : _mm512_reduce_max_ps(m) / 127.0f;
    if (s == 0.0f) s = 1.0f;
    scales[gi] = s;
    const __m512 sv = _mm512_set1_ps(s);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(128);
    for (int64_t k = k0; k < k0 + group; k += 16) {
      __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(load16(x + k), sv));  // round half to even (MXCSR default)
      v = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi), off);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(v));
    }
  }
}

/// store() with 16 lanes: the same fused multiply-add, the same rounding to bfloat16 (nearest
/// even, NaN quieted) as cpu::from_float.
inline void store_vnni(float* out, __m512 y) { _mm512_storeu_ps(out, y); }
inline void store_vnni(cpu::bf16* out, __m512 y) {
  const __m512i u = _mm512_castps_si512(y);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
  const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
}

template <typename Out>
void store_rows_vnni(Out* out, int64_t ldo, int64_t m0, int64_t rows, int64_t n0, int blocks,
                     const float (*acc)[kRows][kCols], const Operands& g, const float* bias) {
  for (int b = 0; b < blocks; ++b) {
    const int64_t n = n0 + b * kCols;
    const __m512 ws = _mm512_loadu_ps(g.w_scale + n);
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 f = _mm512_loadu_ps(acc[b][r]);
      store_vnni(out + (m0 + r) * ldo + n, bias ? _mm512_fmadd_ps(f, ws, bv) : _mm512_mul_ps(f, ws));
    }
  }
}

template <int kB>
void sums_vnni_rows(const uint8_t* xq, const float* sx, int64_t m0, int64_t rows, int64_t nb0, const Operands& g,
                    float (*acc)[kRows][kCols]) {
  cpu::with_rows(rows, [&]<int R>() { sums_vnni<R, kB>(xq, sx, m0, nb0, g, acc); });
}
#endif

void check_cpu(const char* op, const TensorView& t) {
  PAGEDLLM_CHECK(t.device == DeviceType::kCPU, op, ": tensors must be on the cpu, got ", t.describe());
}

}  // namespace

bool int8_linear_vnni() { return PAGEDLLM_HAVE_VNNI != 0; }

int64_t int8_activation_group(int64_t in_features) {
  for (int64_t group : {int64_t{256}, int64_t{192}, int64_t{128}, int64_t{64}})
    if (in_features % group == 0) return group;
  return in_features;
}

void int8_pack_linear_weight(const TensorView& packed, const TensorView& comp, const TensorView& weight) {
  const char* op = "int8_pack_linear_weight";
  for (const TensorView* t : {&packed, &comp, &weight}) check_cpu(op, *t);
  detail::check_ndim(op, "weight", weight, 2, "[out_features, in_features]");
  detail::check_dtype(op, "weight", weight, DType::kInt8);
  const int64_t N = weight.size(0), K = weight.size(1);
  PAGEDLLM_CHECK(N > 0 && K > 0 && N % kCols == 0 && K % kGroup == 0, op,
                 ": weight must be [N, K] with N a multiple of 16 and K a multiple of 4, got ", weight.describe());
  PAGEDLLM_CHECK(K <= 1 || weight.stride(1) == 1, op, ": weight must have contiguous rows, got ", weight.describe());
  detail::check_ndim(op, "packed", packed, 4, "[N / 16, K / 4, 16, 4]");
  detail::check_dtype(op, "packed", packed, DType::kInt8);
  detail::check_contiguous(op, "packed", packed);
  PAGEDLLM_CHECK(packed.size(0) == N / kCols && packed.size(1) == K / kGroup && packed.size(2) == kCols &&
                     packed.size(3) == kGroup,
                 op, ": packed must be [", N / kCols, ", ", K / kGroup, ", 16, 4] for weight ", weight.describe(),
                 ", got ", packed.describe());
  const int64_t group = int8_activation_group(K), G = K / group;
  PAGEDLLM_CHECK(group <= kMaxGroup, op, ": in_features=", K, " has no activation group of 64-256 inputs and is above ",
                 kMaxGroup, " (a whole-row group's int32 sums could overflow): use a multiple of 64");
  detail::check_ndim(op, "comp", comp, 2, "[K / activation group, N]");
  detail::check_dtype(op, "comp", comp, DType::kInt32);
  detail::check_dim(op, "comp", comp, 0, G, "activation groups, K / int8_activation_group(K)");
  detail::check_dim(op, "comp", comp, 1, N, "out_features");
  detail::check_contiguous(op, "comp", comp);
  const int8_t* w = weight.ptr<const int8_t>();
  const int64_t ldw = weight.stride(0), groups = K / kGroup;
  int8_t* p = packed.ptr<int8_t>();
  int32_t* c = comp.ptr<int32_t>();
  for (int64_t a = 0; a < G; ++a)
    for (int64_t n = 0; n < N; ++n) {
      int32_t sum = 0;
      for (int64_t k = a * group; k < (a + 1) * group; ++k) sum += w[n * ldw + k];
      c[a * N + n] = 128 * sum;
    }
  for (int64_t nb = 0; nb < N / kCols; ++nb)
    for (int64_t gi = 0; gi < groups; ++gi)
      for (int64_t n = 0; n < kCols; ++n)
        for (int64_t j = 0; j < kGroup; ++j)
          p[((nb * groups + gi) * kCols + n) * kGroup + j] = w[(nb * kCols + n) * ldw + gi * kGroup + j];
}

void int8_linear(const TensorView& out, const TensorView& x, const TensorView& packed, const TensorView& comp,
                 const TensorView& w_scale, const TensorView* bias) {
  const char* op = "int8_linear";
  for (const TensorView* t : {&out, &x, &packed, &comp, &w_scale}) check_cpu(op, *t);
  detail::check_ndim(op, "packed", packed, 4, "[N / 16, K / 4, 16, 4]");
  detail::check_dtype(op, "packed", packed, DType::kInt8);
  detail::check_contiguous(op, "packed", packed);
  PAGEDLLM_CHECK(packed.size(2) == kCols && packed.size(3) == kGroup, op,
                 ": packed must be [N / 16, K / 4, 16, 4], got ", packed.describe());
  Operands g;
  g.N = packed.size(0) * kCols;
  g.K = packed.size(1) * kGroup;
  detail::check_ndim(op, "x", x, 2, "[num_tokens, in_features]");
  PAGEDLLM_CHECK(x.dtype == DType::kBFloat16 || x.dtype == DType::kFloat32, op,
                 ": x must be bfloat16 or float32, got ", dtype_name(x.dtype));
  detail::check_dim(op, "x", x, 1, g.K, "in_features, must match packed");
  PAGEDLLM_CHECK(g.K <= 1 || x.stride(1) == 1, op, ": x must have a contiguous last dimension, got ", x.describe());
  g.M = x.size(0);
  detail::check_ndim(op, "out", out, 2, "[num_tokens, out_features]");
  PAGEDLLM_CHECK(out.dtype == DType::kBFloat16 || out.dtype == DType::kFloat32, op,
                 ": out must be bfloat16 or float32, got ", dtype_name(out.dtype));
  detail::check_dim(op, "out", out, 0, g.M, "num_tokens, must match x");
  detail::check_dim(op, "out", out, 1, g.N, "out_features, must match packed");
  PAGEDLLM_CHECK(g.N <= 1 || out.stride(1) == 1, op, ": out must have a contiguous last dimension, got ",
                 out.describe());
  PAGEDLLM_CHECK(!detail::overlaps(out, x), op, ": out must not overlap x");
  g.group = int8_activation_group(g.K);
  g.groups = g.K / g.group;
  PAGEDLLM_CHECK(g.group <= kMaxGroup, op, ": in_features=", g.K, " has no activation group of 64-256 inputs and is "
                 "above ", kMaxGroup, ": use a multiple of 64");
  detail::check_ndim(op, "w_scale", w_scale, 1, "[out_features]");
  detail::check_dtype(op, "w_scale", w_scale, DType::kFloat32);
  detail::check_dim(op, "w_scale", w_scale, 0, g.N, "out_features, must match packed");
  PAGEDLLM_CHECK(w_scale.stride(0) == 1, op, ": w_scale must be contiguous, got ", w_scale.describe());
  detail::check_ndim(op, "comp", comp, 2, "[K / activation group, N]");
  detail::check_dtype(op, "comp", comp, DType::kInt32);
  detail::check_dim(op, "comp", comp, 0, g.groups, "activation groups, must match packed");
  detail::check_dim(op, "comp", comp, 1, g.N, "out_features, must match packed");
  detail::check_contiguous(op, "comp", comp);
  std::vector<float> bias_f;
  if (bias != nullptr) {
    PAGEDLLM_CHECK(bias->device == DeviceType::kCPU && bias->ndim == 1 && bias->size(0) == g.N &&
                       (bias->size(0) <= 1 || bias->stride(0) == 1) &&
                       (bias->dtype == DType::kFloat32 || bias->dtype == DType::kBFloat16),
                   op, ": bias must be a contiguous float32 or bfloat16 [", g.N, "] cpu tensor, got ",
                   bias->describe());
    bias_f.resize(g.N);
    if (bias->dtype == DType::kFloat32)
      std::memcpy(bias_f.data(), bias->ptr<const float>(), g.N * sizeof(float));
    else
      cpu::to_float_row(bias->ptr<const cpu::bf16>(), bias_f.data(), static_cast<int>(g.N));
  }
  if (g.M == 0 || g.N == 0) return;
  g.w = packed.ptr<const int8_t>();
  g.comp = comp.ptr<const int32_t>();
  g.w_scale = w_scale.ptr<const float>();
  const int threads = std::max(1, get_num_threads());

  // PAGEDLLM_INT8_PORTABLE=1: the portable loop even where VNNI runs (tests compare the two)
  const char* env = std::getenv("PAGEDLLM_INT8_PORTABLE");
  [[maybe_unused]] const bool portable = env != nullptr && env[0] == '1';
  // the activations, once: uint8 codes + 128 and a scale per row and group
  std::vector<uint8_t> xq(static_cast<size_t>(g.M * g.K));
  std::vector<float> sx(static_cast<size_t>(g.M * g.groups));
#pragma omp parallel for num_threads(static_cast<int>(std::min<int64_t>(threads, g.M))) schedule(static)
  for (int64_t m = 0; m < g.M; ++m) {
    uint8_t* q = xq.data() + m * g.K;
    float* scales = sx.data() + m * g.groups;
#if PAGEDLLM_HAVE_VNNI
    if (g.group % 16 == 0 && !portable) {
      if (x.dtype == DType::kFloat32)
        quantize_row_vnni(x.ptr<const float>() + m * x.stride(0), g.K, g.group, q, scales);
      else
        quantize_row_vnni(x.ptr<const cpu::bf16>() + m * x.stride(0), g.K, g.group, q, scales);
      continue;
    }
#endif
    if (x.dtype == DType::kFloat32)
      quantize_row(x.ptr<const float>() + m * x.stride(0), g.K, g.group, q, scales);
    else
      quantize_row(x.ptr<const cpu::bf16>() + m * x.stride(0), g.K, g.group, q, scales);
  }

  const int64_t blocks = g.N / kCols, units = (blocks + 1) / 2;
  const float* b = bias_f.empty() ? nullptr : bias_f.data();
  const bool out_f32 = out.dtype == DType::kFloat32;
  const int64_t ldo = out.stride(0);
  const int nt = static_cast<int>(std::min<int64_t>(threads, units));
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t u = 0; u < units; ++u) {
    alignas(64) float acc[2][kRows][kCols];
    const int64_t nb0 = 2 * u;
    const int nblocks = static_cast<int>(std::min<int64_t>(2, blocks - nb0));
    for (int64_t m0 = 0; m0 < g.M; m0 += kRows) {
      const int64_t rows = std::min(kRows, g.M - m0);
#if PAGEDLLM_HAVE_VNNI
      if (portable)
        sums_portable(xq.data(), sx.data(), m0, rows, nb0, nblocks, g, acc);
      else if (nblocks == 2)
        sums_vnni_rows<2>(xq.data(), sx.data(), m0, rows, nb0, g, acc);
      else
        sums_vnni_rows<1>(xq.data(), sx.data(), m0, rows, nb0, g, acc);
#else
      sums_portable(xq.data(), sx.data(), m0, rows, nb0, nblocks, g, acc);
#endif
#if PAGEDLLM_HAVE_VNNI
      if (!portable) {
        if (out_f32)
          store_rows_vnni(out.ptr<float>(), ldo, m0, rows, nb0 * kCols, nblocks, acc, g, b);
        else
          store_rows_vnni(out.ptr<cpu::bf16>(), ldo, m0, rows, nb0 * kCols, nblocks, acc, g, b);
        continue;
      }
#endif
      if (out_f32)
        store(out.ptr<float>(), ldo, m0, rows, nb0 * kCols, nblocks, acc, g, b);
      else
        store(out.ptr<cpu::bf16>(), ldo, m0, rows, nb0 * kCols, nblocks, acc, g, b);
    }
  }
}

}  // namespace pagedllm
