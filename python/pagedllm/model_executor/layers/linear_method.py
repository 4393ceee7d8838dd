"""How a linear layer holds and applies its weight: the LinearMethodBase interface, and
UnquantizedLinearMethod for 16/32-bit weights (the CPU's packed methods are in
cpu_linear_methods.py; quantized formats add methods to this interface).

A method creates the layer's parameters (``create_weights``: ``layer.weight`` [out, in] and
``layer.bias`` [out] or None, in the layer's dtype, as the checkpoint stores them), may re-lay
them out once they are loaded (``process_weights_after_loading``), and computes
``y [T, out] = x [T, in] @ weight^T + bias`` (``apply``). Methods that can also fuse neighbouring
element-wise work into the product (the CUDA GEMV's RMSNorm prologue, residual / rotary / SiLU
epilogues: pagedllm.ops.gemv) say so per step size in ``fusions_apply``; the model asks before it
passes such keyword arguments, and a method refuses ones it cannot apply (ValueError).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import ops

#: Steps of up to this many tokens use the GEMV (bench/gemv.py, H200, Llama-3-8B shapes).
GEMV_CROSSOVER_TOKENS = 8


def gemv_max_tokens(device: torch.device, dtype: torch.dtype) -> int:
    """Largest step (tokens) whose projections run through ops.gemv: 0 where the GEMV does not
    apply (CPU, float32), else the measured crossover against cuBLAS (bench/gemv.py on the H200),
    overridable with the environment variable PAGEDLLM_GEMV_MAX_TOKENS (0 turns it off)."""
    if not ops.gemv_supported(device, dtype):
        return 0
    env = os.environ.get("PAGEDLLM_GEMV_MAX_TOKENS")
    limit = int(env) if env not in (None, "") else GEMV_CROSSOVER_TOKENS
    return max(0, min(limit, ops.GEMV_MAX_TOKENS))


class LinearMethodBase:
    """The interface (see the module docstring). ``layer`` is a LinearBase
    (model_executor/layers/linear.py); ``layer.apply_bias()`` is the bias this rank adds."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        """Register layer.weight [output_size, input_size] and layer.bias [output_size] (or None)
        as this rank's partition, uninitialised (the loader fills them)."""
        weight = torch.empty((output_size, input_size), dtype=dtype, device=device)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once the checkpoint is in layer.weight / layer.bias."""

    def fusions_apply(self, layer: nn.Module, tokens: int) -> bool:
        """Whether apply() takes fusion keyword arguments for a step of `tokens` rows."""
        return False

    @staticmethod
    def weight_bytes(layer: nn.Module) -> int:
        """Bytes the layer's weight takes in this method's form."""
        return layer.weight.numel() * layer.weight.element_size()

    def writes_float32(self, layer: nn.Module, tokens: int) -> bool:
        """Whether apply() fills a float32 `out` in the same pass for `tokens` rows (else a float32
        out is a widening copy of the model-dtype product)."""
        return False

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None,
              **fusion) -> torch.Tensor:
        """x [T, in] -> y [T, out] in x's dtype, or written into `out` (which may be float32: the
        x-dtype result widened, as .float() of it) and returned. ``config`` (the GEMV's tuning
        overrides, for benchmarks) is ignored where no GEMV runs."""
        raise NotImplementedError


def _refuse(layer: nn.Module, fusion: dict, why: str) -> None:
    """ValueError for fusion keywords this method cannot apply (None / False values and the GEMV's
    tuning `config` are not fusions)."""
    fusion = {k: v for k, v in fusion.items() if v is not None and v is not False and k != "config"}
    if fusion:
        raise ValueError(f"{type(layer).__name__}: fused {sorted(fusion)} cannot be applied here ({why})")


class UnquantizedLinearMethod(LinearMethodBase):
    """16/32-bit weights. On CUDA in bfloat16/float16, steps of at most ``gemv_max_tokens`` rows
    run pagedllm.ops.gemv (a bandwidth-bound GEMV, programmatic dependent launch) with its fusions;
    larger steps, float32 and the CPU run F.linear (cuBLAS / oneDNN). Both accumulate in fp32 and
    round once."""

    def __init__(self, gemv_max_tokens: int = 0):
        self.gemv_max_tokens = int(gemv_max_tokens)

    def fusions_apply(self, layer: nn.Module, tokens: int) -> bool:
        return 0 < tokens <= self.gemv_max_tokens

    def writes_float32(self, layer: nn.Module, tokens: int) -> bool:
        return 0 < tokens <= self.gemv_max_tokens

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None, **fusion) -> torch.Tensor:
        if fusion:  # (None / False values: not asked for)
            fusion = {k: v for k, v in fusion.items() if v is not None and v is not False}
        bias = layer.apply_bias()
        if 0 < x.shape[0] <= self.gemv_max_tokens:
            return ops.gemv(x, layer.weight, bias, out=out, **fusion)
        if fusion:
            _refuse(layer, fusion, f"a step of {x.shape[0]} rows runs F.linear; the GEMV takes 1 to "
                                   f"{self.gemv_max_tokens}")
        y = F.linear(x, layer.weight, bias)
        return y if out is None else out.copy_(y)
