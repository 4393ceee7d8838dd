"""quantization="int8": online W8A8 on the CPU. At load, every decoder projection's 16/32-bit
weight becomes int8 codes with a float32 scale per output channel (symmetric, round to nearest:
pagedllm.ops.int8_quantize_weight); each call quantizes its activations per token and runs
pagedllm.ops.int8_linear (AVX-512 VNNI; cpp/include/pagedllm/cpu_quant_linear.h). The LM head
and the embedding stay in the model dtype.

Under tensor parallelism each rank quantizes its own shard: column-parallel rows are whole, so
their scales are those of one rank; a row-parallel rank's scale covers its slice of each row.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm import ops
from pagedllm.model_executor.layers.linear_method import LinearMethodBase, _refuse
from pagedllm.model_executor.quantization.base import QuantizationConfig


class Int8Config(QuantizationConfig):
    name = "int8"

    def linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase:
        return Int8LinearMethod()

    def describe(self) -> str:
        return "int8 (online: per-channel int8 weights, per-token int8 activations, AVX-512 VNNI)" if \
            ops.int8_linear_vnni() else "int8 (online; this build has no AVX-512 VNNI: a portable loop)"


class Int8LinearMethod(LinearMethodBase):
    """W8A8 (module docstring). Needs out_features % 16 == 0 and in_features % 4 == 0."""

    @staticmethod
    def applies(weight: torch.Tensor) -> bool:
        return weight.shape[0] % 16 == 0 and weight.shape[1] % 4 == 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if not self.applies(weight):
            tp = getattr(layer, "tp", None)
            where = f" (tensor-parallel rank {tp.rank}'s shard)" if tp is not None and tp.world_size > 1 else ""
            raise ValueError(f"int8 quantization of {type(layer).__name__}: needs out_features % 16 == 0 and "
                             f"in_features % 4 == 0, got [{weight.shape[0]}, {weight.shape[1]}]{where}")
        codes, layer.int8_scale = ops.int8_quantize_weight(weight)
        layer.int8_packed, layer.int8_comp = ops.int8_pack_linear_weight(codes)
        bias = layer.apply_bias()
        layer.int8_bias = None if bias is None else bias.detach().float().contiguous()
        layer.out_features = weight.shape[0]
        layer.weight = None  # the 16/32-bit weight is no longer held

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None, **fusion) -> torch.Tensor:
        if fusion:
            _refuse(layer, fusion, "the int8 kernel")
        if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
            x = x.reshape(-1, x.shape[-1]).contiguous()
        return ops.int8_linear(x, layer.int8_packed, layer.int8_comp, layer.int8_scale, layer.int8_bias, out=out)

    @staticmethod
    def weight_bytes(layer: nn.Module) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (layer.int8_packed, layer.int8_comp, layer.int8_scale, layer.int8_bias) if t is not None)
