// pagedllm/cpu_quant_linear.h — projections with int8 weights on the CPU (W8A8: int8 weights with
// a scale per output channel, activations quantized to int8 on the fly), for the
// `quantization="int8"` linear method.
//
//   int8_pack_linear_weight  packed, comp <- weight int8 [N, K] (nn.Linear layout)
//   int8_linear              out [M, N] = sum over activation groups a of
//                                         s_x[m, a] * (q_x[m, a] . weight[n, a]) * s_w[n]  + bias[n]
//
// Why: a decode step reads every weight once; int8 halves the bytes of bfloat16, and on a CPU with
// AVX-512 VNNI (VPDPBUSD: 64 int8 multiply-adds per instruction, twice the bfloat16 dot product's
// VDPBF16PS) it halves the arithmetic too. The activations are quantized per token and per group
// of int8_activation_group(K) consecutive inputs (the largest of 256, 192, 128, 64 that divides K;
// the whole row when none does), symmetric: s_x[m, a] = max |x[m, group a]| / 127 (1 when the group is 0), q_x = round half
// to even of x / s_x, in [-127, 127] — per-token dynamic scales (SmoothQuant, Xiao et al. 2023,
// section 3) made per group so that a few outlier channels (Dettmers et al. 2022, "LLM.int8()")
// coarsen only their own group: on SmolLM2-135M the qkv input's outliers cost 2.2% perplexity with
// one scale per token. Each group's dot product is exact in int32; the float32 sum over groups is
// fma(float(int sum - comp), s_x, acc) in group order, then fma(., s_w, bias), rounded once. A NaN
// in a group makes that row's outputs NaN. K that no group of 64-256 divides is one group, at most
// 65,536 (its int32 sums stay exact).
//
// Packed layout (int8, N % 16 == 0, K % 4 == 0): [N / 16][K / 4][16][4]: for the column block nb
// and the k-group g, 64 bytes hold weight[16 nb + n][4 g + j] at 4 n + j — one VPDPBUSD operand
// (Intel SDM vol. 2, VPDPBUSD), so a thread streams its share of the weight sequentially.
// comp int32 [K / group, N] = 128 * the sum of weight[n, k] over each activation group: VPDPBUSD
// multiplies unsigned by signed bytes, so the kernel feeds q_x + 128 and subtracts comp.
//
// dtypes: weight int8; w_scale float32 [N]; x bfloat16 or float32 [M, K] (contiguous last
// dimension, any row stride); bias nullptr or float32 / bfloat16 [N]; out bfloat16 or float32
// [M, N] (contiguous last dimension). Without AVX-512 VNNI in the build (or with the environment
// variable PAGEDLLM_INT8_PORTABLE=1) a portable loop computes the same values, slowly. Launchers validate and throw InvalidArgument naming the bad value.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedllm/tensor_view.h"

namespace pagedllm {

/// Whether int8_linear runs the AVX-512 VNNI kernel here (else its portable loop).
bool int8_linear_vnni();

/// Activation elements per scale for K inputs: the largest of 256, 192, 128, 64 dividing K, else K.
/// (A group folds its int32 sums into the float32 ones: larger groups fold less often.)
int64_t int8_activation_group(int64_t in_features);

/// packed int8 [N/16, K/4, 16, 4] (contiguous), comp int32 [K / int8_activation_group(K), N]
/// (contiguous)  <-  weight int8 [N, K] (contiguous rows). Throws unless N % 16 == 0 and K % 4 == 0.
void int8_pack_linear_weight(const TensorView& packed, const TensorView& comp, const TensorView& weight);

/// out [M, N] = W8A8 product of x [M, K] and the packed weight (see above). M = 0 does nothing.
/// out must not overlap x. Uses the pagedllm CPU thread count (set_num_threads).
void int8_linear(const TensorView& out, const TensorView& x, const TensorView& packed, const TensorView& comp,
                 const TensorView& w_scale, const TensorView* bias);

}  // namespace pagedllm
