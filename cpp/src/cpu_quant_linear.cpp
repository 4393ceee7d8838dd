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

/// Row m of x: the uint8 codes q + 128 (K bytes) and the scale; see the header.
template <typename T>
void quantize_row(const T* x, int64_t K, uint8_t* q, float* scale) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(cpu::to_float(x[k])));
  float s = amax / 127.0f;
  if (!(s > 0.0f)) s = 1.0f;  // an all-zero row (or NaN): codes 0
  *scale = s;
  for (int64_t k = 0; k < K; ++k) {
    float v = std::nearbyint(cpu::to_float(x[k]) / s);  // round half to even (the default mode)
    v = std::min(127.0f, std::max(-127.0f, v));
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(v) + 128);
  }
}

struct Operands {
  int64_t M = 0, N = 0, K = 0;
  const int8_t* w = nullptr;      // packed [N/16][K/4][16][4]
  const int32_t* comp = nullptr;  // [N]
  const float* w_scale = nullptr; // [N]
};

/// out[m, n0 .. n0 + 16 * blocks) for rows [m0, m0 + rows) from int32 sums acc[b][r][16].
template <typename Out>
void store(Out* out, int64_t ldo, int64_t m0, int64_t rows, int64_t n0, int blocks, const int32_t (*acc)[kRows][kCols],
           const Operands& g, const float* sx, const float* bias) {
  for (int b = 0; b < blocks; ++b) {
    const int64_t n = n0 + b * kCols;
    for (int64_t r = 0; r < rows; ++r) {
      Out* o = out + (m0 + r) * ldo + n;
      for (int64_t c = 0; c < kCols; ++c) {
        float y = static_cast<float>(acc[b][r][c] - g.comp[n + c]) * sx[m0 + r] * g.w_scale[n + c];
        if (bias) y += bias[n + c];
        o[c] = cpu::from_float<Out>(y);
      }
    }
  }
}

/// Portable sums of rows [m0, m0 + rows) x the unit's blocks (the VNNI kernel's integers exactly).
[[maybe_unused]] void sums_portable(const uint8_t* xq, int64_t K, int64_t m0, int64_t rows, int64_t nb0, int blocks,
                   const Operands& g, int32_t (*acc)[kRows][kCols]) {
  const int64_t groups = K / kGroup;
  for (int b = 0; b < blocks; ++b) {
    const int8_t* w = g.w + (nb0 + b) * groups * kCols * kGroup;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* x = xq + (m0 + r) * K;
      for (int64_t c = 0; c < kCols; ++c) {
        int32_t s = 0;
        for (int64_t gi = 0; gi < groups; ++gi)
          for (int64_t j = 0; j < kGroup; ++j)
            s += static_cast<int32_t>(x[gi * kGroup + j]) * static_cast<int32_t>(w[(gi * kCols + c) * kGroup + j]);
        acc[b][r][c] = s;
      }
    }
  }
}

#if PAGEDLLM_HAVE_VNNI
template <int kR, int kB>
void sums_vnni(const uint8_t* xq, int64_t K, int64_t m0, int64_t nb0, const Operands& g,
               int32_t (*acc)[kRows][kCols]) {
  const int64_t groups = K / kGroup;
  const int8_t* w0 = g.w + nb0 * groups * kCols * kGroup;
  const int8_t* w1 = w0 + groups * kCols * kGroup;
  __m512i a0[kR], a1[kR];
  for (int r = 0; r < kR; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
  const uint8_t* x = xq + m0 * K;
  for (int64_t gi = 0; gi < groups; ++gi) {
    const __m512i b0 = _mm512_loadu_si512(w0 + gi * kCols * kGroup);
    __m512i b1 = b0;
    if constexpr (kB == 2) b1 = _mm512_loadu_si512(w1 + gi * kCols * kGroup);
    for (int r = 0; r < kR; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * K + gi * kGroup, 4);
      const __m512i xv = _mm512_set1_epi32(four);
      a0[r] = _mm512_dpbusd_epi32(a0[r], xv, b0);
      if constexpr (kB == 2) a1[r] = _mm512_dpbusd_epi32(a1[r], xv, b1);
    }
  }
  for (int r = 0; r < kR; ++r) {
    _mm512_storeu_si512(acc[0][r], a0[r]);
    if constexpr (kB == 2) _mm512_storeu_si512(acc[1][r], a1[r]);
  }
}

