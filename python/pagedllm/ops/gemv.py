"""GEMV for decode steps with few tokens (``cpp/include/pagedllm/gemv.h``), called with torch
tensors: ``y [M, N] = x [M, K] @ weight [N, K]^T (+ bias)`` for M <= :data:`GEMV_MAX_TOKENS`, with
optional fusions that save a kernel launch each in a decoder layer:

* ``silu_and_mul=True``: ``x = SiLU(gate) * up`` read from a fused gate_up output (a Llama MLP's
  down projection with ``silu_and_mul`` folded in);
* ``norm_weight=g, eps=e``: ``x = rms_norm(input, g, e)`` (the input / post-attention norm before
  the qkv / gate_up projection, the final norm before the LM head);
* ``residual=r``: ``y = y + r`` rounded as gemv then fused_add_rms_norm's add; ``out=r`` updates a
  residual stream in place (after the o / down projection).
* ``rope=GemvRope(...)``: ``y`` is a fused qkv projection; the rotary embedding and the KV-cache
  write of :func:`pagedllm.ops.rotary_embedding_and_cache` run in the same kernel (bit for bit),
  the last CTA of each head doing that head — or, with ``paired_rows`` (the weight's q and k rows
  in :func:`pagedllm.ops.rotary_paired_order`), every CTA rotating its own rows in registers.
* ``silu_paired_rows=True``: the weight is a gate_up projection in
  :func:`pagedllm.ops.gate_up_paired_order`; ``y [M, N / 2] = SiLU(gate) * up`` is written by
  each CTA from its own rows (:func:`pagedllm.ops.silu_and_mul` as an epilogue: no kernel, bit
  for bit as gemv on the standard-order weight followed by silu_and_mul).

CUDA only (bfloat16, float16; float32 is refused — use ``torch.nn.functional.linear``), launched
on ``torch.cuda.current_stream()`` so CUDA graphs capture it. fp32 accumulation and one rounding,
as F.linear; the summation order differs from cuBLAS, so results agree with F.linear within the
dtype's rounding, not bit for bit. Bad arguments raise ``ValueError`` naming the bad value.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedllm import _C
from pagedllm.ops import _stream, _view  # defined before pagedllm.ops imports this module

#: The most tokens (rows of x) the GEMV takes.
GEMV_MAX_TOKENS: int = int(_C.gemv_max_tokens)

_DTYPES = (torch.bfloat16, torch.float16)


@dataclasses.dataclass
class GemvRope:
    """The rotary + KV-cache epilogue of a qkv GEMV (``GemvRope`` in gemv.h): the arguments of
    :func:`pagedllm.ops.rotary_embedding_and_cache` whose query, key and value are the three parts
    of the GEMV's output ``[M, (num_heads + 2 num_kv_heads) * head_size]``, plus ``counters``: int32
    ``[>= num_heads + 2 num_kv_heads]`` on the device, all zero (each call leaves them zero; use
    one counters tensor from one stream; after a launch that failed midway, ``counters.zero_()``
    before the next call: nonzero counters are not detected). head_size must be a multiple of 32.
    ``paired_rows=True``: the weight's (and bias's) rows of every query and key head are in the
    order of :func:`pagedllm.ops.rotary_paired_order`; each CTA then rotates its own rows (no
    counters needed) and query_out / the caches still get the standard order, bit for bit as
    without it on the unpermuted weight; the output's q and k parts stay in the paired order.
    Needs full rotary (rotary_dim == head_size). ``k_scale`` / ``v_scale``: an FP8 cache's scales
    (as for :func:`pagedllm.ops.reshape_and_cache`)."""

    num_heads: int
    num_kv_heads: int
    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    query_out: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    counters: torch.Tensor | None = None
    paired_rows: bool = False
    #: FP8 caches: float32 [1] scales on the device (the caches store key / k_scale, value / v_scale)
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def gemv_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether :func:`gemv` runs on ``device`` in ``dtype`` (CUDA build, CUDA device, bf16/fp16)."""
    return (torch.device(device).type == "cuda" and dtype in _DTYPES and bool(_C.gemv_built_with_cuda()))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, *, silu_and_mul: bool = False,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
         residual: torch.Tensor | None = None, rope: GemvRope | None = None,
         silu_paired_rows: bool = False, config: dict | None = None) -> torch.Tensor:
    """``out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]) (+ residual [M, N])``.

    With ``silu_and_mul=True`` x is ``[M, 2K]`` and the product uses ``SiLU(x[:, :K]) * x[:, K:]``
    (rounded as :func:`pagedllm.ops.silu_and_mul`). With ``norm_weight`` ``[K]`` the product uses
    ``rms_norm(x, norm_weight, eps)`` (rounded as :func:`pagedllm.ops.rms_norm`; the fp32 sum of
    squares is taken in another order, so an element can differ by one ulp where its rounding was
    a near tie). With ``residual`` the rounded product plus ``residual`` is rounded again (as
    gemv followed by :func:`pagedllm.ops.fused_add_rms_norm`'s add); ``out`` may be ``residual``
    itself (in place). With ``rope`` (:class:`GemvRope`) the rotary embedding and the paged KV-cache
    write of a qkv projection follow in the same kernel (``out`` keeps the unrotated qkv). With
    ``silu_paired_rows`` (weight rows in :func:`pagedllm.ops.gate_up_paired_order`, N % 16 == 0)
    ``out`` is ``[M, N / 2] = SiLU(gate) * up`` (not with residual, rope, silu_and_mul or a float32
    out).
    ``x`` rows may be strided (last dim contiguous); ``weight``, ``bias``,
    ``norm_weight``, ``residual`` and ``out`` contiguous. A float32 ``out`` receives each element
    rounded to x's dtype (what ``.float()`` of the x-dtype result gives, without that kernel; not
    with ``residual`` or ``rope``). Returns ``out`` (allocated in x's dtype when None).
    ``config``: tuning overrides for benchmarks (keys variant, warps, splits, prefetch; see
    ``GemvConfig`` in gemv.h). Raises ValueError on CPU tensors, float32, more than
    GEMV_MAX_TOKENS rows, mismatched shapes or dtypes, or a prologue too large for the device's
    shared memory (see :func:`gemv_fusion_fits`)."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda):
        where = x.device.type if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"gemv: x is on {where}; the GEMV kernels are CUDA only (on the cpu use "
                         "torch.nn.functional.linear)")
    if out is None:
        n = weight.shape[0] // 2 if silu_paired_rows else weight.shape[0]
        out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    cfg = config or {}
    rope_views = None
    if rope is not None:
        fields = ("positions", "cos_cache", "sin_cache", "query_out", "key_cache", "value_cache", "slot_mapping")
        missing = [f for f in fields if getattr(rope, f) is None]
        if missing:
            raise ValueError(f"gemv: GemvRope.{missing[0]} is None; the rope epilogue needs {', '.join(fields)}")
        rope_views = [_view(getattr(rope, f)) for f in fields]
        if rope.counters is not None:
            rope_views.append(_view(rope.counters))
    _C.gemv(_view(out), _view(x), _view(weight), None if bias is None else _view(bias), bool(silu_and_mul),
            _stream(x), int(cfg.get("variant", 0)), int(cfg.get("warps", 0)), int(cfg.get("splits", 0)),
            int(cfg.get("prefetch", -1)), None if norm_weight is None else _view(norm_weight), float(eps),
            None if residual is None else _view(residual),
            rope_views,
            0 if rope is None else int(rope.num_heads), 0 if rope is None else int(rope.num_kv_heads),
            rope is not None and bool(rope.paired_rows), bool(silu_paired_rows),
            None if rope is None or rope.k_scale is None else _view(rope.k_scale),
            None if rope is None or rope.v_scale is None else _view(rope.v_scale))
    return out


def gemv_fusion_fits(tokens: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether the ``norm_weight`` / ``silu_and_mul`` prologues of :func:`gemv` (which stage
    tokens x in_features elements in shared memory per CTA) fit the current CUDA device."""
    return bool(_C.gemv_fusion_fits(int(tokens), int(in_features), str(dtype).removeprefix("torch.")))


def pdl_enabled() -> bool:
    """Whether programmatic dependent launch is on (``pagedllm/cuda_runtime.h``)."""
    return bool(_C.pdl_enabled())


def set_pdl_enabled(enabled: bool) -> None:
    """Turn programmatic dependent launch on or off for launches made (and graphs captured)
    afterwards; the environment variable PAGEDLLM_NO_PDL turns it off at start."""
    _C.set_pdl_enabled(bool(enabled))
