// Launchers and kernels of pagedllm/cpu_woq_linear.h (weight-only quantized projections).
//
// woq_linear widens x to float32 once per call (rows that already are float32 are read in place)
// and sums each row's groups once (for formats with an offset). Both products share
// for_each_block: the activation rows go in panels of at most 256 KiB; threads claim (panel, unit of
// 16-output blocks) pairs dynamically, and in a pair every tile of up to 8 activation rows runs over
// all of K, the unit's codes staying in L1/L2 between tiles, so the weight is read from memory once
// per panel (once per call up to a panel's rows). woq_linear's units are one block. Per group: the codes of 16 outputs are widened to float32 (bits 8: one VPMOVSXBD per k;
// bits 4: one VPMOVZXBD per pair of k, then a mask and a shift), each tile row FMAs them with its
// broadcast x into a group accumulator, which is then scaled into the row's total:
// acc = fma(group_sum, scale, acc), acc = fma(min, x_group_sum, acc).
#include "pagedllm/cpu_woq_linear.h"

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_vec.h"
#include "kernel_checks.h"
#include "pagedllm/attention.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDLLM_HAVE_WOQ_AVX512 1
#include <immintrin.h>
#else
#define PAGEDLLM_HAVE_WOQ_AVX512 0
#endif
#if PAGEDLLM_HAVE_WOQ_AVX512 && defined(__AVX512VNNI__)
#define PAGEDLLM_HAVE_WOQ_VNNI 1
#else
#define PAGEDLLM_HAVE_WOQ_VNNI 0
#endif

