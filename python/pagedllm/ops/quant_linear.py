"""Projections with int8 weights on the CPU (``cpp/include/pagedllm/cpu_quant_linear.h``), called
with torch tensors: W8A8, the weight int8 with a float32 scale per output channel, the
activations quantized to int8 per token inside the call (SmoothQuant's dynamic per-token scheme).

``int8_quantize_weight(w)`` gives the round-to-nearest symmetric per-channel codes and scales of a
16/32-bit weight; ``int8_pack_linear_weight(codes)`` lays the codes out for the kernel once;
``int8_linear(x, packed, comp, w_scale, bias)`` computes ``out [M, N]``, per activation group a of
``int8_activation_group(K)`` inputs (the largest of 256, 192, 128, 64 dividing K, else K):

    s_x[m, a] = max |x[m, a]| / 127 (1 for a zero group),  q_x = round_half_even(x / s_x)
    out[m, n] = (sum_a fma(float(q_x[m, a] . codes[n, a]), s_x[m, a], .)) * w_scale[n] + bias[n]

exact int32 sums per group (AVX-512 VNNI where the build has it, else a portable loop), float32
across groups, one rounding to the out dtype. Bad arguments raise ``ValueError`` naming the bad
value.
"""

from __future__ import annotations

import torch

from pagedllm import _C
from pagedllm.ops import _view  # defined before pagedllm.ops imports this module


def int8_linear_vnni() -> bool:
    """Whether int8_linear runs the AVX-512 VNNI kernel here (else a portable loop, slowly)."""
    return bool(_C.int8_linear_vnni())


def int8_activation_group(in_features: int) -> int:
    """Activation elements per scale for in_features inputs (the largest of 256, 192, 128, 64 that
    divides it, else in_features)."""
    return int(_C.int8_activation_group(int(in_features)))


def int8_quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [N, K], scale float32 [N]) of weight [N, K]: per output channel, symmetric,
    round to nearest even: scale = max_k |w[n, k]| / 127 (1 for a zero row), codes = round(w /
    scale) in [-127, 127]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale.contiguous()


def int8_pack_linear_weight(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int8 [N/16, K/4, 16, 4], comp int32 [K / group, N]) of codes int8 [N, K] (N % 16 ==
    0, K % 4 == 0; ValueError otherwise); group = int8_activation_group(K)."""
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        raise ValueError(f"int8_pack_linear_weight: codes must be a 2-D int8 tensor [out_features, in_features], "
                         f"got {getattr(codes, 'shape', type(codes).__name__)}")
    n, k = codes.shape
    packed = torch.empty((max(n // 16, 1), max(k // 4, 1), 16, 4), dtype=torch.int8)
    group = int(_C.int8_activation_group(k)) if k > 0 else 1
    comp = torch.empty((max(k // group, 1), n), dtype=torch.int32)
    _C.int8_pack_linear_weight(_view(packed), _view(comp), _view(codes.contiguous()))
    return packed, comp


def int8_linear(x: torch.Tensor, packed: torch.Tensor, comp: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out [M, N] (x's dtype, or out_dtype, or the given out: bfloat16 / float32) of x [M, K]
    (bfloat16 / float32, contiguous last dimension) and the packed weight (module docstring)."""
    if out is None:
        out = torch.empty((x.shape[0], packed.shape[0] * 16), dtype=out_dtype or x.dtype)
    _C.int8_linear(_view(out), _view(x), _view(packed), _view(comp), _view(w_scale),
                   None if bias is None else _view(bias))
    return out
