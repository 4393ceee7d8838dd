"""GPTQ checkpoints (config.json ``quantization_config.quant_method == "gptq"``) on the CPU: each
decoder projection's packed integer weight converted exactly to a QuantizedWeight (woq.py) and
computed by the weight-only kernel.

Layout of one linear module of N outputs and K inputs, b = bits, G = K / group_size groups
(AutoGPTQ's QuantLinear, auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py, ``pack`` and the
torch path of ``forward``; the same in GPTQ-for-LLaMa, GPTQModel, transformers/optimum):

- ``qweight`` int32 [K * b / 32, N]: packed along K, low bits first: input k of output n is bits
  b * (k % (32 / b)) .. of qweight[k // (32 / b), n];
- ``qzeros`` int32 [G, N * b / 32]: the zero points, packed along N the same way;
- ``scales`` fp16 [G, N];
- ``g_idx`` int32 [K]: the group of each input; k // group_size unless the checkpoint was made
  with act-order (desc_act), which the kernel's contiguous groups cannot express: refused.

    w[n, k] = scales[g, n] * (q[k, n] - z[g, n]),   g = k // group_size

where the zero point z is the stored value plus 1 in the classic format (``checkpoint_format``
"gptq", the default: AutoGPTQ's pack stores ``zeros - 1`` and its forward adds the 1 back) and the
stored value itself in GPTQModel's "gptq_v2". Symmetric checkpoints have z = 2^(b-1) everywhere.
A classic-format stored zero of 2^b - 1 gives z = 2^b here (as vLLM's GPTQ kernels compute it);
AutoGPTQ's torch forward masks it to 0 instead. Only a true zero point of 0 is stored so, and
AutoGPTQ's own pack cannot write it (its - 1 underflows into the neighbouring field).

Supported: bits 4 and 8, any group_size dividing K (-1: one group per row, "per channel"),
symmetric or not, desc_act false, both checkpoint formats. Refused (ValueError naming the value):
other bits (2, 3), desc_act true (or a g_idx that is not k // group_size), a quantized LM head
(``lm_head``), GPTQModel's per-module ``dynamic`` overrides, other checkpoint formats (marlin).

The conversion is exact: with fp16 scales every ``scales * (q - z)`` is a float32 without
rounding, and QuantizedWeight.dequantize() gives exactly it (AutoGPTQ computes the same in fp16,
which rounds it).
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.model_executor.quantization.woq import QuantizedWeight
from pagedllm.model_executor.quantization.woq_checkpoint import (
    CheckpointWoqConfig,
    check_trivial_g_idx,
    require,
    unpack_int32,
    zero_point_form,
)

SUPPORTED_BITS = (4, 8)
#: checkpoint_format -> what is added to a stored zero point
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}


def gptq_to_quantized(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      g_idx: Optional[torch.Tensor], bits: int, group_size: int,
                      checkpoint_format: str = "gptq", module: str = "GPTQ module") -> QuantizedWeight:
    """The QuantizedWeight [N, K] of one GPTQ linear module (module docstring); group_size -1 is
    one group per row. ValueError on shapes that do not fit, naming `module`."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"GPTQ bits={bits} is not supported: supported {list(SUPPORTED_BITS)}")
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format={checkpoint_format!r} is not supported: supported "
                         f"{list(CHECKPOINT_FORMATS)}")
    per = 32 // bits
    k, n = qweight.shape[0] * per, qweight.shape[1]
    group = k if group_size == -1 else group_size
    if group <= 0 or k % group:
        raise ValueError(f"GPTQ {module}: group_size={group_size} does not divide its {k} inputs")
    g = k // group
    if tuple(scales.shape) != (g, n) or tuple(qzeros.shape) != (g, n // per) or n % per:
        raise ValueError(f"GPTQ {module}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit {bits}-bit codes of [{n}, {k}] in groups of {group}")
    check_trivial_g_idx(module, g_idx, k, group, "GPTQ")
    q = unpack_int32(qweight, bits, dim=0).t()                                        # [N, K]
    z = unpack_int32(qzeros, bits, dim=1).t() + CHECKPOINT_FORMATS[checkpoint_format]  # [N, G]
    return zero_point_form(q, z, scales.to(torch.float32).t(), bits, group, "gptq")


def _flag(config: dict, key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"GPTQ quantization_config {key}={value!r} must be true or false")
    return value


class GPTQConfig(CheckpointWoqConfig):
    """A GPTQ checkpoint's quantization_config (module docstring)."""

    name = "gptq"
    leaves = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, bits: int, group_size: int, sym: bool = True, checkpoint_format: str = "gptq"):
        super().__init__()
        self.bits, self.group_size, self.sym, self.checkpoint_format = bits, group_size, sym, checkpoint_format

    @classmethod
    def from_config(cls, config: dict) -> "GPTQConfig":
        """From config.json's quantization_config; ValueError naming an unsupported value and what is
        supported."""
        bits = config.get("bits", 4)
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"GPTQ bits={bits!r} is not supported: supported bits are {list(SUPPORTED_BITS)}")
        group = config.get("group_size", 128)
        if not isinstance(group, int) or (group <= 0 and group != -1):
            raise ValueError(f"GPTQ group_size={group!r} is not supported: a positive number of inputs, or -1 "
                             "(per channel)")
        if _flag(config, "desc_act", False):
            raise ValueError("GPTQ desc_act=True (act-order: inputs permuted by g_idx) is not supported: "
                             "supported desc_act=False")
        if _flag(config, "lm_head", False):
            raise ValueError("GPTQ lm_head=True (a quantized LM head) is not supported: the LM head must be "
                             "16/32-bit (lm_head=False)")
        if config.get("dynamic"):
            raise ValueError(f"GPTQ dynamic={config['dynamic']!r} (per-module overrides) is not supported: "
                             "supported dynamic=None")
        if config.get("is_marlin_format"):
            raise ValueError("GPTQ is_marlin_format=True is not supported: supported checkpoint formats are "
                             f"{list(CHECKPOINT_FORMATS)}")
        fmt = config.get("checkpoint_format") or "gptq"
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(f"GPTQ checkpoint_format={fmt!r} is not supported: supported "
                             f"{list(CHECKPOINT_FORMATS)}")
        return cls(bits, group, _flag(config, "sym", True), fmt)

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        require(module, tensors, ("qweight", "qzeros", "scales"), "GPTQ")
        return gptq_to_quantized(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"),
                                 self.bits, self.group_size, self.checkpoint_format, module)

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        return (f"gptq ({self.bits}-bit, {group}, {'symmetric' if self.sym else 'asymmetric'}, checkpoint format "
                f"{self.checkpoint_format}; {self.describe_forms()}; weight-only CPU kernel)")
