"""Weight-only quantized (WOQ) weights: the one form every integer format pagedllm reads is
converted to, exactly, and the linear method that computes with it.

A ``QuantizedWeight`` of an [N, K] weight holds integer ``codes`` [N, K] (bits 8: int8; bits 4:
uint8 in [0, 15]), a float32 ``scale`` [N, K / group_size] and optionally a float32 ``min`` of the
same shape:

    w[n, k] = scale[n, k // group_size] * codes[n, k] + min[n, k // group_size]

GGUF's Q8_0 is (int8 codes, group 32, no min); Q4_0 is (q, 32, scale d, min -8 d); Q4_1 (q, 32, d, m);
Q4_K (q, 32, d * sc_j, -dmin * m_j); Q6_K (q - 32 as int8, 16, d * sc_j); GPTQ / AWQ
w = s * (q - z) is (q, group, s, -s z); online int4 (quantization/int4.py) is round-to-nearest with
a min. ``WoqLinearMethod`` packs the codes once and computes ``x @ w^T + bias`` on the CPU: for
float32 models with pagedllm.ops.woq_linear (float activations, no activation quantization: within
float32 rounding of the dequantized weights); for bfloat16 models, where the build has AVX-512
VNNI, with pagedllm.ops.woq_vnni_linear (activations quantized to int8 per token and weight group,
integer dot products: about 4x the multiply-adds per instruction; PAGEDLLM_WOQ_VNNI=0 keeps the
float kernel).

Parts of one fused projection (q, k, v; gate, up) may come in different formats (a GGUF
Q4_K_M file keeps v in Q6_K): ``common_form`` re-expresses them exactly in one (8-bit codes when
any part has them, the smallest group, a zero min where a part had none) so that they stack.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pagedllm import ops
from pagedllm.model_executor.layers.linear_method import LinearMethodBase, _refuse


@dataclass
class QuantizedWeight:
    codes: torch.Tensor                 # [N, K] int8 (bits 8) or uint8 in [0, 15] (bits 4)
    bits: int
    group_size: int
    scale: torch.Tensor                 # float32 [N, K / group_size]
    min: Optional[torch.Tensor] = None  # float32 [N, K / group_size] or None
    #: where it came from, for the start-up log ("Q4_1", "gptq", "int4")
    source: str = ""

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.bits not in (4, 8):
            raise ValueError(f"QuantizedWeight: bits must be 4 or 8, got {self.bits}")
        want = torch.int8 if self.bits == 8 else torch.uint8
        if self.codes.dtype != want:
            raise ValueError(f"QuantizedWeight: {self.bits}-bit codes must be {want}, got {self.codes.dtype}")
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"QuantizedWeight: group_size={self.group_size} does not divide in_features={k}")
        shape = (n, k // self.group_size)
        for name, t in (("scale", self.scale), ("min", self.min)):
            if t is not None and (tuple(t.shape) != shape or t.dtype != torch.float32):
                raise ValueError(f"QuantizedWeight: {name} must be float32 {shape}, got {t.dtype} {tuple(t.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in `dtype` (computed in float32, or in float64 for float64): scale *
        codes + min, as the formats' reference dequantizers compute it."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        n, k = self.codes.shape
        c = self.codes.to(work).view(n, -1, self.group_size)
        w = c * self.scale.to(work)[..., None]
        if self.min is not None:
            w = w + self.min.to(work)[..., None]
        return w.view(n, k).to(dtype)

    def with_form(self, bits: int, group_size: int, with_min: bool) -> "QuantizedWeight":
        """The same weight, exactly, with 8-bit codes (when bits is 8), a smaller group (dividing
        this one: scales repeated) or a zero min added."""
        codes, scale, mn = self.codes, self.scale, self.min
        if bits == 8 and self.bits == 4:
            codes = codes.to(torch.int8)
        elif bits != self.bits:
            raise ValueError(f"QuantizedWeight: cannot narrow {self.bits}-bit codes to {bits} bits")
        if group_size != self.group_size:
            if self.group_size % group_size:
                raise ValueError(f"QuantizedWeight: group {group_size} does not divide group {self.group_size}")
            rep = self.group_size // group_size
            scale = scale.repeat_interleave(rep, dim=1)
            mn = None if mn is None else mn.repeat_interleave(rep, dim=1)
        if with_min and mn is None:
            mn = torch.zeros_like(scale)
        return QuantizedWeight(codes, bits, group_size, scale.contiguous(), None if mn is None else mn.contiguous(),
                               self.source)


def common_form(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """The parts re-expressed in one form (module docstring): max bits, gcd of group sizes, a min
    if any part has one."""
    bits = max(p.bits for p in parts)
    group = 0
    for p in parts:
        group = math.gcd(group, p.group_size)
    if bits == 4 and group % 2:
        bits = 8  # the 4-bit layout pairs inputs within a group
    with_min = any(p.min is not None for p in parts)
    return [p.with_form(bits, group, with_min) for p in parts]


def fit_group(qw: QuantizedWeight, inputs: int) -> QuantizedWeight:
    """qw with a group that divides `inputs` (a rank's slice of K), the scale repeated: exact."""
    g = math.gcd(qw.group_size, inputs)
    return qw if g == qw.group_size else qw.with_form(qw.bits, g, qw.min is not None)


def load_layer(layer: nn.Module, parts: dict, what: str) -> QuantizedWeight:
    """This rank's QuantizedWeight of `layer` (a LinearBase) from the checkpoint's whole parts
    {shard_id: QuantizedWeight} (shard_id None for an unfused layer), cut and stacked by the layer's
    own weight_loader exactly as a 16/32-bit weight would be; a group that this rank's input slice
    would split is re-expressed with a smaller one first (fit_group). ValueError when a part's
    shape is wrong."""
    keys = list(parts)
    inputs = layer.input_size_per_partition
    formed = dict(zip(keys, common_form([fit_group(parts[k], inputs) for k in keys])))
    first = formed[keys[0]]
    bits, group, with_min = first.bits, first.group_size, first.min is not None
    out_pp, in_pp = layer.output_size_per_partition, layer.input_size_per_partition
    codes = torch.empty((out_pp, in_pp), dtype=first.codes.dtype)
    scale = torch.empty((out_pp, in_pp // group), dtype=torch.float32)
    mn = torch.empty_like(scale) if with_min else None
    for key, qw in formed.items():
        try:
            layer.weight_loader(codes, qw.codes, key)
            layer.weight_loader(scale, qw.scale, key)
            if mn is not None:
                layer.weight_loader(mn, qw.min, key)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from exc
    return QuantizedWeight(codes, bits, group, scale, mn, "+".join(sorted({p.source for p in parts.values()})))


class WoqLinearMethod(LinearMethodBase):
    """x @ (scale * codes + min)^T + bias on the CPU (module docstring), for one layer's
    QuantizedWeight (this rank's). Needs out_features % 16 == 0."""

    def __init__(self, qweight: QuantizedWeight):
        self.qweight = qweight

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qw = self.qweight
        if qw.shape[0] % 16:
            raise ValueError(f"{type(layer).__name__}: weight-only quantized kernels need out_features % 16 == 0, "
                             f"got {qw.shape[0]}")
        if layer.weight is not None and tuple(layer.weight.shape) != tuple(qw.shape):
            raise ValueError(f"{type(layer).__name__}: quantized weight {tuple(qw.shape)} does not match the layer's "
                             f"{tuple(layer.weight.shape)}")
        dtype = layer.weight.dtype if layer.weight is not None else torch.float32
        #: bfloat16 models: int8 activations on AVX-512 VNNI (the float kernel keeps float32 models exact)
        self.vnni = (dtype == torch.bfloat16 and ops.woq_vnni_available() and qw.group_size % 4 == 0
                     and qw.group_size <= 65536 and os.environ.get("PAGEDLLM_WOQ_VNNI", "1") != "0")
        layer.woq_packed = (ops.woq_vnni_pack_weight if self.vnni else ops.woq_pack_weight)(qw.codes, qw.bits)
        layer.woq_scale_t = qw.scale.t().contiguous()
        layer.woq_min_t = None if qw.min is None else qw.min.t().contiguous()
        bias = layer.apply_bias()
        layer.woq_bias = None if bias is None else bias.detach().float().contiguous()
        layer.out_features = qw.shape[0]
        layer.weight = None
        self.qweight = QuantizedWeight(qw.codes[:0], qw.bits, qw.group_size, qw.scale[:0],
                                       None if qw.min is None else qw.min[:0], qw.source)  # the form, not the data
        self.bits = qw.bits

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None, **fusion) -> torch.Tensor:
        if fusion:
            _refuse(layer, fusion, "the weight-only quantized kernel")
        if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
            x = x.reshape(-1, x.shape[-1]).contiguous()
        kernel = ops.woq_vnni_linear if self.vnni else ops.woq_linear
        return kernel(x, layer.woq_packed, self.bits, layer.woq_scale_t, layer.woq_min_t, layer.woq_bias, out=out)

    @staticmethod
    def weight_bytes(layer: nn.Module) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (layer.woq_packed, layer.woq_scale_t, layer.woq_min_t, layer.woq_bias) if t is not None)
