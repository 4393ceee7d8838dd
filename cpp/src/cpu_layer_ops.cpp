// CPU kernels of pagedllm/layer_ops.h: RMSNorm (+ residual add), SiLU-and-mul, rotary embedding.
//
// Rows are independent, so each op is one OpenMP loop over rows (tokens, or token x head for
// RoPE), run on the calling thread alone when the tensor is small (under 16K elements, e.g. a
// single decode token: waking a second thread costs more than the work). Inner loops run 16
// float32 lanes at a time with AVX-512 (bfloat16 widened on load and rounded to nearest even with
// VCVTNEPS2BF16 on store), or as portable scalar loops (cpu_vec.h) without it. This file is
// compiled with -ffp-contract=off: a product and a sum that HF rounds separately are never fused
// into one FMA, so fp32 results match eager PyTorch.
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_layer_kernels.h"
#include "cpu_silu.h"
#include "cpu_vec.h"

namespace pagedllm::cpu {

namespace {

/// Below this many elements an op runs on one thread. A decode step's norms ([64, 576]) and RoPE
/// ([64, 12, 64]) run on both threads of the dev VM: inside the decoder stack the other thread is
/// still spinning from the previous op, so waking it costs ~1 us (engine decode step A/B against
/// 1 << 16: 0.968; 1 << 11 measured the same as 1 << 14).
constexpr int64_t kMinParallelElements = 1 << 14;

int threads_for(int64_t elements, int num_threads) {
  return elements >= kMinParallelElements ? num_threads : 1;
}

/// exp(x) for any float x, relative error ~2e-7 (x > ln(FLT_MAX) gives +inf, as expf; x < -87.3
/// gives ~1e-38): cpu_vec.h's exp_reduced on the clamped argument.
inline float exp_full(float x) {
  const bool overflow = x > 88.7228391f;
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.7f ? 88.7f : x;
  return overflow ? std::numeric_limits<float>::infinity() : exp_reduced(x);
}

/// Round x to T and back (identity for float).
template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// 16-lane versions of the loops below (the scalar loops do not vectorize: the bf16 rounding
// has a NaN branch). Same operations in the same order, so results are identical to the scalar
// path; the tail of a row (n % 16) is done with masked loads and stores.
// Whole vectors (m == 0xffff) use plain loads and stores: a masked store does not forward to a
// later load of the same bytes, which then waits for the store to reach L1. rms_norm_impl stores
// its fp32 row buffer and reads it back at once: fused_add_rms_norm on [64, 576] bf16, one
// thread, 20-29 us per call with masked stores, 17-23 us without (the dev VM, alternating builds).
constexpr __mmask16 kAll = 0xffff;
inline __m512 load16(const float* p, __mmask16 m) { return m == kAll ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  const __m256i h = m == kAll ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) {
  if (m == kAll) _mm512_storeu_ps(p, v);
  else _mm512_mask_storeu_ps(p, m, v);
}
inline void store16(bf16* p, __m512 v, __mmask16 m) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  if (m == kAll) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  else _mm256_mask_storeu_epi16(p, m, h);
}
/// Round each lane to T and back (identity for float).
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xffff) : __mmask16((1u << remaining) - 1u);
}

#define PAGEDLLM_LAYER_OPS_AVX512 1
#endif

template <typename T>
inline const T* row_ptr(const TensorView& t, int64_t row) {
  return static_cast<const T*>(t.data) + row * t.stride(0);
}
template <typename T>
inline T* row_ptr_mut(const TensorView& t, int64_t row) {
  return static_cast<T*>(t.data) + row * t.stride(0);
}

/// out[i] = round(round(x[i] * inv) * w[i]) (HF: weight * hidden.to(dtype)).
template <typename T>
inline void normalize_row(const float* __restrict x, float inv, const T* __restrict w, T* __restrict out,
                          int64_t n) {
#ifdef PAGEDLLM_LAYER_OPS_AVX512
  const __m512 iv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 h = round16<T>(_mm512_mul_ps(load16(x + i, m), iv));
    store16(out + i, _mm512_mul_ps(load16(w + i, m), h), m);
  }
#else
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(to_float(w[i]) * round_to<T>(x[i] * inv));
#endif
}

