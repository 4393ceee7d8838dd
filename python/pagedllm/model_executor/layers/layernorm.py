"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"), rounded as Hugging
Face's LlamaRMSNorm: x / sqrt(mean(x^2) + eps) in float32, cast back to the model dtype, then
multiplied by the weight in the model dtype. Every tensor-parallel rank holds all of it (it
normalises the replicated hidden state)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import ops


class RMSNorm(nn.Module):
    """x [..., N] -> [..., N]. Where pagedllm.ops has the fused layer ops (CPU: float32, bfloat16;
    CUDA: also float16) one kernel does it, with the same roundings."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.fused = ops.layer_ops_supported(device, dtype)

    def fp8_applies(self, x: torch.Tensor) -> bool:
        """Whether forward / add_and_norm can also give the output's per-token FP8 codes (fp8=True):
        the fused CUDA kernel."""
        return self.fused and x.is_cuda

    def forward(self, x: torch.Tensor, fp8: bool = False):
        """fp8 (where fp8_applies): the output's per-token FP8 codes (ops.Fp8Rows) instead of it."""
        if fp8:
            if not self.fp8_applies(x):
                raise ValueError("RMSNorm: fp8 output needs the fused CUDA kernel")
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return ops.rms_norm(torch.empty(rows.shape, dtype=x.dtype, device=x.device), rows, self.weight,
                                self.eps, fp8=True)[1]
        if self.fused:
            rows = x.reshape(-1, x.shape[-1])
            if rows.is_cuda and not rows.is_contiguous():  # the CUDA kernel takes contiguous rows
                rows = rows.contiguous()
            return ops.rms_norm(torch.empty(rows.shape, dtype=x.dtype, device=x.device), rows, self.weight,
                                self.eps).view(x.shape)
        dtype = x.dtype
        h = x.float()
        if h.is_cuda:  # one fused kernel instead of five (fewer nodes in a decode CUDA graph)
            h = F.rms_norm(h, (h.shape[-1],), eps=self.eps)
        else:
            variance = h.pow(2).mean(-1, keepdim=True)
            h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, fp8: bool = False) -> tuple:
        """(rms_norm(residual + x), residual + x) for x, residual [T, N]; the fused op works in place
        (x and residual are overwritten), HF's order of roundings either way. fp8 (where
        fp8_applies): the first element is the norm's per-token FP8 codes (ops.Fp8Rows)."""
        if fp8:
            if not self.fp8_applies(x):
                raise ValueError("RMSNorm: fp8 output needs the fused CUDA kernel")
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, fp8=True), residual
        if self.fused:
            ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self.forward(residual), residual
