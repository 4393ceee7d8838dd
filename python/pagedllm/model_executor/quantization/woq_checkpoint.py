"""What the checkpoint-quantized weight-only formats (gptq.py, awq.py, compressed_tensors.py) share:
collecting each Hugging Face linear module's tensors during load_weights, and turning a decoder
projection's parts into one WoqLinearMethod (woq.py).

A format's config (a ``CheckpointWoqConfig``) names the tensors it stores per module (``leaves``,
e.g. GPTQ's qweight, qzeros, scales, g_idx) and converts one module's tensors to a QuantizedWeight
(``convert``); the model's load_weights hands it every such tensor (``take_checkpoint_tensor``,
materialized at once: a lazily read tensor is only valid during the call). A projection's
``.bias`` is not claimed: it loads into the layer as in a 16-bit checkpoint.

Modules the checkpoint keeps in 16/32 bits (GPTQ's ``modules_in_block_to_quantize``, AWQ's
``modules_to_not_convert``, compressed-tensors' ``ignore``) come with a plain ``.weight``, which
loads normally; ``is_checkpoint_tensor`` notes them, and such a projection keeps the 16/32-bit
linear method. A fused projection (qkv, gate_up) whose parts are partly quantized is a ValueError
naming them, as in vLLM.

Each rank converts whole modules and cuts its slice with the layer's own weight_loader
(woq.load_layer, which also re-expresses a group that a row-parallel rank's slice splits (per-channel scales, or group 128
over a 64-input slice) exactly with a smaller group, the scale repeated).
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from pagedllm.model_executor.layers.linear_method import LinearMethodBase
from pagedllm.model_executor.quantization.base import HF_PROJECTION_PARTS, QuantizationConfig
from pagedllm.model_executor.quantization.woq import QuantizedWeight, load_layer
from pagedllm.model_executor.quantization.woq_cuda import woq_method_for

#: a decoder projection part's HF module name (without "model.")
_PART = re.compile(r"layers\.\d+\.(" + "|".join(re.escape(hf) for parts in HF_PROJECTION_PARTS.values()
                                                 for _, hf in parts) + r")")


def is_projection_part(module: str) -> bool:
    """Whether `module` ("layers.3.self_attn.q_proj") is a part of a decoder projection."""
    return _PART.fullmatch(module) is not None


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned `bits`-bit values packed into int32 `packed` along `dim` (0 or 1), low bits
    first: value j of word w is bits j*bits .. j*bits + bits - 1, and lands at index w * (32 / bits)
    + j of `dim`. int32 result."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32)
    if dim == 0:
        v = (p.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)  # [R, per, C]
        return v.reshape(p.shape[0] * per, p.shape[1])
    v = (p.unsqueeze(2) >> shifts.view(1, 1, per)) & ((1 << bits) - 1)      # [R, C, per]
    return v.reshape(p.shape[0], p.shape[1] * per)


def zero_point_form(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bits: int, group: int,
                    source: str) -> QuantizedWeight:
    """The QuantizedWeight of w = scale * (q - zero) with unsigned `bits`-bit codes q [N, K] and
    integer zero [N, G], scale float32 [N, G] (G = K / group): bits 4: codes q, min -scale * zero;
    bits 8: int8 codes q - 128, min scale * (128 - zero), none where every zero is 128. Exact when
    the scale has at most 15 significant bits (fp16, bf16): each product of it with an integer of
    at most 9 bits is then exact in float32, and so is their sum, scale * (q - zero)."""
    zero = zero.to(torch.float32)
    if bits == 4:
        return QuantizedWeight(q.to(torch.uint8).contiguous(), 4, group, scale.contiguous(),
                               (-(scale * zero)).contiguous(), source)
    codes = (q.to(torch.int16) - 128).to(torch.int8).contiguous()
    mn = None if bool((zero == 128).all()) else (scale * (128.0 - zero)).contiguous()
    return QuantizedWeight(codes, 8, group, scale.contiguous(), mn, source)


def require(module: str, tensors: dict, names: tuple[str, ...], fmt: str) -> None:
    """ValueError naming the tensors of `names` that `module` lacks."""
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{fmt} checkpoint: {module} has {sorted(tensors)} but not {missing}")


def check_trivial_g_idx(module: str, g_idx: Optional[torch.Tensor], k: int, group: int, fmt: str) -> None:
    """ValueError unless g_idx (None, or int [K]: the group of each input) is k // group, i.e. the
    checkpoint is not in activation order (desc_act / actorder "group"), which the weight-only
    kernel's contiguous groups cannot express."""
    if g_idx is None:
        return
    want = torch.arange(k, dtype=torch.int64) // group
    if tuple(g_idx.shape) != (k,) or not torch.equal(g_idx.to(torch.int64), want):
        raise ValueError(f"{fmt} checkpoint: {module}.g_idx is not k // group_size ({group}): the inputs are in "
                         "activation order (desc_act / actorder), which pagedllm does not load")