namespace pagedllm {

namespace {

constexpr int64_t kCols = 16;  // outputs per block (one zmm of float32)
constexpr int kRows = 8;       // activation rows per tile

struct Operands {
  int64_t M = 0, N = 0, K = 0, G = 0, group = 0;
  int bits = 8;
  const uint8_t* w = nullptr;     // packed
  const float* scale = nullptr;   // [G][N]
  const float* min = nullptr;     // [G][N] or nullptr
  const float* x = nullptr;       // float32 rows
  int64_t ldx = 0;
  const float* xsum = nullptr;    // [M][G] or nullptr
};

inline int64_t block_bytes(const Operands& o) { return o.bits == 8 ? o.K * kCols : o.K / 2 * kCols; }

/// code of output row c of block b at input k, as a float (the portable loop's decoding).
inline float code_at(const uint8_t* wb, int bits, int64_t k, int64_t c) {
  if (bits == 8) return static_cast<float>(static_cast<int8_t>(wb[k * kCols + c]));
  const uint8_t byte = wb[(k / 2) * kCols + c];
  return static_cast<float>((k & 1) ? (byte >> 4) : (byte & 0xF));
}

/// acc[r][c] for tile rows [m0, m0 + rows) of block b: the same FMAs, in the same order, as the
/// AVX-512 kernel.
[[maybe_unused]] void tile_portable(const Operands& o, int64_t b, int64_t m0, int rows, float (*acc)[kCols]) {
  const uint8_t* wb = o.w + b * block_bytes(o);
  for (int r = 0; r < rows; ++r) {
    const float* x = o.x + (m0 + r) * o.ldx;
    for (int64_t c = 0; c < kCols; ++c) {
      float total = 0.0f;
      for (int64_t g = 0; g < o.G; ++g) {
        float s = 0.0f;
        for (int64_t k = g * o.group; k < (g + 1) * o.group; ++k) s = std::fma(code_at(wb, o.bits, k, c), x[k], s);
        total = std::fma(s, o.scale[g * o.N + b * kCols + c], total);
        if (o.min) total = std::fma(o.min[g * o.N + b * kCols + c], o.xsum[(m0 + r) * o.G + g], total);
      }
      acc[r][c] = total;
    }
  }
}

#if PAGEDLLM_HAVE_WOQ_AVX512
template <int R, int Bits, bool HasMin>
void tile_avx512(const Operands& o, int64_t b, int64_t m0, float (*acc_out)[kCols]) {
  const uint8_t* wb = o.w + b * block_bytes(o);
  const float* x = o.x + m0 * o.ldx;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi32(0xF);
  for (int64_t g = 0; g < o.G; ++g) {
    __m512 gs[R];
    for (int r = 0; r < R; ++r) gs[r] = _mm512_setzero_ps();
    const int64_t k0 = g * o.group, k1 = k0 + o.group;
    if constexpr (Bits == 8) {
      for (int64_t k = k0; k < k1; ++k) {
        const __m512 w = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + k * kCols))));
        for (int r = 0; r < R; ++r) gs[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * o.ldx + k]), gs[r]);
      }
    } else {
      for (int64_t k = k0; k < k1; k += 2) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + k / 2 * kCols)));
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, nibble));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        for (int r = 0; r < R; ++r) gs[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r * o.ldx + k]), gs[r]);
        for (int r = 0; r < R; ++r) gs[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[r * o.ldx + k + 1]), gs[r]);
      }
    }
    const __m512 s = _mm512_loadu_ps(o.scale + g * o.N + b * kCols);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(gs[r], s, acc[r]);
    if constexpr (HasMin) {
      const __m512 mn = _mm512_loadu_ps(o.min + g * o.N + b * kCols);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(o.xsum[(m0 + r) * o.G + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc_out[r], acc[r]);
}

template <int R>
void tile_dispatch(const Operands& o, int64_t b, int64_t m0, float (*acc)[kCols]) {
  if (o.bits == 8)
    o.min ? tile_avx512<R, 8, true>(o, b, m0, acc) : tile_avx512<R, 8, false>(o, b, m0, acc);
  else
    o.min ? tile_avx512<R, 4, true>(o, b, m0, acc) : tile_avx512<R, 4, false>(o, b, m0, acc);
}

#endif

template <typename Out>
void store_tile(const TensorView& out, int64_t m0, int rows, int64_t n0, int64_t width, const float* acc, int64_t lda,
                const float* bias) {
  Out* base = out.ptr<Out>();
  for (int r = 0; r < rows; ++r) {
    Out* o = base + (m0 + r) * out.stride(0) + n0;
    const float* a = acc + r * lda;
    for (int64_t c = 0; c < width; ++c) o[c] = cpu::from_float<Out>(bias ? a[c] + bias[n0 + c] : a[c]);
  }
}

void check_cpu(const char* op, const TensorView& t) {
  PAGEDLLM_CHECK(t.device == DeviceType::kCPU, op, ": tensors must be on the cpu, got ", t.describe());
}

void check_bits(const char* op, int64_t bits) {
  PAGEDLLM_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
}

/// The checks both products share, for a packed weight of N outputs and K inputs: x [M, K] and
/// out [M, N] (bfloat16 / float32, contiguous last dimension, not overlapping), scale float32
/// [G, N] with G dividing K, min nullptr or like scale, bias nullptr or float32 [N]. Returns (M, G).
std::pair<int64_t, int64_t> check_operands(const char* op, const TensorView& out, const TensorView& x, int64_t N,
                                           int64_t K, const TensorView& scale, const TensorView* min,
                                           const TensorView* bias) {
  for (const TensorView* t : {&out, &x, &scale}) check_cpu(op, *t);
  detail::check_ndim(op, "x", x, 2, "[num_tokens, in_features]");
  PAGEDLLM_CHECK(x.dtype == DType::kBFloat16 || x.dtype == DType::kFloat32, op,
                 ": x must be bfloat16 or float32, got ", dtype_name(x.dtype));
  detail::check_dim(op, "x", x, 1, K, "in_features, must match packed");
  PAGEDLLM_CHECK(K <= 1 || x.stride(1) == 1, op, ": x must have a contiguous last dimension, got ", x.describe());
  const int64_t M = x.size(0);
  detail::check_ndim(op, "out", out, 2, "[num_tokens, out_features]");
  PAGEDLLM_CHECK(out.dtype == DType::kBFloat16 || out.dtype == DType::kFloat32, op,
                 ": out must be bfloat16 or float32, got ", dtype_name(out.dtype));
  detail::check_dim(op, "out", out, 0, M, "num_tokens, must match x");
  detail::check_dim(op, "out", out, 1, N, "out_features, must match packed");
  PAGEDLLM_CHECK(N <= 1 || out.stride(1) == 1, op, ": out must have a contiguous last dimension, got ",
                 out.describe());
  PAGEDLLM_CHECK(!detail::overlaps(out, x), op, ": out must not overlap x");
  detail::check_ndim(op, "scale", scale, 2, "[K / group_size, out_features]");
  detail::check_dtype(op, "scale", scale, DType::kFloat32);
  detail::check_contiguous(op, "scale", scale);
  detail::check_dim(op, "scale", scale, 1, N, "out_features, must match packed");
  const int64_t G = scale.size(0);
  PAGEDLLM_CHECK(G > 0 && K % G == 0, op, ": scale has ", G, " groups, which does not divide in_features=", K);
  if (min != nullptr) {
    check_cpu(op, *min);
    detail::check_dtype(op, "min", *min, DType::kFloat32);
    detail::check_contiguous(op, "min", *min);
    PAGEDLLM_CHECK(min->ndim == 2 && min->size(0) == G && min->size(1) == N, op, ": min must be [", G, ", ", N,
                   "] like scale, got ", min->describe());
  }
  if (bias != nullptr) {
    PAGEDLLM_CHECK(bias->device == DeviceType::kCPU && bias->ndim == 1 && bias->size(0) == N &&
                       (N <= 1 || bias->stride(0) == 1) && bias->dtype == DType::kFloat32,
                   op, ": bias must be a contiguous float32 [", N, "] cpu tensor, got ", bias->describe());
  }
  return {M, G};
}

/// Rows per panel for activations of row_bytes bytes each: a panel's activations stay in L2
/// (256 KiB of them) while every unit of outputs runs over it. A multiple of 8, at least 8.
inline int64_t panel_rows(int64_t row_bytes) {
  return std::max<int64_t>(kRows, (256 << 10) / std::max<int64_t>(row_bytes, 1) / kRows * kRows);
}

/// out [M, N] + bias from tile(blk0, nb, m0, rows, acc): the rows go in panels of `panel` rows;
/// threads claim (panel, unit) pairs in panel order, a unit being NB 16-output blocks (the last unit
/// may have fewer: nb of them); in a pair, tiles of up to 8 rows run over all of K (the unit's codes
/// stay in L1/L2, the panel's activations in L2), then store. acc is float [8][NB * 16]. The
/// weight is read from memory once per panel (one panel up to 256 KiB of activations).
template <int NB, typename Tile>
void for_each_block(const TensorView& out, int64_t M, int64_t N, const TensorView* bias, int64_t panel,
                    const Tile& tile) {
  const float* b = bias ? bias->ptr<const float>() : nullptr;
  const int64_t blocks = N / kCols, units = (blocks + NB - 1) / NB, panels = (M + panel - 1) / panel;
  const bool out_f32 = out.dtype == DType::kFloat32;
  const int nt = static_cast<int>(std::min<int64_t>(std::max(1, get_num_threads()), units * panels));
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t item = 0; item < units * panels; ++item) {
    alignas(64) float acc[kRows][NB * kCols];
    const int64_t blk0 = item % units * NB, p0 = item / units * panel, p1 = std::min(M, p0 + panel);
    const int nb = static_cast<int>(std::min<int64_t>(NB, blocks - blk0));
    for (int64_t m0 = p0; m0 < p1; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, p1 - m0));
      tile(blk0, nb, m0, rows, &acc[0][0]);
      if (out_f32)
        store_tile<float>(out, m0, rows, blk0 * kCols, nb * kCols, &acc[0][0], NB * kCols, b);
      else
        store_tile<cpu::bf16>(out, m0, rows, blk0 * kCols, nb * kCols, &acc[0][0], NB * kCols, b);
    }
  }
}

}  // namespace

