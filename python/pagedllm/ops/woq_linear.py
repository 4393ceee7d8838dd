"""Projections with weight-only quantized weights on the CPU (``cpp/include/pagedllm/cpu_woq_linear.h``),
called with torch tensors. A weight is integer codes [N, K] with a float32 scale, and optionally a
float32 offset ``min``, per output row and group of ``K / G`` consecutive inputs:

    w[n, k] = scale[n, k // group] * codes[n, k] + min[n, k // group]
    out = x @ w^T + bias      (x widened to float32, float32 FMAs, one rounding to out's dtype)

``woq_pack_weight(codes, bits)`` lays the codes out for the kernel once (bits 8: int8 codes;
bits 4: uint8 codes in [0, 15]); ``woq_linear(x, packed, bits, scale_t, min_t, bias)`` takes the
scales transposed, float32 [G, N] contiguous. Bad arguments raise ``ValueError`` naming the value.
"""

from __future__ import annotations

import torch

from pagedllm import _C
from pagedllm.ops import _view  # defined before pagedllm.ops imports this module


def _check_codes(op: str, codes, bits: int) -> tuple[int, int]:
    """(N, K) of codes, a 2-D tensor, for `bits` 4 or 8; ValueError naming the bad value."""
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        raise ValueError(f"{op}: codes must be a 2-D tensor [out_features, in_features], "
                         f"got {getattr(codes, 'shape', type(codes).__name__)}")
    if bits not in (4, 8):
        raise ValueError(f"{op}: bits must be 4 or 8, got {bits}")
    return tuple(codes.shape)


def _run(kernel, x, packed, bits, scale_t, min_t, bias, out, out_dtype) -> torch.Tensor:
    """kernel(out, x, packed, bits, scale_t, min_t, bias) into out (new: [M, N] in out_dtype or x's)."""
    if out is None:
        out = torch.empty((x.shape[0], packed.shape[0] * 16), dtype=out_dtype or x.dtype)
    kernel(_view(out), _view(x), _view(packed), int(bits), _view(scale_t), None if min_t is None else _view(min_t),
           None if bias is None else _view(bias))
    return out


def woq_linear_avx512() -> bool:
    """Whether woq_linear runs its AVX-512 kernel here (else a portable loop)."""
    return bool(_C.woq_linear_avx512())


def woq_pack_weight(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel layout of codes [N, K] (bits 8: int8; bits 4: uint8 in [0, 15]; N % 16 == 0,
    K even for bits 4): int8 [N/16, K, 16] or uint8 [N/16, K/2, 16]. ValueError otherwise."""
    n, k = _check_codes("woq_pack_weight", codes, bits)
    dtype = torch.int8 if bits == 8 else torch.uint8
    packed = torch.empty((max(n // 16, 1), max(k if bits == 8 else k // 2, 1), 16), dtype=dtype)
    _C.woq_pack_weight(_view(packed), _view(codes.contiguous()), int(bits))
    return packed


def woq_linear(x: torch.Tensor, packed: torch.Tensor, bits: int, scale_t: torch.Tensor,
               min_t: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out [M, N] (x's dtype, out_dtype, or the given out: bfloat16 / float32) = x [M, K] times the
    dequantized weight (module docstring) + bias (float32 [N])."""
    return _run(_C.woq_linear, x, packed, bits, scale_t, min_t, bias, out, out_dtype)


def woq_vnni_available() -> bool:
    """Whether woq_vnni_linear runs here (a build with AVX-512 VNNI)."""
    return bool(_C.woq_vnni_available())


def woq_vnni_pack_weight(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The VNNI layout of codes [N, K] (bits 8: int8; bits 4: uint8 in [0, 15]; N % 16 == 0, K % 4
    == 0): uint8 [N/16, K/4, 64] (8 bits: code + 128) or [N/16, K/4, 32] (4 bits: rows c and c + 8
    of 16 in the low and high nibbles). ValueError otherwise."""
    n, k = _check_codes("woq_vnni_pack_weight", codes, bits)
    packed = torch.empty((max(n // 16, 1), max(k // 4, 1), 64 if bits == 8 else 32), dtype=torch.uint8)
    _C.woq_vnni_pack_weight(_view(packed), _view(codes.contiguous()), int(bits))
    return packed


def woq_vnni_linear(x: torch.Tensor, packed: torch.Tensor, bits: int, scale_t: torch.Tensor,
                    min_t: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out [M, N] of x [M, K] and the VNNI-packed weight: x quantized to int8 per token and per
    weight group (s = max|x_g| / 127, round half to even), exact int32 group sums, float32 scaling
    (cpp/include/pagedllm/cpu_woq_linear.h); scale_t / min_t float32 [G, N] as woq_linear's."""
    return _run(_C.woq_vnni_linear, x, packed, bits, scale_t, min_t, bias, out, out_dtype)

