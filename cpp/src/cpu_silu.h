// cpu_silu.h — internal: the 16-lane exp and SiLU-and-mul of the bfloat16/float32 layer kernels,
// shared by silu_and_mul (cpu_layer_ops.cpp) and the gate_up projection that applies it in its
// epilogue (amx_linear_silu_mul, cpu_linear.cpp), so that both give the same bits. Both files are
// compiled with -ffp-contract=off (no product and sum fused into an FMA that PyTorch rounds twice).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace pagedllm::cpu {

/// 16-lane exp(x): Cody-Waite reduction x = n ln2 + r, a degree-7 Taylor polynomial of e^r in
/// FMAs and the 2^n scaling by VSCALEFPS (which also gives +inf above ln(FLT_MAX) and 0 far
/// below); ~2e-7 relative (cpu_vec.h's exp_reduced, vectorized).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  for (float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

/// Round each lane to bfloat16 (nearest even) and widen it back.
inline __m512 round_bf16x16(__m512 v) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/// silu(gate) * up, unrounded, with silu(g) = g / (1 + exp(-g)) rounded to bfloat16 first when
/// kRoundAct (HF in bfloat16: act_fn(gate) is a bfloat16 tensor before the product).
template <bool kRoundAct>
inline __m512 silu_mul16(__m512 gate, __m512 up) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
  __m512 act = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  if constexpr (kRoundAct) act = round_bf16x16(act);
  return _mm512_mul_ps(act, up);
}

}  // namespace pagedllm::cpu
#endif