bool woq_linear_avx512() { return PAGEDLLM_HAVE_WOQ_AVX512 != 0; }

void woq_pack_weight(const TensorView& packed, const TensorView& codes, int64_t bits) {
  const char* op = "woq_pack_weight";
  check_cpu(op, packed);
  check_cpu(op, codes);
  check_bits(op, bits);
  detail::check_ndim(op, "codes", codes, 2, "[out_features, in_features]");
  detail::check_dtype(op, "codes", codes, bits == 8 ? DType::kInt8 : DType::kUInt8);
  const int64_t N = codes.size(0), K = codes.size(1);
  PAGEDLLM_CHECK(N > 0 && K > 0 && N % kCols == 0 && (bits == 8 || K % 2 == 0), op,
                 ": codes must be [N, K] with N a multiple of 16", bits == 4 ? " and K even" : "", ", got ",
                 codes.describe());
  PAGEDLLM_CHECK(K <= 1 || codes.stride(1) == 1, op, ": codes must have contiguous rows, got ", codes.describe());
  const int64_t kb = bits == 8 ? K : K / 2;
  detail::check_ndim(op, "packed", packed, 3, bits == 8 ? "[N / 16, K, 16]" : "[N / 16, K / 2, 16]");
  detail::check_dtype(op, "packed", packed, bits == 8 ? DType::kInt8 : DType::kUInt8);
  detail::check_contiguous(op, "packed", packed);
  PAGEDLLM_CHECK(packed.size(0) == N / kCols && packed.size(1) == kb && packed.size(2) == kCols, op,
                 ": packed must be [", N / kCols, ", ", kb, ", 16] for codes ", codes.describe(), ", got ",
                 packed.describe());
  const uint8_t* c = codes.ptr<const uint8_t>();
  uint8_t* p = packed.ptr<uint8_t>();
  const int64_t ld = codes.stride(0);
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = c + n * ld;
    uint8_t* dst = p + (n / kCols) * kb * kCols + n % kCols;
    if (bits == 8) {
      for (int64_t k = 0; k < K; ++k) dst[k * kCols] = row[k];
    } else {
      for (int64_t k = 0; k < K; k += 2) {
        PAGEDLLM_CHECK(row[k] < 16 && row[k + 1] < 16, op, ": 4-bit codes must be in [0, 15], got ",
                       static_cast<int>(std::max(row[k], row[k + 1])), " in row ", n, " near input ", k);
        dst[(k / 2) * kCols] = static_cast<uint8_t>(row[k] | (row[k + 1] << 4));
      }
    }
  }
}

