"""CUDA kernels of the quantized linear methods (``cpp/include/pagedllm/quant_ops.h``), called with
torch tensors on the current stream:

- ``fp8_gemv(x, weight, scale, bias)``: ``x [M, K] @ (weight * scale[:, None])^T + bias`` for
  M <= FP8_GEMV_MAX_TOKENS rows of bfloat16 / float16 activations and a float8_e4m3fn weight
  [N, K] with a float32 scale per output row (quantization="fp8"'s decode path: the weight read
  once at the memory's speed, the activations not quantized).
- ``int4_dequantize(nibbles, scale_zero, group_size)``: the bfloat16 weight [N, K] of 4-bit codes
  (uint8 [N, K / 2], input 2j in the high nibble) with tinygemm's bfloat16 (scale, zero) [K / g, N, 2]:
  ``(q - 8) * scale + zero``.

Bad arguments raise ``ValueError`` naming the bad value.
"""

from __future__ import annotations

import torch

from pagedllm import _C
from pagedllm.ops import _stream, _view  # defined before pagedllm.ops imports this module

#: rows fp8_gemv takes at most
FP8_GEMV_MAX_TOKENS: int = int(_C.FP8_GEMV_MAX_TOKENS)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] in x's dtype (see the module docstring); weight float8_e4m3fn [N, K] contiguous."""
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _C.fp8_gemv(_view(out), _view(x), _view(weight.view(torch.uint8)), _view(scale),
                None if bias is None else _view(bias), _stream(x))
    return out


def int4_dequantize(nibbles: torch.Tensor, scale_zero: torch.Tensor, group_size: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The bfloat16 weight [N, K] (see the module docstring)."""
    if out is None:
        out = torch.empty((nibbles.shape[0], 2 * nibbles.shape[1]), dtype=torch.bfloat16, device=nibbles.device)
    _C.int4_dequantize(_view(out), _view(nibbles), _view(scale_zero), int(group_size), _stream(nibbles))
    return out