inline float inv_rms(const float* __restrict x, int64_t n, float eps) {
#ifdef PAGEDLLM_LAYER_OPS_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load16(x + i, tail_mask(n - i));
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  const float sum = _mm512_reduce_add_ps(acc);
#else
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
#endif
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

/// Per row: x = input (or, with a residual, residual += input, rounded, and x = that sum), then
/// out = rms_norm(x) * weight. fused_add_rms_norm passes out = input (in place): the row is read
/// into x before out is written.
template <typename T>
void rms_norm_impl(const TensorView& out, const TensorView& input, const TensorView* residual,
                   const TensorView& weight, float eps, int nt) {
  const int64_t rows = input.size(0), n = input.size(1);
  const T* w = weight.ptr<const T>();
#pragma omp parallel num_threads(threads_for(rows * n, nt))
  {
    std::vector<float> x(n);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* in = row_ptr<T>(input, r);
      T* res = residual != nullptr ? row_ptr_mut<T>(*residual, r) : nullptr;
#ifdef PAGEDLLM_LAYER_OPS_AVX512
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        __m512 v = load16(in + i, m);
        if (res != nullptr) {
          v = round16<T>(_mm512_add_ps(load16(res + i, m), v));
          store16(res + i, v, m);
        }
        store16(x.data() + i, v, m);
      }
#else
      if (res != nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const T sum = from_float<T>(to_float(res[i]) + to_float(in[i]));
          res[i] = sum;
          x[i] = to_float(sum);
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) x[i] = to_float(in[i]);
      }
#endif
      normalize_row<T>(x.data(), inv_rms(x.data(), n, eps), w, row_ptr_mut<T>(out, r), n);
    }
  }
}

template <typename T>
void silu_and_mul_impl(const TensorView& out, const TensorView& input, int nt) {
  const int64_t rows = input.size(0), n = out.size(1);
#pragma omp parallel for num_threads(threads_for(rows * n, nt)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = row_ptr<T>(input, r);
    const T* up = gate + n;
    T* o = row_ptr_mut<T>(out, r);
#ifdef PAGEDLLM_LAYER_OPS_AVX512
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail_mask(n - i);
      store16(o + i, silu_mul16<std::is_same_v<T, bf16>>(load16(gate + i, m), load16(up + i, m)), m);
    }
#else
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float g = to_float(gate[i]);
      const float act = round_to<T>(g / (1.0f + exp_full(-g)));
      o[i] = from_float<T>(act * to_float(up[i]));
    }
#endif
  }
}

/// Rotate the heads of one token of x ([T, H, D] view) by cos/sin (each R/2 long).
template <typename T>
inline void rotate_heads(const TensorView& x, int64_t t, const T* __restrict cs, int64_t half) {
  const int64_t heads = x.size(1);
  T* base = static_cast<T*>(x.data) + t * x.stride(0);
  const T* sn = cs + half;
  for (int64_t h = 0; h < heads; ++h) {
    T* v = base + h * x.stride(1);
#ifdef PAGEDLLM_LAYER_OPS_AVX512
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = tail_mask(half - i);
      const __m512 x1 = load16(v + i, m), x2 = load16(v + i + half, m);
      const __m512 c = load16(cs + i, m), s = load16(sn + i, m);
      store16(v + i, _mm512_sub_ps(round16<T>(_mm512_mul_ps(x1, c)), round16<T>(_mm512_mul_ps(x2, s))), m);
      store16(v + i + half, _mm512_add_ps(round16<T>(_mm512_mul_ps(x2, c)), round16<T>(_mm512_mul_ps(x1, s))), m);
    }
#else
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_float(v[i]), x2 = to_float(v[i + half]);
      const float c = to_float(cs[i]), s = to_float(sn[i]);
      v[i] = from_float<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
      v[i + half] = from_float<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
    }
#endif
  }
}

template <typename T>
void rotary_embedding_impl(const TensorView& positions, const TensorView& query, const TensorView& key,
                           const TensorView& cos_sin_cache, int nt) {
  const int64_t tokens = query.size(0), rot = cos_sin_cache.size(1), half = rot / 2;
  const int64_t* pos = positions.ptr<const int64_t>();
  const T* cache = cos_sin_cache.ptr<const T>();
  const int64_t work = tokens * (query.size(1) + key.size(1)) * rot;
#pragma omp parallel for num_threads(threads_for(work, nt)) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* cs = cache + pos[t] * rot;
    rotate_heads<T>(query, t, cs, half);
    rotate_heads<T>(key, t, cs, half);
  }
}

template <typename F>
void by_dtype(DType dtype, F&& f) {
  if (dtype == DType::kFloat32)
    f.template operator()<float>();
  else
    f.template operator()<bf16>();
}

}  // namespace

void rms_norm(const TensorView& out, const TensorView& input, const TensorView& weight, float eps,
              int num_threads) {
  by_dtype(input.dtype, [&]<typename T>() { rms_norm_impl<T>(out, input, nullptr, weight, eps, num_threads); });
}

void fused_add_rms_norm(const TensorView& input, const TensorView& residual, const TensorView& weight,
                        float eps, int num_threads) {
  by_dtype(input.dtype,
           [&]<typename T>() { rms_norm_impl<T>(input, input, &residual, weight, eps, num_threads); });
}

void silu_and_mul(const TensorView& out, const TensorView& input, int num_threads) {
  by_dtype(input.dtype, [&]<typename T>() { silu_and_mul_impl<T>(out, input, num_threads); });
}

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin_cache, int num_threads) {
  by_dtype(query.dtype,
           [&]<typename T>() { rotary_embedding_impl<T>(positions, query, key, cos_sin_cache, num_threads); });
}

}  // namespace pagedllm::cpu