void woq_linear(const TensorView& out, const TensorView& x, const TensorView& packed, int64_t bits,
                const TensorView& scale, const TensorView* min, const TensorView* bias) {
  const char* op = "woq_linear";
  check_cpu(op, packed);
  check_bits(op, bits);
  detail::check_ndim(op, "packed", packed, 3, bits == 8 ? "[N / 16, K, 16]" : "[N / 16, K / 2, 16]");
  detail::check_dtype(op, "packed", packed, bits == 8 ? DType::kInt8 : DType::kUInt8);
  detail::check_contiguous(op, "packed", packed);
  PAGEDLLM_CHECK(packed.size(2) == kCols, op, ": packed's last dimension must be 16, got ", packed.describe());
  Operands o;
  o.bits = static_cast<int>(bits);
  o.N = packed.size(0) * kCols;
  o.K = bits == 8 ? packed.size(1) : packed.size(1) * 2;
  std::tie(o.M, o.G) = check_operands(op, out, x, o.N, o.K, scale, min, bias);
  o.group = o.K / o.G;
  PAGEDLLM_CHECK(bits == 8 || o.group % 2 == 0, op, ": 4-bit weights need an even group size, got ", o.group);
  if (o.M == 0) return;
  o.w = packed.ptr<const uint8_t>();
  o.scale = scale.ptr<const float>();
  o.min = min ? min->ptr<const float>() : nullptr;

  std::vector<float> xf;
  if (x.dtype == DType::kFloat32) {
    o.x = x.ptr<const float>();
    o.ldx = x.stride(0);
  } else {
    xf.resize(static_cast<size_t>(o.M * o.K));
    for (int64_t m = 0; m < o.M; ++m)
      cpu::to_float_row(x.ptr<const cpu::bf16>() + m * x.stride(0), xf.data() + m * o.K, static_cast<int>(o.K));
    o.x = xf.data();
    o.ldx = o.K;
  }
  std::vector<float> xsum;
  if (o.min) {
    xsum.resize(static_cast<size_t>(o.M * o.G));
    for (int64_t m = 0; m < o.M; ++m)
      for (int64_t g = 0; g < o.G; ++g) {
        float s = 0.0f;
        for (int64_t k = g * o.group; k < (g + 1) * o.group; ++k) s += o.x[m * o.ldx + k];
        xsum[m * o.G + g] = s;
      }
    o.xsum = xsum.data();
  }
  for_each_block<1>(out, o.M, o.N, bias, panel_rows(o.K * 4), [&](int64_t blk, int, int64_t m0, int rows, float* acc_flat) {
    auto* acc = reinterpret_cast<float(*)[kCols]>(acc_flat);
#if PAGEDLLM_HAVE_WOQ_AVX512
    cpu::with_rows(rows, [&]<int R>() { tile_dispatch<R>(o, blk, m0, acc); });
#else
    tile_portable(o, blk, m0, rows, acc);
#endif
  });
}

