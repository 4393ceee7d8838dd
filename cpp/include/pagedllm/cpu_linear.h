// pagedllm/cpu_linear.h — the dense projections of a decoder layer on the CPU with Intel AMX.
//
//   amx_pack_linear_weight  packed = weight [N, K] (nn.Linear layout) re-laid out as AMX B tiles
//   amx_linear              out [M, N] = x [M, K] @ weight^T (+ bias), from the packed weight
//   amx_linear_silu_mul     out [M, I] = silu(gate) * up of a gate_up projection [2I, K]
//                           (amx_linear, then silu_and_mul, in one pass: the same bits)
//   amx_linear_argmax       out [M] = argmax over the columns of x @ weight^T (+ bias), without
//                           writing them (amx_linear, then argmax_rows: the same ids)
//
// Why: at decode batch sizes (M of 1-256 tokens) a projection is bound by reading its weight once
// from DRAM; oneDNN's matmul primitive adds ~50-100 us of dispatch per call and reads the weight at
// about half the machine's bandwidth. This kernel streams the packed weight once per call for
// M <= 256 (all rows of a 256-row block are computed while a weight tile is in L1; larger M reads
// it once per row block) with the accumulation in AMX tiles.
//
// Packed layout (bfloat16, N % 32 == 0, K % 32 == 0): [N / 32][K / 32][2][16][32]. For the
// column pair-block p (output columns 32p .. 32p+31), the K-block kb (inputs 32kb .. 32kb+31) and
// the half h, the 16 x 32 tile holds in row r, element 2n + j: weight[32p + 16h + n][32kb + 2r + j]
// — the "VNNI" B operand of TDPBF16PS (Intel SDM vol. 2, TDPBF16PS; Intel Optimization Reference
// Manual ch. 20, "Intel AMX"). A thread's share of the weight is therefore one sequential stream.
//
// dtypes: x, weight, packed bfloat16; bias float32 or bfloat16 [N] (optional); accumulation in
// float32, rounded to bfloat16 (nearest even) once, as torch.nn.functional.linear in bfloat16; out
// bfloat16, or float32 holding those rounded values (= a bfloat16 out widened with .float(), in one
// pass: the LM head's logits). x and out
// must have a contiguous last dimension (any row stride). CPU only. Launchers validate and throw
// InvalidArgument naming the bad value; amx_linear_supported() says whether this machine (CPU and
// OS permission for the tile state) and this build can run the kernel at all.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedllm/tensor_view.h"

namespace pagedllm {

/// Whether the AMX kernels can run here (AMX-BF16 in the build and the CPU, the OS grants the
/// tile state). When false, amx_pack_linear_weight and amx_linear throw.
bool amx_linear_supported();

/// Shape the packed weight of an [N, K] weight takes: {N / 32, K / 32, 2, 16, 32}. Throws when N or
/// K is not a positive multiple of 32.
std::vector<int64_t> amx_packed_weight_shape(int64_t N, int64_t K);

/// packed bf16 amx_packed_weight_shape(N, K), contiguous  <-  weight bf16 [N, K], contiguous rows.
void amx_pack_linear_weight(const TensorView& packed, const TensorView& weight);

/// out [M, N] = x bf16 [M, K] @ weight^T + bias, weight given packed [N/32, K/32, 2, 16, 32], out
/// bfloat16 or float32 (bfloat16-rounded values, see above); bias: nullptr or a float32/bfloat16
/// [N] view. M = 0 does nothing. out must not overlap x.
void amx_linear(const TensorView& out, const TensorView& x, const TensorView& packed, const TensorView* bias);

/// out bf16 [M, I] = silu(g) * u, where [g | u] = x bf16 [M, K] @ weight^T + bias is a gate_up
/// projection (weight [2I, K]: the gate rows, then the up rows; packed [2I/32, K/32, 2, 16, 32],
/// I % 32 == 0; bias nullptr or float32/bfloat16 [2I]). g and u are rounded to bfloat16 first and
/// silu(g) = g / (1 + exp(-g)) is rounded to bfloat16 before the product: bit for bit what
/// amx_linear into a [M, 2I] buffer followed by silu_and_mul gives (HF's LlamaMLP in bfloat16), with
/// the [M, 2I] activations never written. out must not overlap x.
void amx_linear_silu_mul(const TensorView& out, const TensorView& x, const TensorView& packed,
                         const TensorView* bias);

/// out int64 [M]: per row of x bf16 [M, K], the column in [0, vocab) (vocab 0 = all N) of the
/// largest value of x @ weight^T + bias rounded to bfloat16 (the logits amx_linear would write);
/// the smallest such column on ties; NaN never wins; a row with nothing above -inf gives its first
/// -inf column, a row of NaN only gives 0 — exactly argmax_rows of amx_linear's output (greedy
/// sampling from the LM head without writing the [M, N] logits). Throws when vocab is not in [0, N].
void amx_linear_argmax(const TensorView& out, const TensorView& x, const TensorView& packed, int64_t vocab,
                       const TensorView* bias);

}  // namespace pagedllm
