"""Fused elementwise ops of a decoder layer (``cpp/include/pagedllm/layer_ops.h``), called with
torch tensors: RMSNorm, RMSNorm with the residual add, SiLU-and-mul, rotary embedding (in place,
or fused with the paged KV-cache write).

Math in float32 with results rounded where Hugging Face transformers' eager modules round (see
the header), so a model using them matches HF. CPU: float32 and bfloat16 (strided rows accepted);
CUDA: float32, bfloat16 and float16 on contiguous tensors, launched on
``torch.cuda.current_stream()`` (``layer_ops_supported`` says which device and dtype have them).
``rotary_embedding`` has a CPU kernel only and ``rotary_embedding_and_cache`` a CUDA kernel only
so far. Bad arguments raise ``ValueError`` naming the bad value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm import _C
from pagedllm.ops import _stream, _view  # defined before pagedllm.ops imports this module

_CPU_DTYPES = (torch.float32, torch.bfloat16)
_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def layer_ops_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the fused layer ops (rms_norm, fused_add_rms_norm, silu_and_mul, and the rotary
    embedding in its device's form) run on ``device`` in ``dtype``."""
    kind = torch.device(device).type
    if kind == "cpu":
        return dtype in _CPU_DTYPES
    return kind == "cuda" and dtype in _CUDA_DTYPES and bool(_C.layer_ops_built_with_cuda())


class Fp8Rows(NamedTuple):
    """Activations quantized per token to FP8: q float8_e4m3fn [T, K], scale float32 [T, 1]
    (x ~ q * scale), as scaled_fp8_quant returns them; a norm can produce them in its own pass."""

    q: torch.Tensor
    scale: torch.Tensor


def _fp8_outputs(x: torch.Tensor):
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    return Fp8Rows(q, scale), _view(q.view(torch.uint8)), _view(scale.view(-1))


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, fp8: bool = False):
    """``out [T, N] = x [T, N] / sqrt(mean(x^2) + eps) * weight [N]``; returns ``out``, or with
    ``fp8`` (CUDA) ``(out, Fp8Rows)``: also out's per-token FP8 codes (scaled_fp8_quant's bytes), in
    the same kernel."""
    if not fp8:
        _C.rms_norm(_view(out), _view(x), _view(weight), float(eps), _stream(x))
        return out
    rows, q, scale = _fp8_outputs(x)
    _C.rms_norm(_view(out), _view(x), _view(weight), float(eps), _stream(x), q, scale)
    return out, rows


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       fp8: bool = False) -> "Fp8Rows | None":
    """In place: ``residual += x`` then ``x = rms_norm(residual) * weight`` (both ``[T, N]``). With
    ``fp8`` (CUDA) also returns x's per-token FP8 codes (Fp8Rows), in the same kernel."""
    if not fp8:
        _C.fused_add_rms_norm(_view(x), _view(residual), _view(weight), float(eps), _stream(x))
        return None
    rows, q, scale = _fp8_outputs(x)
    _C.fused_add_rms_norm(_view(x), _view(residual), _view(weight), float(eps), _stream(x), q, scale)
    return rows


def silu_and_mul(out: torch.Tensor, x: torch.Tensor, paired_rows: bool = False) -> torch.Tensor:
    """``out [T, I] = silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]``; returns ``out``. With
    ``paired_rows`` (CUDA only, I % 8 == 0) x's columns are in :func:`gate_up_paired_order` (the
    output of a gate_up projection whose weight rows were so permuted); out is in the standard
    order either way."""
    _C.silu_and_mul(_view(out), _view(x), _stream(x), bool(paired_rows))
    return out