// ---- W4A8 / W8A8 on AVX-512 VNNI ----------------------------------------------------------------

namespace {

constexpr int64_t kMaxVnniGroup = 65536;  // 255 * 127 * 65536 < 2^31: a group's int32 sum cannot overflow

struct VnniOperands {
  int64_t M = 0, N = 0, K = 0, G = 0, group = 0;
  int bits = 8;
  const uint8_t* w = nullptr;
  const float* scale = nullptr;    // [G][N]
  const float* min = nullptr;      // [G][N] or nullptr
  const int8_t* xq = nullptr;      // [M][K]
  const float* sx = nullptr;       // [M][G]
  const int32_t* qoff = nullptr;   // [M][G]: 128 x the group's sum of codes (the 8-bit offset)
  const float* xsum = nullptr;     // [M][G] or nullptr
};

/// Row m of x: int8 codes, and per group the scale, the sum of the codes and the float sum of x.
template <typename T>
void quantize_groups(const T* x, int64_t K, int64_t group, int8_t* q, float* sx, int32_t* qoff, float* xsum) {
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    float amax = 0.0f, sum = 0.0f;
    bool nan = false;
    for (int64_t k = k0; k < k0 + group; ++k) {
      const float v = cpu::to_float(x[k]);
      nan |= std::isnan(v);
      amax = std::max(amax, std::fabs(v));
      sum += v;
    }
    // a NaN or an infinity makes the group's scale NaN: its row of the output is NaN
    float s = nan || std::isinf(amax) ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
    if (s == 0.0f) s = 1.0f;
    int32_t qs = 0;
    for (int64_t k = k0; k < k0 + group; ++k) {
      float v = std::nearbyint(cpu::to_float(x[k]) / s);  // round half to even
      v = std::isnan(v) ? 0.0f : std::min(127.0f, std::max(-127.0f, v));
      q[k] = static_cast<int8_t>(v);
      qs += static_cast<int32_t>(v);
    }
    sx[g] = s;
    qoff[g] = 128 * qs;
    if (xsum) xsum[g] = sum;
  }
}

#if PAGEDLLM_HAVE_WOQ_VNNI
inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16f(const cpu::bf16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

/// quantize_groups with 16 lanes (group % 16 == 0): the same scale and codes (a NaN group: scale
/// NaN, its codes whatever the conversion gives — the row is NaN either way); the float sum of x
/// in another order.
template <typename T>
void quantize_groups_avx512(const T* x, int64_t K, int64_t group, int8_t* q, float* sx, int32_t* qoff, float* xsum) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    __m512 m = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = k0; k < k0 + group; k += 16) {
      const __m512 v = load16f(x + k);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, _mm512_andnot_ps(sign, v));
      sum = _mm512_add_ps(sum, v);
    }
    const float amax = _mm512_reduce_max_ps(m);
    float s = nan || std::isinf(amax) ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
    if (s == 0.0f) s = 1.0f;
    const __m512 sv = _mm512_set1_ps(s);
    __m512i qs = _mm512_setzero_si512();
    for (int64_t k = k0; k < k0 + group; k += 16) {
      __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(load16f(x + k), sv));  // round half to even (MXCSR default)
      v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
      qs = _mm512_add_epi32(qs, v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(v));
    }
    sx[g] = s;
    qoff[g] = 128 * _mm512_reduce_add_epi32(qs);
    if (xsum) xsum[g] = _mm512_reduce_add_ps(sum);
  }
}

