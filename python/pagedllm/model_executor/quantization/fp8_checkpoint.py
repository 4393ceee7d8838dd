"""FP8 checkpoints: Hugging Face folders whose config.json says ``quant_method: "fp8"`` (the format
vLLM and transformers' FP8 / FineGrainedFP8 write) or compressed-tensors "float-quantized" FP8
(llm-compressor's FP8 W8A8, e.g. the "-FP8" and "-FP8-dynamic" Llama checkpoints), computed by
quantization="fp8"'s linear method (fp8.py: the FP8 GEMV for decode, torch._scaled_mm above).

One linear module stores ``weight`` float8_e4m3fn [N, K] and its scale, w = weight * scale:

- per tensor: ``weight_scale`` float32 [] or [1] (fp8 with ``weight_block_size`` null;
  compressed-tensors strategy "tensor");
- per channel: ``weight_scale`` [N] or [N, 1] (compressed-tensors strategy "channel");
- per block of 128 x 128: ``weight_scale_inv`` [ceil(N / 128), ceil(K / 128)] (fp8 with
  ``weight_block_size`` [128, 128], DeepSeek-V3's layout) or compressed-tensors strategy "block"
  (``weight_scale``, same shape).

The method holds e4m3 codes with one float32 scale per output row: per-tensor and per-channel
scales become that exactly (a per-tensor scale repeated, so that q, k and v stack); block scales
cannot, and are dequantized and re-quantized per row at load — one more rounding (logged). Static
activation scales (``input_scale``, activation_scheme "static") are read and not used: the GEMM
quantizes each token with its own dynamic scale, which is at least as accurate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pagedllm.model_executor.layers.linear_method import LinearMethodBase
from pagedllm.model_executor.quantization.fp8 import FP8_DTYPE, Fp8LinearMethod, quantize_fp8_rows
from pagedllm.model_executor.quantization.woq_checkpoint import CheckpointWoqConfig, is_projection_part, require

logger = logging.getLogger("pagedllm")


@dataclass
class Fp8Weight:
    q: torch.Tensor      # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]
    form: str            # "per-tensor", "per-channel", "block 128x128 (re-quantized per channel)"

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, module: str,
               block: Optional[tuple[int, int]] = None) -> Fp8Weight:
    """The per-row form of one module's FP8 weight (module docstring); ValueError naming a wrong
    dtype or a scale whose shape fits none of the layouts."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 checkpoint: {module}.weight is {weight.dtype}, expected {FP8_DTYPE} (e4m3fn)")
    n, k = weight.shape
    s = scale.to(torch.float32)
    if block is not None:
        bn, bk = block
        rows, cols = -(-n // bn), -(-k // bk)
        if tuple(s.shape) != (rows, cols):
            raise ValueError(f"FP8 checkpoint: {module} block scale has shape {tuple(s.shape)}, expected "
                             f"({rows}, {cols}) for [{n}, {k}] in blocks of {bn} x {bk}")
        full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q, row_scale = quantize_fp8_rows(weight.float() * full)
        return Fp8Weight(q, row_scale.view(n).contiguous(), f"block {bn}x{bk} (re-quantized per channel)")
    if s.numel() == 1:
        return Fp8Weight(weight, s.reshape(1).expand(n).contiguous(), "per-tensor")
    if s.numel() == n and s.dim() <= 2 and (s.dim() < 2 or s.shape[1] == 1):
        return Fp8Weight(weight, s.reshape(n).contiguous(), "per-channel")
    raise ValueError(f"FP8 checkpoint: {module} weight scale has shape {tuple(s.shape)}: expected a scalar, [{n}] "
                     f"or [{n}, 1] (a per-block scale needs the config's block size)")


#: attention-side FP8 scales some checkpoints carry (KV-cache and attention quantization): the
#: model reads the KV-cache ones itself (quantization/kv_cache.py); any other is read and dropped
_ATTENTION_SCALES = ("k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale", "output_scale")


class _Fp8CheckpointBase(CheckpointWoqConfig):
    """FP8 parts collected and stacked as the integer formats' are (woq_checkpoint.py)."""

    def is_checkpoint_tensor(self, name: str) -> bool:
        return name.rpartition(".")[2] in _ATTENTION_SCALES or super().is_checkpoint_tensor(name)

    def take_checkpoint_tensor(self, name: str, tensor) -> None:
        if name.rpartition(".")[2] in _ATTENTION_SCALES:
            if not getattr(self, "_dropped_scales", False):
                self._dropped_scales = True
                logger.info("%s checkpoint: attention scales (%s, ...) dropped: not used here", self.name, name)
            return
        super().take_checkpoint_tensor(name, tensor)

    #: where these checkpoints run: CUDA's FP8 kernels, or the CPU (torch._scaled_mm; correct, not fast)
    devices = ("cuda", "cpu")
    block: Optional[tuple[int, int]] = None

    def form_of(self, converted: Fp8Weight) -> tuple:
        return (converted.form,)

    def describe_forms(self) -> str:
        if not self.forms:
            return "no parts converted yet"
        return ", ".join(f"{f[0]} x{n}" for f, n in sorted(self.forms.items()))

    def convert(self, module: str, tensors: dict[str, torch.Tensor]) -> Fp8Weight:
        scale_name = "weight_scale_inv" if "weight_scale_inv" in tensors else "weight_scale"
        require(module, tensors, ("weight", scale_name), self.name)
        converted = fp8_weight(tensors["weight"], tensors[scale_name], module, self.block)
        if self.block is not None and not getattr(self, "_warned", False):
            self._warned = True
            logger.warning("%s: block-scaled FP8 weights re-quantized per output channel at load (one more "
                           "rounding of each weight)", self.name)
        return converted

    def build_method(self, layer: nn.Module, parts: dict, what: str) -> LinearMethodBase:
        """Fp8LinearMethod of this rank's rows / columns of the stacked parts (the layer's own
        weight_loader cuts the codes as a 16-bit weight's, the per-row scales as a bias)."""
        out_pp, in_pp = layer.output_size_per_partition, layer.input_size_per_partition
        q = torch.empty((out_pp, in_pp), dtype=FP8_DTYPE)
        scale = torch.empty(out_pp, dtype=torch.float32)
        for shard, part in parts.items():
            try:
                layer.weight_loader(q, part.q, shard)
                layer.weight_loader(scale, part.scale, shard)
            except ValueError as exc:
                raise ValueError(f"{what}: {exc}") from exc
        return Fp8LinearMethod(prequantized=(q, scale))


class Fp8CheckpointConfig(_Fp8CheckpointBase):
    """config.json quantization_config {"quant_method": "fp8", "activation_scheme": "dynamic" |
    "static", "weight_block_size": null | [128, 128], "modules_to_not_convert": [...]}."""

    name = "fp8"
    leaves = ("weight_scale", "weight_scale_inv", "input_scale")

    def __init__(self, block: Optional[tuple[int, int]], skip: list[str]):
        super().__init__()
        self.block, self.skip = block, skip

    @classmethod
    def from_config(cls, config: dict) -> "Fp8CheckpointConfig":
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 quantization_config activation_scheme={scheme!r} is not supported: supported "
                             "'dynamic', 'static'")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 quantization_config fmt={fmt!r} is not supported: supported 'e4m3'")
        block = config.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                                 for b in block)):
                raise ValueError(f"fp8 quantization_config weight_block_size={block!r} must be null or two positive "
                                 "integers, e.g. [128, 128]")
            block = (int(block[0]), int(block[1]))
        return cls(block, list(config.get("modules_to_not_convert") or config.get("ignored_layers") or []))

    def claims(self, module: str, leaf: str) -> bool:
        if leaf == "weight":
            return is_projection_part(module) and not any(s and s in f"model.{module}" for s in self.skip)
        return leaf in self.leaves

    def describe(self) -> str:
        return f"fp8 checkpoint ({self.describe_forms()}; e4m3 weights, per-token dynamic activation scales)"


class CompressedTensorsFp8Config(_Fp8CheckpointBase):
    """compressed-tensors "float-quantized" FP8 weights (built by compressed_tensors.py's
    CompressedTensorsConfig.from_config when every config group is FP8). targets / ignore: which
    Linear modules hold FP8 weights."""

    name = "compressed-tensors"
    leaves = ("weight_scale", "input_scale")

    def __init__(self, matches, block: Optional[tuple[int, int]]):
        super().__init__()
        self.matches, self.block = matches, block

    def claims(self, module: str, leaf: str) -> bool:
        if leaf == "weight":
            return is_projection_part(module) and self.matches(module)
        return leaf in self.leaves

    def describe(self) -> str:
        return f"compressed-tensors FP8 ({self.describe_forms()}; per-token dynamic activation scales)"
