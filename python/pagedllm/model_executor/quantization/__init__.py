"""Quantized weights (vLLM's ``quantization=`` names): which methods pagedllm runs, and the linear
method each gives the model's projections.

    config = get_quantization_config(name, checkpoint_method, device, gguf_file)  # None: 16/32-bit
    model.quantize_weights(config)                                                 # after load_weights

Supported now (on the CPU unless marked):
- "int8": online W8A8 (int8.py): a 16/32-bit checkpoint quantized at load, per-token int8 activations.
- "int4": online weight-only int4, group 128 (int4.py).
- "fp8" (CUDA): online FP8 W8A8, per-channel weights, per-token activations, torch._scaled_mm (fp8.py).
- "int4" on CUDA: the same int4 weights through PyTorch's tinygemm kernel (woq_cuda.py).
- "gguf": a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K projections computed in their own types
  (gguf.py); without it a GGUF model is dequantized at load, as before.
The weight-only formats share one exact form and kernel (woq.py). A checkpoint whose config.json
carries a ``quantization_config`` of another method, an unknown name, or a method on a device it
does not run on is a ValueError naming what is supported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from pagedllm.model_executor.quantization.awq import AWQConfig
from pagedllm.model_executor.quantization.base import QuantizationConfig
from pagedllm.model_executor.quantization.compressed_tensors import CompressedTensorsConfig
from pagedllm.model_executor.quantization.fp8 import Fp8Config
from pagedllm.model_executor.quantization.fp8_checkpoint import Fp8CheckpointConfig, _Fp8CheckpointBase
from pagedllm.model_executor.quantization.gguf import GGUFConfig
from pagedllm.model_executor.quantization.gptq import GPTQConfig
from pagedllm.model_executor.quantization.int4 import Int4Config
from pagedllm.model_executor.quantization.int8 import Int8Config

#: name -> (config class, device types it runs on)
QUANTIZATION_METHODS: dict[str, tuple[type[QuantizationConfig], tuple[str, ...]]] = {
    "int8": (Int8Config, ("cpu",)),
    "int4": (Int4Config, ("cpu", "cuda")),
    "gguf": (GGUFConfig, ("cpu", "cuda")),
    "fp8": (Fp8Config, ("cuda",)),
}

#: the activation dtype a method computes with on CUDA (tinygemm and the FP8 kernels: bfloat16)
CUDA_DTYPES: dict[str, torch.dtype] = {"int4": torch.bfloat16, "fp8": torch.bfloat16, "gguf": torch.bfloat16}

#: quant_method of a checkpoint's quantization_config -> (config class with from_config(dict), devices)
CHECKPOINT_METHODS: dict[str, tuple[type[QuantizationConfig], tuple[str, ...]]] = {
    "gptq": (GPTQConfig, ("cpu", "cuda")),
    "awq": (AWQConfig, ("cpu", "cuda")),
    "compressed-tensors": (CompressedTensorsConfig, ("cpu", "cuda")),
    "fp8": (Fp8CheckpointConfig, ("cuda", "cpu")),
}


def required_dtype(name: Optional[str], checkpoint_method: Optional[str], device: torch.device) -> Optional[torch.dtype]:
    """The activation dtype the method computes with on `device`, where it needs one (CUDA's
    tinygemm and FP8 kernels: bfloat16), else None; dtype="auto" takes it."""
    if device.type != "cuda":
        return None
    if checkpoint_method is not None:
        return torch.bfloat16 if checkpoint_method in CHECKPOINT_METHODS else None
    return CUDA_DTYPES.get(name) if name is not None else None


def get_quantization_config(name: Optional[str], checkpoint_method: Optional[str], device: torch.device,
                            gguf_file: Optional[Path] = None, checkpoint_config: Optional[dict] = None,
                            dtype: Optional[torch.dtype] = None) -> Optional[QuantizationConfig]:
    """The QuantizationConfig for LLM(quantization=name) over a checkpoint quantized with
    checkpoint_method (config.json's quantization_config.quant_method, or None; checkpoint_config:
    that whole dict); gguf_file: the GGUF file the model came from (None for a Hugging Face
    folder); dtype: the model's (checked where a method takes one only). None for plain 16/32-bit
    weights. ValueError for an unsupported name, checkpoint format, device or dtype, or a name that
    contradicts the checkpoint's."""
    supported = list(QUANTIZATION_METHODS)
    if checkpoint_method is not None:
        formats = list(CHECKPOINT_METHODS)
        if checkpoint_method not in CHECKPOINT_METHODS:
            raise ValueError(f"the checkpoint is quantized with {checkpoint_method!r} (config.json quantization_config), "
                             f"which pagedllm does not load: supported checkpoint formats are {formats}; online "
                             f"methods (from a 16/32-bit checkpoint or a GGUF file) are {supported}")
        if name is not None and name != checkpoint_method:
            raise ValueError(f"quantization={name!r} contradicts the checkpoint, which is quantized with "
                             f"{checkpoint_method!r}: pass quantization=None or {checkpoint_method!r}")
        cls, devices = CHECKPOINT_METHODS[checkpoint_method]
        config = cls.from_config(checkpoint_config or {"quant_method": checkpoint_method})
        devices = getattr(config, "devices", devices)  # (compressed-tensors FP8 runs where fp8 does)
        if device.type not in devices:
            raise ValueError(f"{checkpoint_method!r} checkpoints run on {', '.join(devices)} so far, not on "
                             f"{device.type}")
        if device.type == "cuda" and dtype not in (None, torch.bfloat16):
            kind = "FP8" if isinstance(config, _Fp8CheckpointBase) else f"{checkpoint_method!r}"
            raise ValueError(f"{kind} checkpoints on cuda compute with bfloat16 activations, got "
                             f"dtype={str(dtype).removeprefix('torch.')}: pass dtype='bfloat16'")
        return config
    if name is None:
        return None
    if name in CHECKPOINT_METHODS and name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={name!r} is a checkpoint format, read from a checkpoint whose config.json "
                         f"says so (quantization_config.quant_method); this checkpoint is not quantized: use one "
                         f"of {supported} (or None)")
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={name!r} is not supported: use one of {supported} (or None); checkpoint "
                         f"formats {list(CHECKPOINT_METHODS)} are read from the checkpoint")
    cls, devices = QUANTIZATION_METHODS[name]
    if device.type not in devices:
        raise ValueError(f"quantization={name!r} runs on {', '.join(devices)} so far, not on {device.type}")
    wanted = CUDA_DTYPES.get(name)
    if device.type == "cuda" and wanted is not None and dtype is not None and dtype != wanted:
        raise ValueError(f"quantization={name!r} on cuda computes with {str(wanted).removeprefix('torch.')} "
                         f"activations, got dtype={str(dtype).removeprefix('torch.')}: pass dtype='bfloat16'")
    if cls is GGUFConfig:
        return GGUFConfig(gguf_file)
    return cls()


__all__ = ["CHECKPOINT_METHODS", "QUANTIZATION_METHODS", "QuantizationConfig", "get_quantization_config",
           "required_dtype"]
