// pagedllm/cpu_woq_linear.h — projections with weight-only quantized (WOQ) weights on the CPU:
// integer codes with a float32 scale, and optionally a float32 offset ("min"), per output row
// and per group of consecutive inputs. One layout serves every weight-only format pagedllm
// reads (model_executor/quantization/): GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K, GPTQ, AWQ,
// compressed-tensors W4A16 / W8A16 and online int4, each converted exactly at load.
//
//   w[n, k]   = scale[g, n] * code[n, k] + min[g, n]        g = k / group_size
//   out[m, n] = sum_g ( scale[g, n] * (sum_{k in g} code[n, k] * x[m, k])
//                       + min[g, n] * (sum_{k in g} x[m, k]) ) + bias[n]
//
// The activations stay in floating point (x is widened to float32; the products and sums are
// float32 FMAs, the group sums scaled once per group): the result is the float32 product of x and
// the dequantized weight up to float32 summation order, with no activation quantization, so a
// float32 model keeps its logits to ~1e-5 of the dequantized one.
//
// codes: bits = 8: int8 in [-128, 127]; bits = 4: uint8 in [0, 15] (a 4-bit format's offset goes
// into min: GGUF Q4_0's w = d * (q - 8) is scale d, min -8 d).
// Packed layout (N % 16 == 0): bits 8: int8 [N / 16][K][16], byte (b, k, c) = code[16 b + c][k];
// bits 4: uint8 [N / 16][K / 2][16], byte (b, p, c) = code[16 b + c][2 p] | code[16 b + c][2 p + 1] << 4
// — a 16-byte load gives one (or two) k of 16 output rows, the lanes of one zmm accumulator.
// scale, min: float32 [K / group_size, N] (contiguous: 16 rows' values are one load).
// group_size divides K (and is even for bits 4); group_size = K is per-channel.
// dtypes: x bfloat16 / float32 [M, K] (contiguous last dimension, any row stride); bias nullptr or
// float32 [N]; out bfloat16 / float32 [M, N] (contiguous last dimension), rounded once.
// Without AVX-512 in the build a portable loop computes the same sums in the same order.
// Launchers validate and throw InvalidArgument naming the bad value.
#pragma once

#include <cstdint>

#include "pagedllm/tensor_view.h"

namespace pagedllm {

/// Whether woq_linear runs its AVX-512 kernel here (else the portable loop).
bool woq_linear_avx512();

/// packed (layout above) <- codes [N, K] (bits 8: int8; bits 4: uint8 in [0, 15], contiguous rows).
/// Throws unless bits is 4 or 8, N % 16 == 0, K even for bits 4, or a 4-bit code is above 15.
void woq_pack_weight(const TensorView& packed, const TensorView& codes, int64_t bits);

/// out [M, N] = x [M, K] times the dequantized weight (see above) + bias. min may be nullptr (no
/// offset). M = 0 does nothing; out must not overlap x. Uses the CPU thread count (set_num_threads).
void woq_linear(const TensorView& out, const TensorView& x, const TensorView& packed, int64_t bits,
                const TensorView& scale, const TensorView* min, const TensorView* bias);

}  // namespace pagedllm

// ---- W4A8 / W8A8 on AVX-512 VNNI: the same weights, int8 activations ------------------------------
//
// For bfloat16 models the engine uses this instead (what llama.cpp does with Q8 activations): x is
// quantized per token and per weight group, s_x = max |x_g| / 127 (1 for a zero group; NaN for a
// group holding a NaN or an infinity, making its row NaN), q_x = round half to even (x / s_x) in [-127, 127]; each
// group's dot product is exact in int32 (VPDPBUSD: weight bytes unsigned, activations signed), then
//   out[m, n] = sum_g ( scale[g, n] * s_x[m, g] * (sum_k a[n, k] q_x[m, k] - 128 sum_k q_x[m, k] [8 bits])
//                       + min[g, n] * (sum_{k in g} x[m, k]) ) + bias[n]
// with a = the 4-bit code, or the 8-bit code + 128; the min term uses the float sums of x (exact
// offsets). About 4x the multiply-adds per instruction of the float kernel; the cost is the
// activations' rounding (as quantization="int8"'s, per group of the weight's size).
// Packed layout (N % 16 == 0, group % 4 == 0): bits 8: uint8 [N / 16][K / 4][64], bytes 4 c + t of
// quad j = code[16 b + c][4 j + t] + 128; bits 4: uint8 [N / 16][K / 4][32], byte 4 c + t (c < 8)
// = code[16 b + c][4 j + t] | code[16 b + c + 8][4 j + t] << 4 (one 32-byte load, split into low
// and high nibbles, is the 64-byte VPDPBUSD operand of 16 rows x 4 inputs).

namespace pagedllm {

/// Whether woq_vnni_linear can run here (a build with AVX-512 VNNI).
bool woq_vnni_available();

/// packed (layout above) <- codes [N, K] (bits 8: int8; bits 4: uint8 in [0, 15]). Throws unless N %
/// 16 == 0 and K % 4 == 0.
void woq_vnni_pack_weight(const TensorView& packed, const TensorView& codes, int64_t bits);

/// out [M, N] (see above) for x [M, K] (bfloat16 / float32, contiguous last dimension), scale / min
/// float32 [G, N] as woq_linear's (group = K / G, a multiple of 4), bias nullptr or float32 [N].
/// Throws where woq_vnni_available() is false.
void woq_vnni_linear(const TensorView& out, const TensorView& x, const TensorView& packed, int64_t bits,
                     const TensorView& scale, const TensorView* min, const TensorView* bias);

}  // namespace pagedllm