class CheckpointWoqConfig(QuantizationConfig):
    """A checkpoint-quantized weight-only format (module docstring). Subclasses set ``name``,
    ``leaves`` and ``convert``, and may widen ``claims``."""

    from_checkpoint = True
    #: tensor names (the last piece) of one quantized module
    leaves: tuple[str, ...] = ()

    def __init__(self) -> None:
        #: module ("layers.0.self_attn.q_proj") -> its tensors taken so far
        self._modules: dict[str, dict[str, torch.Tensor]] = {}
        #: modules whose 16/32-bit weight the checkpoint holds (not quantized)
        self._dense: set[str] = set()
        #: (bits, group_size) -> parts converted, for describe()
        self.forms: dict[tuple[int, int], int] = {}

    def claims(self, module: str, leaf: str) -> bool:
        return leaf in self.leaves

    def is_checkpoint_tensor(self, name: str) -> bool:
        module, _, leaf = name.rpartition(".")
        if self.claims(module, leaf):
            return True
        if leaf == "weight":
            self._dense.add(module)
        return False

    def take_checkpoint_tensor(self, name: str, tensor) -> None:
        module, _, leaf = name.rpartition(".")
        if not is_projection_part(module):
            raise ValueError(f"{self.name} checkpoint tensor {name!r}: pagedllm computes only the decoder's "
                             f"projections quantized; {module} must be in 16/32 bits (the embedding and the LM "
                             "head are)")
        t = tensor.full() if hasattr(tensor, "full") else tensor
        self._modules.setdefault(module, {})[leaf] = t

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """The QuantizedWeight of one HF linear module from its checkpoint tensors."""
        raise NotImplementedError

    def linear_method(self, layer: nn.Module, prefix: str = "") -> Optional[LinearMethodBase]:
        index, _, proj = prefix.removeprefix("layers.").partition(".")
        if proj not in HF_PROJECTION_PARTS:
            raise ValueError(f"{type(self).__name__}: no checkpoint tensors for the projection {prefix!r}")
        parts = [(shard, f"layers.{index}.{hf}") for shard, hf in HF_PROJECTION_PARTS[proj]]
        quantized = [m for _, m in parts if m in self._modules]
        if not quantized:
            missing = [m for _, m in parts if m not in self._dense]
            if not missing:
                return None  # the checkpoint keeps this projection in 16/32 bits: it is loaded
            raise ValueError(f"{self.name} checkpoint: no quantized tensors ({', '.join(self.leaves)}) and no "
                             f"16/32-bit weight for {', '.join(missing)}")
        if len(quantized) != len(parts):
            dense = [m for _, m in parts if m not in self._modules]
            raise ValueError(f"{self.name} checkpoint: {', '.join(quantized)} quantized but {', '.join(dense)} "
                             f"not: the parts of the fused {proj} must all be quantized or all 16/32-bit")
        converted = {}
        for shard, module in parts:
            qw = self.convert(module, self._modules.pop(module))
            form = self.form_of(qw)
            self.forms[form] = self.forms.get(form, 0) + 1
            converted[shard] = qw
        return self.build_method(layer, converted, f"{self.name} {prefix}")

    def form_of(self, converted) -> tuple:
        """A converted part's form, counted for describe() ((bits, group_size) here)."""
        return (converted.bits, converted.group_size)

    def build_method(self, layer: nn.Module, parts: dict, what: str) -> LinearMethodBase:
        """The linear method of `layer` from its converted parts {shard_id: convert()'s result}: the
        CPU's weight-only kernel, or CUDA's tinygemm for 4-bit weights (woq_cuda.woq_method_for)."""
        return woq_method_for(layer, load_layer(layer, parts, what), what)

    def describe_forms(self) -> str:
        """"4-bit group 128 x14, 8-bit per channel x2" over the parts converted so far."""
        if not self.forms:
            return "no parts converted yet"
        return ", ".join(f"{b}-bit group {g} x{n}" for (b, g), n in sorted(self.forms.items(), key=str))
