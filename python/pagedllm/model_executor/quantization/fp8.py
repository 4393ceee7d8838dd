"""quantization="fp8": online FP8 W8A8 on CUDA (Hopper's FP8 tensor cores). At load every decoder
projection's 16-bit weight becomes float8_e4m3fn with a float32 scale per output channel; each call
quantizes its activations per token (dynamic scales) and multiplies with torch._scaled_mm
(cuBLASLt FP8 GEMM, row-wise scaling), bias and the bf16 output fused into the GEMM's epilogue;
steps of at most 8 rows (decode) instead read the FP8 weight in a GEMV of their own
(pagedllm.ops.fp8_gemv) with the activations unquantized (W8A16), which reads the weight at the
memory's speed where the GEMM at a few rows does not. On the CPU (FP8 checkpoints there:
fp8_checkpoint.py) the weight is dequantized per call and multiplied in the model dtype — correct,
not fast:

    s_w[n] = max_k |w[n, k]| / 448,   w_q = e4m3(w / s_w)          (once, at load)
    s_x[m] = max_k |x[m, k]| / 448,   x_q = e4m3(x / s_x)          (every call)
    y[m, n] = s_x[m] * s_w[n] * (x_q[m] . w_q[n]) + bias[n]        (FP32 accumulation)

448 is e4m3's largest finite value (Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
section 3); per-token activation scales and per-channel weight scales are vLLM's
"dynamic FP8" scheme. The LM head and the embedding stay 16-bit. Under tensor parallelism each rank
quantizes its shard (a column-parallel rank's rows are whole, so its scales are the unsharded ones).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import ops
from pagedllm.model_executor.layers.linear_method import LinearMethodBase, _refuse
from pagedllm.model_executor.quantization.base import QuantizationConfig

FP8_MAX = 448.0
#: steps of up to this many rows take the weight-only GEMV (bench/h200_quant.sh measures it)
FP8_GEMV_TOKENS = 8
FP8_DTYPE = torch.float8_e4m3fn


def quantize_fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [R, C], float32 scale [R, 1]) of t [R, C] with one scale per row (max |row| *
    float32(1 / 448); a zero row gets the smallest normal float32 instead of 0, so that no division is by 0).
    PyTorch's formula; ``quantize_fp8_activations`` gives the same bytes in one CUDA kernel."""
    scale = t.abs().amax(dim=-1, keepdim=True).float().mul_(1.0 / FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    q = (t.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_rows of activations x [M, K]: pagedllm.ops.scaled_fp8_quant (one kernel) where
    the fused layer ops run, else PyTorch."""
    if x.is_cuda and ops.layer_ops_supported(x.device, x.dtype):
        return ops.scaled_fp8_quant(x.contiguous())
    return quantize_fp8_rows(x)


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase:
        return Fp8LinearMethod()

    def describe(self) -> str:
        return "fp8 (online: e4m3 weights with per-channel scales, per-token dynamic activation scales, torch._scaled_mm)"


class Fp8LinearMethod(LinearMethodBase):
    """FP8 W8A8 (module docstring). Needs in_features and out_features multiples of 16 (cuBLASLt's
    FP8 GEMM); x bfloat16 (or float16). Steps of at most gemv_max_tokens rows (default
    FP8_GEMV_TOKENS; PAGEDLLM_FP8_GEMV_MAX_TOKENS overrides, 0 turns it off) run the weight-only
    GEMV instead (pagedllm.ops.fp8_gemv: W8A16, the activations as they are)."""

    def __init__(self, prequantized: tuple[torch.Tensor, torch.Tensor] | None = None):
        """prequantized: (float8_e4m3fn codes [N, K], float32 scale [N]) of this rank, from an FP8
        checkpoint (fp8_checkpoint.py); None quantizes the loaded 16-bit weight."""
        self.prequantized = prequantized
        env = os.environ.get("PAGEDLLM_FP8_GEMV_MAX_TOKENS")
        limit = int(env) if env not in (None, "") else FP8_GEMV_TOKENS
        self.gemv_max_tokens = max(0, min(limit, ops.FP8_GEMV_MAX_TOKENS))
        #: cuBLASLt's fast FP8 accumulation (Hopper's tensor-core accumulator without periodic
        #: promotion to float32): PAGEDLLM_FP8_FAST_ACCUM=1
        self.fast_accum = os.environ.get("PAGEDLLM_FP8_FAST_ACCUM", "0") == "1"
        self.fused_quant = os.environ.get("PAGEDLLM_FP8_FUSED_QUANT", "1") != "0"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        n, k = weight.shape
        if n % 16 or k % 16:
            raise ValueError(f"fp8 quantization of {type(layer).__name__}: needs in_features and out_features that "
                             f"are multiples of 16, got [{n}, {k}]")
        if self.prequantized is not None:
            q, scale = (t.to(weight.device) for t in self.prequantized)
            if tuple(q.shape) != (n, k) or tuple(scale.shape) != (n,):
                raise ValueError(f"{type(layer).__name__}: FP8 weight {tuple(q.shape)} / scale {tuple(scale.shape)} do "
                                 f"not match the layer's [{n}, {k}]")
            self.prequantized = None
        else:
            q, scale = quantize_fp8_rows(weight.detach())
        layer.fp8_weight = q  # [N, K] row-major: the GEMV's
        layer.fp8_weight_t = q.t()  # the same bytes as [K, N] column-major: _scaled_mm's second operand
        layer.fp8_scale = scale.view(1, n).contiguous()
        layer.fp8_scale_rows = layer.fp8_scale.view(n)
        layer.fp8_out_dtype = weight.dtype
        bias = layer.apply_bias()
        layer.fp8_bias = None if bias is None else bias.detach().to(weight.dtype).contiguous()
        layer.out_features = n
        layer.weight = None

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None, **fusion) -> torch.Tensor:
        if fusion:
            _refuse(layer, fusion, "the fp8 GEMM")
        if isinstance(x, ops.Fp8Rows):  # quantized by the norm before (takes_fp8_rows)
            y = torch._scaled_mm(x.q, layer.fp8_weight_t, scale_a=x.scale, scale_b=layer.fp8_scale,
                                 bias=layer.fp8_bias, out_dtype=layer.fp8_out_dtype, use_fast_accum=self.fast_accum)
            return y if out is None else out.copy_(y)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] == 0:
            y = x2.new_empty((0, layer.out_features))
        elif not x2.is_cuda:  # the CPU has no FP8 arithmetic: weight-only, the weight dequantized per call
            y = F.linear(x2, self.dequantized_weight(layer).to(x2.dtype), layer.fp8_bias)
        elif self._gemv_applies(x2):  # a decode-sized step: the weight-only GEMV (no activation quantization)
            y = ops.fp8_gemv(x2 if x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0 else x2.contiguous(),
                             layer.fp8_weight, layer.fp8_scale_rows, layer.fp8_bias)
        else:
            xq, sx = quantize_fp8_activations(x2)
            y = torch._scaled_mm(xq, layer.fp8_weight_t, scale_a=sx, scale_b=layer.fp8_scale, bias=layer.fp8_bias,
                                 out_dtype=x.dtype, use_fast_accum=self.fast_accum)
        y = y.view(*shape[:-1], layer.out_features)
        return y if out is None else out.copy_(y)

    def takes_fp8_rows(self, layer: nn.Module, tokens: int) -> bool:
        """Whether apply() wants its input for a step of `tokens` rows already quantized per token
        (ops.Fp8Rows, e.g. from the RMSNorm before it: DecoderLayer asks); off with
        PAGEDLLM_FP8_FUSED_QUANT=0."""
        return tokens > self.gemv_max_tokens and self.fused_quant

    def _gemv_applies(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.shape[0] <= self.gemv_max_tokens and x.dtype in (torch.bfloat16, torch.float16)
                and x.stride(-1) == 1)

    @staticmethod
    def weight_bytes(layer: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in (layer.fp8_weight_t, layer.fp8_scale, layer.fp8_bias)
                   if t is not None)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight the GEMM uses, float32 [N, K] (for references)."""
        return layer.fp8_weight_t.t().float() * layer.fp8_scale.view(-1, 1)