template <int kB>
void sums_vnni_rows(const uint8_t* xq, int64_t K, int64_t m0, int64_t rows, int64_t nb0, const Operands& g,
                    int32_t (*acc)[kRows][kCols]) {
  switch (rows) {
    case 1: sums_vnni<1, kB>(xq, K, m0, nb0, g, acc); break;
    case 2: sums_vnni<2, kB>(xq, K, m0, nb0, g, acc); break;
    case 3: sums_vnni<3, kB>(xq, K, m0, nb0, g, acc); break;
    case 4: sums_vnni<4, kB>(xq, K, m0, nb0, g, acc); break;
    case 5: sums_vnni<5, kB>(xq, K, m0, nb0, g, acc); break;
    case 6: sums_vnni<6, kB>(xq, K, m0, nb0, g, acc); break;
    case 7: sums_vnni<7, kB>(xq, K, m0, nb0, g, acc); break;
    default: sums_vnni<8, kB>(xq, K, m0, nb0, g, acc); break;
  }
}
#endif

void check_cpu(const char* op, const TensorView& t) {
  PAGEDLLM_CHECK(t.device == DeviceType::kCPU, op, ": tensors must be on the cpu, got ", t.describe());
}

}  // namespace

bool int8_linear_vnni() { return PAGEDLLM_HAVE_VNNI != 0; }

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
  detail::check_ndim(op, "comp", comp, 1, "[N]");
  detail::check_dtype(op, "comp", comp, DType::kInt32);
  detail::check_dim(op, "comp", comp, 0, N, "out_features");
  PAGEDLLM_CHECK(comp.stride(0) == 1 || N == 1, op, ": comp must be contiguous, got ", comp.describe());
  const int8_t* w = weight.ptr<const int8_t>();
  const int64_t ldw = weight.stride(0), groups = K / kGroup;
  int8_t* p = packed.ptr<int8_t>();
  int32_t* c = comp.ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n) {
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += w[n * ldw + k];
    c[n] = 128 * sum;
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
  for (auto [name, t, dtype] : {std::tuple{"comp", &comp, DType::kInt32}, std::tuple{"w_scale", &w_scale, DType::kFloat32}}) {
    detail::check_ndim(op, name, *t, 1, "[out_features]");
    detail::check_dtype(op, name, *t, dtype);
    detail::check_dim(op, name, *t, 0, g.N, "out_features, must match packed");
    PAGEDLLM_CHECK(t->stride(0) == 1, op, ": ", name, " must be contiguous, got ", t->describe());
  }
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
  if (g.M == 0) return;
  g.w = packed.ptr<const int8_t>();
  g.comp = comp.ptr<const int32_t>();
  g.w_scale = w_scale.ptr<const float>();
  const int threads = std::max(1, get_num_threads());

  // the activations, once: uint8 codes + 128 and a scale per row
  std::vector<uint8_t> xq(static_cast<size_t>(g.M * g.K));
  std::vector<float> sx(g.M);
#pragma omp parallel for num_threads(static_cast<int>(std::min<int64_t>(threads, g.M))) schedule(static)
  for (int64_t m = 0; m < g.M; ++m) {
    if (x.dtype == DType::kFloat32)
      quantize_row(x.ptr<const float>() + m * x.stride(0), g.K, xq.data() + m * g.K, sx.data() + m);
    else
      quantize_row(x.ptr<const cpu::bf16>() + m * x.stride(0), g.K, xq.data() + m * g.K, sx.data() + m);
  }

  const int64_t blocks = g.N / kCols, units = (blocks + 1) / 2;
  const float* b = bias_f.empty() ? nullptr : bias_f.data();
  const bool out_f32 = out.dtype == DType::kFloat32;
  const int64_t ldo = out.stride(0);
  const int nt = static_cast<int>(std::min<int64_t>(threads, units));
  // PAGEDLLM_INT8_PORTABLE=1: the portable loop even where VNNI runs (tests compare the two)
  const char* env = std::getenv("PAGEDLLM_INT8_PORTABLE");
  [[maybe_unused]] const bool portable = env != nullptr && env[0] == '1';
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t u = 0; u < units; ++u) {
    alignas(64) int32_t acc[2][kRows][kCols];
    const int64_t nb0 = 2 * u;
    const int nblocks = static_cast<int>(std::min<int64_t>(2, blocks - nb0));
    for (int64_t m0 = 0; m0 < g.M; m0 += kRows) {
      const int64_t rows = std::min(kRows, g.M - m0);
#if PAGEDLLM_HAVE_VNNI
      if (portable)
        sums_portable(xq.data(), g.K, m0, rows, nb0, nblocks, g, acc);
      else if (nblocks == 2)
        sums_vnni_rows<2>(xq.data(), g.K, m0, rows, nb0, g, acc);
      else
        sums_vnni_rows<1>(xq.data(), g.K, m0, rows, nb0, g, acc);
#else
      sums_portable(xq.data(), g.K, m0, rows, nb0, nblocks, g, acc);
#endif
      if (out_f32)
        store(out.ptr<float>(), ldo, m0, rows, nb0 * kCols, nblocks, acc, g, sx.data(), b);
      else
        store(out.ptr<cpu::bf16>(), ldo, m0, rows, nb0 * kCols, nblocks, acc, g, sx.data(), b);
    }
  }
}

}  // namespace pagedllm