/// acc rows [m0, m0 + R) x outputs [16 b0, 16 (b0 + NB)) (row stride lda). Per quad of inputs:
/// NB weight loads (4 bits: split into nibbles), R broadcasts of the rows' four activation bytes,
/// R x NB VPDPBUSD into int32 group sums; per group those are scaled into float32 totals.
template <int R, int NB, int Bits, bool HasMin>
void vnni_tile(const VnniOperands& o, int64_t b0, int64_t m0, float* acc, int64_t lda) {
  const int64_t quads = o.K / 4, per = o.group / 4;
  constexpr int64_t kQuadBytes = Bits == 8 ? 64 : 32;
  // NB = 1: the float totals stay in registers (R of them beside R int32 group sums); NB = 2: in
  // acc (L1), updated once per group (float ones beside 16 int32 sums would spill)
  constexpr bool kRegs = NB == 1;
  const uint8_t* wb = o.w + b0 * quads * kQuadBytes;
  const int64_t wstride = quads * kQuadBytes;  // bytes from one block to the next
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m512 accf[R][NB];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n) {
      accf[r][n] = _mm512_setzero_ps();
      if constexpr (!kRegs) _mm512_storeu_ps(acc + r * lda + n * kCols, accf[r][n]);
    }
  const int8_t* xq = o.xq + m0 * o.K;
  const float* sx = o.sx + m0 * o.G;
  const int32_t* qoff = o.qoff + m0 * o.G;
  const float* xsum = HasMin ? o.xsum + m0 * o.G : nullptr;
  for (int64_t g = 0; g < o.G; ++g) {
    __m512i acci[R][NB];
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < NB; ++n) acci[r][n] = _mm512_setzero_si512();
    for (int64_t j = g * per; j < (g + 1) * per; ++j) {
      __m512i w[NB];
      for (int n = 0; n < NB; ++n) {
        const uint8_t* p = wb + n * wstride + j * kQuadBytes;
        if constexpr (Bits == 8) {
          w[n] = _mm512_loadu_si512(p);
        } else {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
          const __m256i lo = _mm256_and_si256(v, nibble);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          w[n] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* four = xq + r * o.K + 4 * j;  // the row's four activation bytes
        if constexpr (NB == 1) {  // measured faster with the broadcast folded in at one block, slower at two
          acci[r][0] = cpu::dpbusd_bcast(acci[r][0], w[0], four);
        } else {
          int32_t v;
          std::memcpy(&v, four, 4);
          const __m512i xv = _mm512_set1_epi32(v);
          for (int n = 0; n < NB; ++n) acci[r][n] = cpu::dpbusd(acci[r][n], w[n], xv);
        }
      }
    }
    for (int n = 0; n < NB; ++n) {
      const __m512 sw = _mm512_loadu_ps(o.scale + g * o.N + (b0 + n) * kCols);
      __m512 mn;
      if constexpr (HasMin) mn = _mm512_loadu_ps(o.min + g * o.N + (b0 + n) * kCols);
      for (int r = 0; r < R; ++r) {
        float* a = acc + r * lda + n * kCols;
        __m512i d = acci[r][n];
        if constexpr (Bits == 8) d = _mm512_sub_epi32(d, _mm512_set1_epi32(qoff[r * o.G + g]));
        __m512 t = kRegs ? accf[r][n] : _mm512_loadu_ps(a);
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sw, _mm512_set1_ps(sx[r * o.G + g])), t);
        if constexpr (HasMin) t = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[r * o.G + g]), t);
        if constexpr (kRegs)
          accf[r][n] = t;
        else
          _mm512_storeu_ps(a, t);
      }
    }
  }
  if constexpr (kRegs)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * lda, accf[r][0]);
}

