"""Quantized weights (vLLM's ``quantization=`` names): which methods pagedllm runs, and the linear
method each gives the model's projections.

    config = get_quantization_config(name, checkpoint_method, device)   # None: 16/32-bit
    model.quantize_weights(config)                                       # after load_weights

Supported now: "int8" (online: a 16/32-bit checkpoint quantized at load; int8.py), on the CPU.
A checkpoint whose config.json carries a ``quantization_config`` of another method, an unknown
name, or a method on a device it does not run on is a ValueError naming what is supported.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.model_executor.quantization.base import QuantizationConfig
from pagedllm.model_executor.quantization.int8 import Int8Config

#: name -> (config class, device types it runs on)
QUANTIZATION_METHODS: dict[str, tuple[type[QuantizationConfig], tuple[str, ...]]] = {
    "int8": (Int8Config, ("cpu",)),
}


def get_quantization_config(name: Optional[str], checkpoint_method: Optional[str],
                            device: torch.device) -> Optional[QuantizationConfig]:
    """The QuantizationConfig for LLM(quantization=name) over a checkpoint quantized with
    checkpoint_method (config.json's quantization_config.quant_method, or None); None for plain
    16/32-bit weights. ValueError for an unsupported name, checkpoint format or device."""
    supported = list(QUANTIZATION_METHODS)
    if checkpoint_method is not None:
        raise ValueError(f"the checkpoint is quantized with {checkpoint_method!r} (config.json quantization_config), "
                         f"which pagedllm does not load yet: supported methods are {supported} (online, from a "
                         "16/32-bit checkpoint)")
    if name is None:
        return None
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={name!r} is not supported: use one of {supported} (or None)")
    cls, devices = QUANTIZATION_METHODS[name]
    if device.type not in devices:
        raise ValueError(f"quantization={name!r} runs on {', '.join(devices)} so far, not on {device.type}")
    return cls()


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "get_quantization_config"]
