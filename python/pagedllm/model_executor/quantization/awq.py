"""AWQ checkpoints (config.json ``quantization_config.quant_method == "awq"``) on the CPU: each
decoder projection's packed 4-bit weight converted exactly to a QuantizedWeight (woq.py) and
computed by the weight-only kernel.

Layout of one linear module of N outputs and K inputs in AutoAWQ's GEMM format (``version``
"gemm"; awq/modules/linear/gemm.py ``WQLinear_GEMM.from_linear`` packs it, and
awq/utils/packing_utils.py ``dequantize_gemm`` is the reference dequantization), G = K / group_size:

- ``qweight`` int32 [K, N / 8]: packed along N, eight 4-bit values per word in AWQ's interleaved
  order: nibble i (bits 4 i .. 4 i + 3) of word c holds output 8 c + AWQ_ORDER[i],
  AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7];
- ``qzeros`` int32 [G, N / 8]: the zero points, packed the same way;
- ``scales`` fp16 [G, N].

    w[n, k] = scales[g, n] * (q[k, n] - z[g, n]),   g = k // group_size

Supported: 4 bits, zero_point true, version "gemm" (either case), any group_size dividing K
(-1: one group per row). Refused (ValueError naming the value): other bits, zero_point false,
other versions (GEMV's layout packs along K; Marlin's is its own).

The conversion is exact: with fp16 scales every ``scales * (q - z)`` is a float32 without
rounding, and QuantizedWeight.dequantize() gives exactly it.
"""

from __future__ import annotations

import torch

from pagedllm.model_executor.quantization.woq import QuantizedWeight
from pagedllm.model_executor.quantization.woq_checkpoint import (
    CheckpointWoqConfig,
    require,
    unpack_int32,
    zero_point_form,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: output j of a word is its nibble AWQ_REVERSE_ORDER[j]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
SUPPORTED_VERSIONS = ("gemm",)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C * 8] in output order of AWQ's packed int32 [R, C] (module docstring)."""
    nibbles = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)
    return nibbles[:, :, list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)


def awq_to_quantized(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                     module: str = "AWQ module") -> QuantizedWeight:
    """The QuantizedWeight [N, K] of one AWQ GEMM linear module (module docstring); group_size -1
    is one group per row. ValueError on shapes that do not fit, naming `module`."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = k if group_size == -1 else group_size
    if group <= 0 or k % group:
        raise ValueError(f"AWQ {module}: group_size={group_size} does not divide its {k} inputs")
    g = k // group
    if tuple(scales.shape) != (g, n) or tuple(qzeros.shape) != (g, n // 8):
        raise ValueError(f"AWQ {module}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit 4-bit codes of [{n}, {k}] in groups of {group}")
    q = unpack_awq(qweight).t()  # [N, K]
    z = unpack_awq(qzeros).t()   # [N, G]
    return zero_point_form(q, z, scales.to(torch.float32).t(), 4, group, "awq")


class AWQConfig(CheckpointWoqConfig):
    """An AWQ checkpoint's quantization_config (module docstring): transformers' keys (bits,
    group_size) or AutoAWQ's (w_bit, q_group_size)."""

    name = "awq"
    leaves = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int):
        super().__init__()
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: dict) -> "AWQConfig":
        """From config.json's quantization_config; ValueError naming an unsupported value and what is
        supported."""
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"AWQ bits={bits!r} is not supported: supported bits are [4]")
        group = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group, int) or (group <= 0 and group != -1):
            raise ValueError(f"AWQ group_size={group!r} is not supported: a positive number of inputs, or -1 "
                             "(per channel)")
        zero_point = config.get("zero_point", True)
        if zero_point is not True:
            raise ValueError(f"AWQ zero_point={zero_point!r} is not supported: supported zero_point=True")
        version = str(config.get("version", "gemm")).lower()
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"AWQ version={config.get('version')!r} is not supported: supported versions are "
                             f"{list(SUPPORTED_VERSIONS)}")
        return cls(group)

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        require(module, tensors, self.leaves, "AWQ")
        return awq_to_quantized(tensors["qweight"], tensors["qzeros"], tensors["scales"], self.group_size, module)

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"awq (4-bit GEMM, {group}, zero points; {self.describe_forms()}; weight-only CPU kernel)"