template <int R, int NB>
void vnni_dispatch(const VnniOperands& o, int64_t b0, int64_t m0, float* acc, int64_t lda) {
  if (o.bits == 8)
    o.min ? vnni_tile<R, NB, 8, true>(o, b0, m0, acc, lda) : vnni_tile<R, NB, 8, false>(o, b0, m0, acc, lda);
  else
    o.min ? vnni_tile<R, NB, 4, true>(o, b0, m0, acc, lda) : vnni_tile<R, NB, 4, false>(o, b0, m0, acc, lda);
}

#endif

}  // namespace

bool woq_vnni_available() { return PAGEDLLM_HAVE_WOQ_VNNI != 0; }

void woq_vnni_pack_weight(const TensorView& packed, const TensorView& codes, int64_t bits) {
  const char* op = "woq_vnni_pack_weight";
  check_cpu(op, packed);
  check_cpu(op, codes);
  check_bits(op, bits);
  detail::check_ndim(op, "codes", codes, 2, "[out_features, in_features]");
  detail::check_dtype(op, "codes", codes, bits == 8 ? DType::kInt8 : DType::kUInt8);
  const int64_t N = codes.size(0), K = codes.size(1);
  PAGEDLLM_CHECK(N > 0 && K > 0 && N % kCols == 0 && K % 4 == 0, op,
                 ": codes must be [N, K] with N a multiple of 16 and K a multiple of 4, got ", codes.describe());
  PAGEDLLM_CHECK(codes.stride(1) == 1, op, ": codes must have contiguous rows, got ", codes.describe());
  const int64_t quads = K / 4, qb = bits == 8 ? 64 : 32;
  detail::check_ndim(op, "packed", packed, 3, bits == 8 ? "[N / 16, K / 4, 64]" : "[N / 16, K / 4, 32]");
  detail::check_dtype(op, "packed", packed, DType::kUInt8);
  detail::check_contiguous(op, "packed", packed);
  PAGEDLLM_CHECK(packed.size(0) == N / kCols && packed.size(1) == quads && packed.size(2) == qb, op,
                 ": packed must be [", N / kCols, ", ", quads, ", ", qb, "] for codes ", codes.describe(), ", got ",
                 packed.describe());
  const uint8_t* c = codes.ptr<const uint8_t>();
  const int64_t ld = codes.stride(0);
  uint8_t* p = packed.ptr<uint8_t>();
  for (int64_t nb = 0; nb < N / kCols; ++nb)
    for (int64_t j = 0; j < quads; ++j) {
      uint8_t* dst = p + (nb * quads + j) * qb;
      for (int64_t t = 0; t < 4; ++t) {
        if (bits == 8) {
          for (int64_t r = 0; r < kCols; ++r)
            dst[4 * r + t] = static_cast<uint8_t>(static_cast<int>(static_cast<int8_t>(c[(nb * kCols + r) * ld + 4 * j + t])) + 128);
        } else {
          for (int64_t r = 0; r < kCols / 2; ++r) {
            const uint8_t lo = c[(nb * kCols + r) * ld + 4 * j + t], hi = c[(nb * kCols + r + 8) * ld + 4 * j + t];
            PAGEDLLM_CHECK(lo < 16 && hi < 16, op, ": 4-bit codes must be in [0, 15], got ",
                           static_cast<int>(std::max(lo, hi)), " in row block ", nb, " near input ", 4 * j + t);
            dst[4 * r + t] = static_cast<uint8_t>(lo | (hi << 4));
          }
        }
      }
    }
}

