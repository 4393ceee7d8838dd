"""4-bit weight-only quantized projections on CUDA: a QuantizedWeight (woq.py) with 4-bit codes
and a group of 32, 64, 128 or 256 inputs, computed by PyTorch's int4 "tinygemm" kernels
(torch.ops.aten._weight_int4pack_mm: bfloat16 activations, int4 weights dequantized in registers;
the kernel torchao's int4 weight-only scheme runs) for steps of at most TINYGEMM_MAX_TOKENS rows,
and above that by dequantizing the weight to bfloat16 and one cuBLAS GEMM (F.linear), which is
compute-bound there anyway (pagedllm.ops.int4_dequantize: one kernel, the bfloat16 weight
written once per call). The codes are held twice, in tinygemm's tiles and plainly for the
dequantizing kernel: one byte per weight (weight_bytes counts both).

tinygemm computes w = (q - 8) * scale + zero with bfloat16 scale and zero per (group, output):
a QuantizedWeight's w = s q + m is s (q - 8) + (m + 8 s), so zero = m + 8 s, both rounded to
bfloat16 (the one approximation here: relative 2^-9 of each group's scale and offset).
Layouts: _convert_weight_to_int4pack takes uint8 [N, K / 2] holding inputs 2j in the high nibble
and 2j + 1 in the low one (torchao's packing for it), with inner_k_tiles = 8 (K a multiple of 256)
or 4 / 2 (K a multiple of 128 / 64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import ops
from pagedllm.model_executor.layers.linear_method import LinearMethodBase, _refuse
from pagedllm.model_executor.quantization.woq import QuantizedWeight

#: steps above this many rows dequantize and run cuBLAS
TINYGEMM_MAX_TOKENS = 32
TINYGEMM_GROUPS = (32, 64, 128, 256)  # (int4_dequantize needs multiples of 16: all of them)


def tinygemm_applies(qw: QuantizedWeight) -> bool:
    n, k = qw.shape
    return qw.bits == 4 and qw.group_size in TINYGEMM_GROUPS and n % 8 == 0 and k % 64 == 0


def woq_method_for(layer: nn.Module, qw: QuantizedWeight, what: str) -> LinearMethodBase:
    """The linear method of a layer's QuantizedWeight on the layer's device: the CPU's
    WoqLinearMethod, or on CUDA this module's tinygemm method (4-bit codes, groups of 32-256; a
    ValueError naming the form otherwise)."""
    from pagedllm.model_executor.quantization.woq import WoqLinearMethod

    device = layer.weight.device if layer.weight is not None else torch.device("cpu")
    if device.type != "cuda":
        return WoqLinearMethod(qw)
    if not tinygemm_applies(qw):
        raise ValueError(f"{what}: {qw.bits}-bit weights in groups of {qw.group_size} ({tuple(qw.shape)}) run on the "
                         f"CPU only; CUDA takes 4-bit codes in groups of {list(TINYGEMM_GROUPS)}, out_features % 8 == 0 "
                         "and in_features % 64 == 0")
    return TinyGemmInt4LinearMethod(qw)


class TinyGemmInt4LinearMethod(LinearMethodBase):
    """(module docstring) for one layer's QuantizedWeight (this rank's), on the layer's CUDA device."""

    def __init__(self, qweight: QuantizedWeight | None):
        self.qweight = qweight

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qw = self.qweight
        if not tinygemm_applies(qw):
            raise ValueError(f"{type(layer).__name__}: CUDA int4 needs 4-bit codes, a group of {TINYGEMM_GROUPS}, "
                             f"out_features % 8 == 0 and in_features % 64 == 0; got {qw.bits} bits, group "
                             f"{qw.group_size}, shape {tuple(qw.shape)}")
        device = layer.weight.device if layer.weight is not None else layer.bias.device
        n, k = qw.shape
        codes = qw.codes.to(device)
        nibbles = (codes[:, 0::2] << 4 | codes[:, 1::2]).contiguous()  # uint8 [N, K/2]
        tiles = 8 if k % 256 == 0 else 4 if k % 128 == 0 else 2
        layer.int4_packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, tiles)
        layer.int4_nibbles = nibbles  # for the dequantizing path of large steps
        scale = qw.scale.to(device)
        zero = qw.min.to(device) + 8 * scale if qw.min is not None else 8 * scale
        layer.int4_scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # [G, N, 2]
        layer.int4_group = qw.group_size
        bias = layer.apply_bias()
        layer.int4_bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()
        layer.out_features = n
        layer.weight = None
        self.qweight = None

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight tinygemm applies, [N, K] (q - 8) * scale + zero from the bfloat16 scale and zero."""
        p = layer.int4_nibbles
        n = p.shape[0]
        q = torch.stack([p >> 4, p & 15], dim=-1).view(n, -1).float() - 8.0
        sz = layer.int4_scale_zero.float()  # [G, N, 2]
        g = layer.int4_group
        s = sz[..., 0].t().repeat_interleave(g, dim=1)
        z = sz[..., 1].t().repeat_interleave(g, dim=1)
        return (q * s + z).to(dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None, **fusion) -> torch.Tensor:
        if fusion:
            _refuse(layer, fusion, "the int4 kernel")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{type(layer).__name__}: CUDA int4 takes bfloat16 activations, got {x.dtype}")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] <= TINYGEMM_MAX_TOKENS:
            y = torch.ops.aten._weight_int4pack_mm(x2.contiguous(), layer.int4_packed, layer.int4_group,
                                                   layer.int4_scale_zero)
            if layer.int4_bias is not None:
                y = y + layer.int4_bias
        else:
            y = F.linear(x2, ops.int4_dequantize(layer.int4_nibbles, layer.int4_scale_zero, layer.int4_group),
                         layer.int4_bias)
        y = y.view(*shape[:-1], layer.out_features)
        return y if out is None else out.copy_(y)

    @staticmethod
    def weight_bytes(layer: nn.Module) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (layer.int4_packed, layer.int4_nibbles, layer.int4_scale_zero, layer.int4_bias)
                   if t is not None)
