"""Linear methods of 16-bit weights on the CPU (bfloat16), chosen by the model's pack_weights()
after loading: the weight is re-laid out once instead of on every call.

- PackedLinearMethod: oneDNN's blocked layout (torch.ops.mkldnn); plain F.linear re-lays the
  weight out on every call, which costs as much as the product itself at decode batch sizes.
  Bit-identical to F.linear.
- AmxLinearMethod: pagedllm's AMX kernel (pagedllm.ops.amx_linear: the weight packed once into
  AMX tiles and streamed once per call) for steps of at most MAX_TOKENS rows, oneDNN's packed
  weight above (measured faster there). Needs in/out features that are multiples of 32 and holds
  both packings (twice the weight's memory), so pack_weights uses it only when all the model's
  projections take at most MAX_WEIGHT_BYTES. Sums in another order than oneDNN (within bfloat16
  rounding of F.linear).

Both drop the layer's plain weight after packing (layer.weight becomes None); the AMX method
leaves the packed views the native decoder stack reads (layer._packed_view, layer._bias_view).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm import _C, ops
from pagedllm.model_executor.layers.linear_method import LinearMethodBase, _refuse


def can_pack_linear(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether PackedLinearMethod applies: bfloat16 on a CPU whose oneDNN build supports it."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _onednn_pack(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _store(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return y if out is None else out.copy_(y)


def _drop_weight(layer: nn.Module, keep: bool) -> None:
    if not keep:
        layer.weight = None


class PackedLinearMethod(LinearMethodBase):
    """oneDNN's packed bfloat16 weight (module docstring). x [..., in] -> [..., out]."""

    def process_weights_after_loading(self, layer: nn.Module, keep_weight: bool = False) -> None:
        layer.out_features = layer.weight.shape[0]
        layer.packed = _onednn_pack(layer.weight)
        bias = layer.apply_bias()
        layer.packed_bias = None if bias is None else bias.detach().clone()
        _drop_weight(layer, keep_weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None, **fusion) -> torch.Tensor:
        if fusion:
            _refuse(layer, fusion, "oneDNN's packed weight")
        return _store(_onednn_linear(x, layer.packed, layer.packed_bias), out)


class AmxLinearMethod(LinearMethodBase):
    """The AMX kernel for x [T <= MAX_TOKENS, in] (contiguous rows), oneDNN above (module
    docstring)."""

    MAX_TOKENS = 128
    MAX_WEIGHT_BYTES = 2 << 30

    def writes_float32(self, layer: nn.Module, tokens: int) -> bool:
        return 0 < tokens <= self.MAX_TOKENS

    @staticmethod
    def applies(weight: torch.Tensor) -> bool:
        return weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0 and ops.amx_linear_supported()

    def process_weights_after_loading(self, layer: nn.Module, keep_weight: bool = False) -> None:
        weight = layer.weight
        layer.out_features = weight.shape[0]
        layer.amx_packed = ops.amx_pack_linear_weight(weight.detach())
        bias = layer.apply_bias()
        layer.amx_bias = None if bias is None else bias.detach().float().contiguous()
        layer.packed = _onednn_pack(weight)
        layer.packed_bias = None if bias is None else bias.detach().clone()
        # the static operands' native views, made once (a view costs ~2 us per call)
        layer._packed_view = ops._view(layer.amx_packed)
        layer._bias_view = None if layer.amx_bias is None else ops._view(layer.amx_bias)
        _drop_weight(layer, keep_weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None, **fusion) -> torch.Tensor:
        """A float32 `out` gets the bfloat16-rounded result widened, as .float() of it (in one pass
        where the AMX kernel runs: the LM head's logits)."""
        if fusion:
            _refuse(layer, fusion, "the AMX kernel")
        if x.shape[0] > self.MAX_TOKENS:
            return _store(_onednn_linear(x, layer.packed, layer.packed_bias), out)
        if out is None:
            out = torch.empty((x.shape[0], layer.out_features), dtype=x.dtype)
        _C.amx_linear(ops._view(out), ops._view(x), layer._packed_view, layer._bias_view)
        return out

    def argmax(self, layer: nn.Module, x: torch.Tensor, vocab: int) -> torch.Tensor:
        """int64 [T]: per row of x (at most MAX_TOKENS rows), the column of the largest of the first
        `vocab` outputs (ops.amx_linear_argmax: the same ids as argmax_rows of apply's float32
        output, the outputs never written)."""
        out = torch.empty((x.shape[0],), dtype=torch.int64)
        _C.amx_linear_argmax(ops._view(out), ops._view(x), layer._packed_view, int(vocab), layer._bias_view)
        return out