void woq_vnni_linear(const TensorView& out, const TensorView& x, const TensorView& packed, int64_t bits,
                     const TensorView& scale, const TensorView* min, const TensorView* bias) {
  const char* op = "woq_vnni_linear";
  PAGEDLLM_CHECK(woq_vnni_available(), op, ": this build has no AVX-512 VNNI (use woq_linear)");
  check_cpu(op, packed);
  check_bits(op, bits);
  const int64_t qb = bits == 8 ? 64 : 32;
  detail::check_ndim(op, "packed", packed, 3, bits == 8 ? "[N / 16, K / 4, 64]" : "[N / 16, K / 4, 32]");
  detail::check_dtype(op, "packed", packed, DType::kUInt8);
  detail::check_contiguous(op, "packed", packed);
  PAGEDLLM_CHECK(packed.size(2) == qb, op, ": packed's last dimension must be ", qb, " for ", bits, " bits, got ",
                 packed.describe());
  VnniOperands o;
  o.bits = static_cast<int>(bits);
  o.N = packed.size(0) * kCols;
  o.K = packed.size(1) * 4;
  std::tie(o.M, o.G) = check_operands(op, out, x, o.N, o.K, scale, min, bias);
  o.group = o.K / o.G;
  PAGEDLLM_CHECK(o.group % 4 == 0, op, ": scale has ", o.G, " groups; in_features=", o.K,
                 " must split into groups of a multiple of 4 inputs");
  PAGEDLLM_CHECK(o.group <= kMaxVnniGroup, op, ": groups of ", o.group, " inputs are above ", kMaxVnniGroup,
                 " (int32 sums could overflow)");
  if (o.M == 0) return;
#if PAGEDLLM_HAVE_WOQ_VNNI
  o.w = packed.ptr<const uint8_t>();
  o.scale = scale.ptr<const float>();
  o.min = min ? min->ptr<const float>() : nullptr;
  const int threads = std::max(1, get_num_threads());
  std::vector<int8_t> xq(static_cast<size_t>(o.M * o.K));
  std::vector<float> sx(static_cast<size_t>(o.M * o.G)), xsum(o.min ? static_cast<size_t>(o.M * o.G) : 0);
  std::vector<int32_t> qoff(static_cast<size_t>(o.M * o.G));
#pragma omp parallel for num_threads(static_cast<int>(std::min<int64_t>(threads, o.M))) schedule(static)
  for (int64_t m = 0; m < o.M; ++m) {
    const auto quantize = [&](const auto* row) {
      float* xs = o.min ? xsum.data() + m * o.G : nullptr;
      if (o.group % 16 == 0)
        quantize_groups_avx512(row, o.K, o.group, xq.data() + m * o.K, sx.data() + m * o.G, qoff.data() + m * o.G, xs);
      else
        quantize_groups(row, o.K, o.group, xq.data() + m * o.K, sx.data() + m * o.G, qoff.data() + m * o.G, xs);
    };
    if (x.dtype == DType::kFloat32)
      quantize(x.ptr<const float>() + m * x.stride(0));
    else
      quantize(x.ptr<const cpu::bf16>() + m * x.stride(0));
  }
  o.xq = xq.data();
  o.sx = sx.data();
  o.qoff = qoff.data();
  o.xsum = o.min ? xsum.data() : nullptr;
  // groups of at most 32 inputs (GGUF): a unit of one 16-output block, float totals in registers
  // (the per-group scaling dominates: measured faster); longer groups: two blocks (32 outputs, 8
  // rows: 16 int32 sums), the totals in L1 (group 64 measured 1.2x faster so than with one block)
  const auto run = [&]<int kUnit>() {
    for_each_block<kUnit>(out, o.M, o.N, bias, panel_rows(o.K), [&](int64_t b0, int nb, int64_t m0, int rows, float* acc) {
      cpu::with_rows(rows, [&]<int R>() {
        if (nb == kUnit)
          vnni_dispatch<R, kUnit>(o, b0, m0, acc, kUnit * kCols);
        else
          vnni_dispatch<R, 1>(o, b0, m0, acc, kUnit * kCols);
      });
    });
  };
  if (o.group < 64)
    run.template operator()<1>();
  else
    run.template operator()<2>();
#endif
}

}  // namespace pagedllm
