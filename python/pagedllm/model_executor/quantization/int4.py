"""quantization="int4": online weight-only int4. At load every decoder projection's 16/32-bit
weight becomes 4-bit codes with a float32 scale and zero point per output row and group of
GROUP_SIZE inputs (asymmetric round to nearest, as AWQ's and GPTQ's integer grid:
Lin et al. 2024, "AWQ", section 3; without their calibration), computed by the weight-only kernel
(woq.py):

    s = (max(w_g, 0) - min(w_g, 0)) / 15,  z = round(-min(w_g, 0) / s),  q = clamp(round(w / s) + z, 0, 15)
    w ~ s * (q - z)      (a QuantizedWeight with scale s, min -s z)

The grid holds 0 exactly (z is an integer). Under tensor parallelism each rank quantizes its own
shard (a row-parallel rank's groups lie within its slice: GROUP_SIZE must divide it).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model_executor.layers.linear_method import LinearMethodBase
from pagedllm.model_executor.quantization.base import QuantizationConfig
from pagedllm.model_executor.quantization.woq import QuantizedWeight, WoqLinearMethod
from pagedllm.model_executor.quantization.woq_cuda import TinyGemmInt4LinearMethod

GROUP_SIZE = 128


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> QuantizedWeight:
    """The int4 QuantizedWeight of weight [N, K] (module docstring); a K that group_size does not
    divide takes the largest of 64, 32 that does, else one group per row."""
    n, k = weight.shape
    if k % group_size:
        group_size = next((g for g in (64, 32) if k % g == 0), k)
    w = weight.detach().float().view(n, k // group_size, group_size)
    lo = w.amin(dim=2).clamp(max=0.0)
    hi = w.amax(dim=2).clamp(min=0.0)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp_(0, 15)
    codes = (torch.round(w / scale[..., None]) + zero[..., None]).clamp_(0, 15).to(torch.uint8).view(n, k)
    return QuantizedWeight(codes, 4, group_size, scale.contiguous(), (-scale * zero).contiguous(), "int4")


class Int4Config(QuantizationConfig):
    name = "int4"

    def linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase:
        device = layer.weight.device if layer.weight is not None else torch.device("cpu")
        return _OnlineInt4CudaMethod() if device.type == "cuda" else _OnlineInt4Method()

    def describe(self) -> str:
        return (f"int4 (online: 4-bit weights, group {GROUP_SIZE}, asymmetric round-to-nearest; weight-only kernels: "
                "the CPU's woq_linear, CUDA's tinygemm)")


class _QuantizeAtLoad:
    """Mixin of a method over a QuantizedWeight: quantize_int4 of the loaded weight (on its device)
    becomes that QuantizedWeight, then the method computes as it does."""

    def __init__(self):
        super().__init__(None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.qweight = quantize_int4(layer.weight)
        super().process_weights_after_loading(layer)


class _OnlineInt4Method(_QuantizeAtLoad, WoqLinearMethod):
    pass


class _OnlineInt4CudaMethod(_QuantizeAtLoad, TinyGemmInt4LinearMethod):
    pass
