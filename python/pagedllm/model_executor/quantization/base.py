"""QuantizationConfig: what a quantization method tells the model (the linear method of each
projection, and how to describe itself at start-up)."""

from __future__ import annotations

from typing import Optional

from torch import nn

from pagedllm.model_executor.layers.linear_method import LinearMethodBase


class QuantizationConfig:
    """One quantization method's settings. name: vLLM's quantization= name."""

    name: str = ""

    def linear_method(self, layer: nn.Module, prefix: str = "") -> Optional[LinearMethodBase]:
        """The linear method for `layer` (a LinearBase of the decoder named `prefix`, e.g.
        "layers.0.qkv_proj"; the LM head and the embedding stay 16/32-bit, as vLLM's default), or
        None to keep its 16/32-bit weight."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name
