"""GEMV for decode steps with few tokens (``cpp/include/pagedllm/gemv.h``), called with torch
tensors: ``y [M, N] = x [M, K] @ weight [N, K]^T (+ bias)`` for M <= :data:`GEMV_MAX_TOKENS`, and
the same product with ``x = SiLU(gate) * up`` read from a fused gate_up output (a Llama MLP's down
projection with ``silu_and_mul`` folded in).

CUDA only (bfloat16, float16; float32 is refused — use ``torch.nn.functional.linear``), launched
on ``torch.cuda.current_stream()`` so CUDA graphs capture it. fp32 accumulation and one rounding,
as F.linear; the summation order differs from cuBLAS, so results agree with F.linear within the
dtype's rounding, not bit for bit. Bad arguments raise ``ValueError`` naming the bad value.
"""

from __future__ import annotations

import torch

from pagedllm import _C
from pagedllm.ops import _stream, _view  # defined before pagedllm.ops imports this module

#: The most tokens (rows of x) the GEMV takes.
GEMV_MAX_TOKENS: int = int(_C.gemv_max_tokens)

_DTYPES = (torch.bfloat16, torch.float16)


def gemv_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether :func:`gemv` runs on ``device`` in ``dtype`` (CUDA build, CUDA device, bf16/fp16)."""
    return (torch.device(device).type == "cuda" and dtype in _DTYPES and bool(_C.gemv_built_with_cuda()))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, *, silu_and_mul: bool = False,
         config: dict | None = None) -> torch.Tensor:
    """``out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N])``; with ``silu_and_mul=True`` x is
    ``[M, 2K]`` and the product uses ``SiLU(x[:, :K]) * x[:, K:]`` (rounded as
    :func:`pagedllm.ops.silu_and_mul`). ``x`` rows may be strided (last dim contiguous);
    ``weight``, ``bias`` and ``out`` contiguous. Returns ``out`` (allocated when None).
    ``config``: tuning overrides for benchmarks (keys variant, warps, splits, prefetch; see
    ``GemvConfig`` in gemv.h). Raises ValueError on CPU tensors, float32, more than
    GEMV_MAX_TOKENS rows, or mismatched shapes."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda):
        where = x.device.type if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"gemv: x is on {where}; the GEMV kernels are CUDA only (on the cpu use "
                         "torch.nn.functional.linear)")
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    cfg = config or {}
    _C.gemv(_view(out), _view(x), _view(weight), None if bias is None else _view(bias), bool(silu_and_mul),
            _stream(x), int(cfg.get("variant", 0)), int(cfg.get("warps", 0)), int(cfg.get("splits", 0)),
            int(cfg.get("prefetch", -1)))
    return out


def l2_prefetch(tensor: torch.Tensor) -> None:
    """Ask the L2 cache to fetch ``tensor`` (contiguous, CUDA) on the current stream: an
    asynchronous hint (sm_90), e.g. the next projection's weight while decode attention runs."""
    _C.l2_prefetch(_view(tensor), _stream(tensor))


def pdl_enabled() -> bool:
    """Whether programmatic dependent launch is on (``pagedllm/cuda_runtime.h``)."""
    return bool(_C.pdl_enabled())


def set_pdl_enabled(enabled: bool) -> None:
    """Turn programmatic dependent launch on or off for launches made (and graphs captured)
    afterwards; the environment variable PAGEDLLM_NO_PDL turns it off at start."""
    _C.set_pdl_enabled(bool(enabled))