def scaled_fp8_quant(x: torch.Tensor) -> "Fp8Rows":
    """Per-token dynamic FP8 quantization of ``x [T, K]`` (CUDA, contiguous; one kernel):
    ``(float8_e4m3fn [T, K], float32 scale [T, 1])`` with ``scale = max(max|x[t]| * float(1 / 448), FLT_MIN)``
    and ``e4m3(clamp(x / scale, -448, 448))`` — the bytes of PyTorch's formula."""
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    _C.scaled_fp8_quant(_view(out.view(torch.uint8)), _view(scale.view(-1)), _view(x), _stream(x))
    return Fp8Rows(out, scale)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Rotate ``query [T, Hq, D]`` and ``key [T, Hkv, D]`` in place (GPT-NeoX "rotate half"
    layout) by ``positions`` (int64 ``[T]``). ``cos_sin_cache [max_position, R]``: cos of the R/2
    frequencies, then their sin, in the query's dtype; features ``>= R`` are left as they are.
    CPU only so far (on CUDA: :func:`rotary_embedding_and_cache`)."""
    _C.rotary_embedding(_view(positions), _view(query), _view(key), _view(cos_sin_cache))


def rotary_embedding_and_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                               query_out: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, paired_rows: bool = False, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> None:
    """:func:`rotary_embedding`'s rotation fused with ``reshape_and_cache``: the rotated query goes
    to ``query_out [T, Hq, D]`` (contiguous), the rotated key and ``value`` go into the paged
    caches at ``slot_mapping`` (int64 ``[T]``; a slot < 0 writes nothing). ``query``, ``key``,
    ``value`` are only read and may be strided views into one QKV tensor (heads contiguous).
    ``cos_cache``/``sin_cache`` ``[max_position, R/2]``: the two halves of ``cos_sin_cache`` as
    separate tables. ``paired_rows``: each query and key head comes in the order of
    :func:`rotary_paired_order` (the output of a qkv weight permuted for the GEMV's rope
    epilogue; needs R == D, D % 16 == 0); ``query_out`` and the caches get the standard order.
    FP8 caches store ``key / k_scale`` and ``value / v_scale`` (float32 ``[1]`` tensors on the
    device; None = 1.0), as :func:`pagedllm.ops.reshape_and_cache`. CUDA only so far."""
    _C.rotary_embedding_and_cache(_view(positions), _view(query), _view(key), _view(value), _view(cos_cache),
                                  _view(sin_cache), _view(query_out), _view(key_cache), _view(value_cache),
                                  _view(slot_mapping), _stream(query), bool(paired_rows),
                                  None if k_scale is None else _view(k_scale),
                                  None if v_scale is None else _view(v_scale))


def rotary_paired_order(head_size: int) -> torch.Tensor:
    """int64 ``[head_size]``: the feature at each row of a head in the paired-rows order
    (``rotary_paired_row`` in layer_ops.h; full rotary, head_size % 16 == 0): ``w[order]`` puts
    the rows of one head of a q or k projection weight ``w [head_size, K]`` in that order, which
    puts the two features (j, j + head_size / 2) of every rotary pair 8 rows apart in one 16-row
    tile. Raises ValueError for a head_size that is not a positive multiple of 16."""
    if head_size <= 0 or head_size % 16:
        raise ValueError(f"rotary_paired_order: head_size must be a positive multiple of 16, got {head_size}")
    order = torch.empty(head_size, dtype=torch.int64)
    for feature in range(head_size):
        order[_C.rotary_paired_row(feature, head_size // 2)] = feature
    return order


def gate_up_paired_order(intermediate_size: int) -> torch.Tensor:
    """int64 ``[2 * intermediate_size]``: the row of a fused ``[gate; up]`` projection weight at
    each row of the paired gate/up order (``gate_up_paired_row`` in layer_ops.h): ``w[order]``
    makes every 16-row tile 8 gate rows followed by their 8 up rows, so the GEMV writes
    ``SiLU(gate) * up`` itself (``ops.gemv(..., silu_paired_rows=True)``) and
    ``silu_and_mul(..., paired_rows=True)`` reads that order. Raises ValueError for an
    intermediate_size that is not a positive multiple of 8."""
    if intermediate_size <= 0 or intermediate_size % 8:
        raise ValueError(f"gate_up_paired_order: intermediate_size must be a positive multiple of 8, got "
                         f"{intermediate_size}")
    return torch.tensor([_C.gate_up_paired_row(row, intermediate_size) for row in range(2 * intermediate_size)],
                        dtype=torch.int64)
