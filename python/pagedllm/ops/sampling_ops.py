"""Sampler kernels (``cpp/include/pagedllm/sampling_ops.h``), called with torch tensors."""

from __future__ import annotations

import torch

from pagedllm import _C
from pagedllm.ops import _view  # defined before pagedllm.ops imports this module


def argmax_rows(logits: torch.Tensor, vocab: int = 0) -> torch.Tensor:
    """int64 ``[R]``: the index of the largest of ``logits[r, :vocab]`` (``vocab`` 0: every
    column), the first one on a tie, as ``torch.argmax``. CPU, float32 or bfloat16 logits
    (several times faster than torch.argmax there); raises ValueError otherwise."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _C.argmax_rows(_view(out), _view(logits), int(vocab))
    return out
