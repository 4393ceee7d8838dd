"""Fused elementwise ops of a decoder layer (``cpp/include/pagedllm/layer_ops.h``), called with
torch tensors: RMSNorm, RMSNorm with the residual add, SiLU-and-mul, rotary embedding.

Math in float32 with results rounded where Hugging Face transformers' eager modules round (see
the header), so a model using them matches HF. float32 and bfloat16 on the CPU; CUDA tensors
raise ValueError until CUDA versions exist (``layer_ops_supported`` says which device has them).
Bad arguments raise ``ValueError`` naming the bad value.
"""

from __future__ import annotations

import torch

from pagedllm import _C
from pagedllm.ops import _view  # defined before pagedllm.ops imports this module


def layer_ops_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the fused layer ops run on ``device`` in ``dtype``."""
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``out [T, N] = x [T, N] / sqrt(mean(x^2) + eps) * weight [N]``; returns ``out``."""
    _C.rms_norm(_view(out), _view(x), _view(weight), float(eps))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual += x`` then ``x = rms_norm(residual) * weight`` (both ``[T, N]``)."""
    _C.fused_add_rms_norm(_view(x), _view(residual), _view(weight), float(eps))


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out [T, I] = silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]``; returns ``out``."""
    _C.silu_and_mul(_view(out), _view(x))
    return out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Rotate ``query [T, Hq, D]`` and ``key [T, Hkv, D]`` in place (GPT-NeoX "rotate half"
    layout) by ``positions`` (int64 ``[T]``). ``cos_sin_cache [max_position, R]``: cos of the R/2
    frequencies, then their sin, in the query's dtype; features ``>= R`` are left as they are."""
    _C.rotary_embedding(_view(positions), _view(query), _view(key), _view(cos_sin_cache))
