"""Dense projections on the CPU with Intel AMX (``cpp/include/pagedllm/cpu_linear.h``), called
with torch tensors.

``amx_pack_linear_weight`` re-lays an ``nn.Linear`` weight ``[N, K]`` (bfloat16, N and K
multiples of 32) out as AMX tiles once; ``amx_linear`` then computes ``x @ weight.T + bias``
streaming that weight once per call for up to 256 rows (once per 256-row block beyond), float32
accumulation, the result rounded to bfloat16 once (as ``torch.nn.functional.linear``).
Two variants fuse the op that follows the projection into its epilogue, with the same bits as the
two ops apart: ``amx_linear_silu_mul`` (a gate_up projection, then SiLU-and-mul) and
``amx_linear_argmax`` (the LM head, then the greedy argmax, without writing the logits).
``amx_linear_supported()`` says whether this machine and build can run them. Bad arguments raise
``ValueError`` naming the bad value.
"""

from __future__ import annotations

import torch

from pagedllm import _C
from pagedllm.ops import _view  # defined before pagedllm.ops imports this module


def amx_linear_supported() -> bool:
    """Whether the AMX projection kernels run here (AMX-BF16 CPU, OS tile permission, build)."""
    return bool(_C.amx_linear_supported())


def amx_pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 ``[N / 32, K / 32, 2, 16, 32]``: ``weight`` ``[N, K]`` (bfloat16, CPU) as AMX B
    tiles (layout in ``cpu_linear.h``). Raises ValueError when N or K is not a multiple of 32."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"amx_pack_linear_weight: weight must be a 2-D tensor [out_features, in_features], "
                         f"got {getattr(weight, 'shape', type(weight).__name__)}")
    packed = torch.empty(_C.amx_packed_weight_shape(weight.shape[0], weight.shape[1]), dtype=weight.dtype)
    _C.amx_pack_linear_weight(_view(packed), _view(weight))
    return packed


def _check_ndims(op: str, x, packed) -> None:
    for name, t, ndim in (("x", x, 2), ("packed", packed, 5)):
        if not isinstance(t, torch.Tensor) or t.dim() != ndim:
            raise ValueError(f"{op}: {name} must be a {ndim}-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``out [M, N] = x [M, K] @ weight.T (+ bias [N])`` from ``packed = amx_pack_linear_weight(weight)``;
    bfloat16 x, out bfloat16 (default) or float32 (the bfloat16-rounded values, widened: what
    ``.float()`` of the bfloat16 result gives), contiguous last dimensions, not overlapping;
    float32 or bfloat16 bias. Returns ``out``."""
    _check_ndims("amx_linear", x, packed)
    if out is None:
        out = torch.empty((x.shape[0], packed.shape[0] * 32), dtype=x.dtype)
    _C.amx_linear(_view(out), _view(x), _view(packed), None if bias is None else _view(bias))
    return out


def amx_linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """``out [M, I] = silu(gate) * up`` where ``[gate | up] = x [M, K] @ weight.T (+ bias [2I])`` and
    ``packed = amx_pack_linear_weight(weight)`` of a gate_up weight ``[2I, K]`` (I a multiple of 32);
    bfloat16 throughout. Bit for bit ``silu_and_mul(amx_linear(x, packed, bias))``, without the
    ``[M, 2I]`` intermediate. Returns ``out``."""
    _check_ndims("amx_linear_silu_mul", x, packed)
    if out is None:
        out = torch.empty((x.shape[0], packed.shape[0] * 16), dtype=x.dtype)
    _C.amx_linear_silu_mul(_view(out), _view(x), _view(packed), None if bias is None else _view(bias))
    return out


def amx_linear_argmax(x: torch.Tensor, packed: torch.Tensor, vocab: int = 0, bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[M]``: per row, the column in ``[0, vocab)`` (0 = all) of the largest logit of
    ``amx_linear(x, packed, bias)`` (smallest column on ties), computed without writing the logits:
    the same ids as ``argmax_rows(amx_linear(x, packed, bias), vocab)`` (greedy sampling from the LM
    head). Returns ``out``."""
    _check_ndims("amx_linear_argmax", x, packed)
    if out is None:
        out = torch.empty((x.shape[0],), dtype=torch.int64)
    _C.amx_linear_argmax(_view(out), _view(x), _view(packed), int(vocab), None if bias is None else _view(bias))
    return out

