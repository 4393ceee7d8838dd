"""The KV cache's dtype (vLLM's ``kv_cache_dtype``) and the per-layer FP8 scales.

``kv_cache_dtype``: "auto" (the model's dtype), "fp8" = "fp8_e4m3" (float8_e4m3fn: max 448, 3
mantissa bits) or "fp8_e5m2" (float8_e5m2: max 57344, 2 mantissa bits). An FP8 cache holds one
byte per element, so the same memory holds twice the blocks of a bfloat16 cache (four times a
float32 one). Each layer has two per-tensor scales: a stored code c stands for c * k_scale (keys)
or c * v_scale (values). The kernels quantize on write (x / scale, round to nearest-even,
saturating) and read the codes exactly with float32 softmax and sums (pagedllm/attention.h).

Scales come from, in order:
- the checkpoint, where it has them (``layers.N.self_attn.k_scale`` / ``v_scale``, the older
  ``kv_scale`` for both, or ``k_proj.output_scale`` / ``v_proj.output_scale``: the names vLLM
  reads; a per-head scale becomes the largest of the layer's, which never saturates more);
- with ``calculate_kv_scales=True``, the first batch of real tokens: k_scale = max|k| /
  K_SCALE_CONSTANT, v_scale = max|v| / V_SCALE_CONSTANT (vLLM's constants, 200 and 100, which
  leave room for later tokens 2.2x and 4.5x larger than the first batch's in e4m3). Where the
  rotary embedding is fused into the cache write (CUDA), max|k| is taken before the rotation
  times sqrt(2): a rotation pair's norm bounds each of its rotated elements;
- else 1.0 (vLLM's default).
"""

from __future__ import annotations

import logging
import re
from typing import Optional

import torch

logger = logging.getLogger(__name__)

#: vLLM's kv_cache_dtype names -> the cache's torch dtype (None: the model's dtype)
KV_CACHE_DTYPES: dict[str, Optional[torch.dtype]] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

#: calculate_kv_scales: the first batch's max|k| and max|v| map to these codes (vLLM's constants)
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


#: the largest head size of CUDA's FP8 attention kernels (pagedllm/attention.h)
CUDA_FP8_MAX_HEAD_DIM = 128


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device | str,
                           head_dim: int | None = None, calculate_kv_scales: bool = False) -> torch.dtype:
    """The cache's torch dtype for vLLM's ``kv_cache_dtype`` name with a model of `dtype` (and
    head size `head_dim`) on `device`.

    ValueError naming the value for an unknown name, for calculate_kv_scales without an FP8 cache,
    or for FP8 with a model dtype the device's kernels do not pair with an FP8 cache (CUDA:
    bfloat16 / float16; CPU: float32 / bfloat16) or, on CUDA, a head size above 128, saying what
    to pass instead."""
    from pagedllm import ops

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported: use one of {list(KV_CACHE_DTYPES)}")
    cache = KV_CACHE_DTYPES[kv_cache_dtype]
    if cache is None:
        if calculate_kv_scales:
            raise ValueError("calculate_kv_scales=True needs an FP8 KV cache: pass kv_cache_dtype='fp8' (or "
                             "'fp8_e5m2'), or leave calculate_kv_scales off")
        return dtype
    device = torch.device(device)
    allowed = ops.fp8_query_dtypes(device)
    if dtype not in allowed:
        names = " or ".join(repr(str(d).removeprefix("torch.")) for d in allowed)
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} on {device.type} needs the model in {names}, got "
                         f"dtype={str(dtype).removeprefix('torch.')!r}: pass dtype={names.split(' or ')[0]} or "
                         "kv_cache_dtype='auto'")
    if device.type == "cuda" and head_dim is not None and head_dim > CUDA_FP8_MAX_HEAD_DIM:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} on cuda supports head_dim up to {CUDA_FP8_MAX_HEAD_DIM}, "
                         f"the model has {head_dim}: use kv_cache_dtype='auto'")
    return cache


_SCALE_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                         r"v_proj\.output_scale|q_scale|prob_scale|attn\.k_scale|attn\.v_scale)$")


def checkpoint_kv_scale(name: str) -> Optional[tuple[int, str]]:
    """(layer, which) for a checkpoint tensor holding an attention-side FP8 scale, else None; which is
    "k", "v", "kv" (both) or "" (a query / probability scale: not used here)."""
    m = _SCALE_NAME.match(name)
    if m is None:
        return None
    leaf = m.group(2).removeprefix("attn.")
    which = {"k_scale": "k", "k_proj.output_scale": "k", "v_scale": "v", "v_proj.output_scale": "v",
             "kv_scale": "kv"}.get(leaf, "")
    return int(m.group(1)), which


def scale_value(name: str, tensor: torch.Tensor) -> float:
    """The per-tensor scale a checkpoint tensor holds (a per-head vector: its largest entry).
    ValueError naming the tensor for a non-finite or non-positive scale."""
    t = tensor.detach().float().reshape(-1)
    if t.numel() == 0:
        raise ValueError(f"checkpoint tensor {name!r} is empty: expected an FP8 KV-cache scale")
    value = float(t.max())
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"checkpoint tensor {name!r} holds the KV-cache scale {value}: it must be finite and > 0")
    return value
