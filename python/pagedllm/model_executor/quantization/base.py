"""QuantizationConfig: what a quantization method tells the model (the linear method of each
projection, and how to describe itself at start-up)."""

from __future__ import annotations

from typing import Optional

from torch import nn

from pagedllm.model_executor.layers.linear_method import LinearMethodBase


#: HF module names of each of our projections' parts (shard id, name under "layers.<i>.")
HF_PROJECTION_PARTS = {
    "qkv_proj": (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj")),
    "o_proj": ((None, "self_attn.o_proj"),),
    "gate_up_proj": ((0, "mlp.gate_proj"), (1, "mlp.up_proj")),
    "down_proj": ((None, "mlp.down_proj"),),
}


class QuantizationConfig:
    """One quantization method's settings. name: vLLM's quantization= name.

    A method whose weights come quantized in the checkpoint (GPTQ, AWQ, compressed-tensors) sets
    ``from_checkpoint``: the model's load_weights then hands it every tensor for which
    ``is_checkpoint_tensor(name)`` holds (``take_checkpoint_tensor``) instead of loading it, expects
    no 16/32-bit weight for the decoder projections, and ``linear_method`` builds each projection's
    method from what it took (HF module names of a projection's parts: HF_PROJECTION_PARTS)."""

    name: str = ""
    from_checkpoint: bool = False

    def is_checkpoint_tensor(self, name: str) -> bool:
        """Whether the checkpoint tensor `name` (without the "model." prefix) is this method's."""
        return False

    def take_checkpoint_tensor(self, name: str, tensor) -> None:
        """Keep the checkpoint tensor `name` (a torch.Tensor or a loader.CheckpointTensor)."""
        raise NotImplementedError

    def linear_method(self, layer: nn.Module, prefix: str = "") -> Optional[LinearMethodBase]:
        """The linear method for `layer` (a LinearBase of the decoder named `prefix`, e.g.
        "layers.0.qkv_proj"; the LM head and the embedding stay 16/32-bit, as vLLM's default), or
        None to keep its 16/32-bit weight."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name
