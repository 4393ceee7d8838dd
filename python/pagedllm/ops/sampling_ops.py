"""Sampler kernels (``cpp/include/pagedllm/sampling_ops.h``), called with torch tensors."""

from __future__ import annotations

import torch

from pagedllm import _C
from pagedllm.ops import _stream, _view  # defined before pagedllm.ops imports this module


def argmax_rows(logits: torch.Tensor, vocab: int = 0) -> torch.Tensor:
    """int64 ``[R]`` on ``logits``' device: the index of the largest of ``logits[r, :vocab]``
    (``vocab`` 0: every column), the first one on a tie, as ``torch.argmax``. Unlike torch.argmax,
    NaN is never chosen over a number (a row of NaN only gives 0). float32 or bfloat16 logits on the CPU (several times faster than torch.argmax
    there), also float16 on CUDA (one CTA per row, on the current stream: ~28 us -> a few us for a
    128K-vocabulary row on an H200). Raises ValueError for another dtype, a strided last
    dimension or a vocab outside [0, V]."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _C.argmax_rows(_view(out), _view(logits), int(vocab), _stream(logits))
    return out
