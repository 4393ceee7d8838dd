"""Sampler kernels (``cpp/include/pagedllm/sampling_ops.h``), called with torch tensors."""

from __future__ import annotations

import torch

from pagedllm import _C
from pagedllm.ops import _stream, _view  # defined before pagedllm.ops imports this module


def argmax_rows(logits: torch.Tensor, vocab: int = 0) -> torch.Tensor:
    """int64 ``[R]`` on ``logits``' device: the index of the largest of ``logits[r, :vocab]``
    (``vocab`` 0: every column), the first one on a tie, as ``torch.argmax``. Unlike torch.argmax,
    NaN is never chosen over a number (a row of NaN only gives 0). float32 or bfloat16 logits on
    the CPU (several times faster than torch.argmax there), also float16 on CUDA (on the current
    stream; one CTA per row, or chunks of a few long rows merged by a second kernel: a
    128K-vocabulary row takes ~3.7 us on an H200 against ~28 us for torch.argmax). Raises
    ValueError for another dtype, a strided last dimension or a vocab outside [0, V]."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _C.argmax_rows(_view(out), _view(logits), int(vocab), _stream(logits))
    return out


def fill_placeholder_ids(input_ids: torch.Tensor, prev_rows: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Async scheduling's input fix-up, in place: ``input_ids[t] = sampled[prev_rows[t]]`` wherever
    ``prev_rows[t] >= 0``. input_ids int32 ``[T]``, prev_rows int32 ``[T]`` (SchedulerOutput.
    prev_sample_rows), sampled int64 ``[R]`` (the previous step's sampled ids, still on the
    device), contiguous, one device. On CUDA one small kernel on the current stream (no host
    read); on the CPU a row >= R raises ValueError, on CUDA such an entry is left as it is.
    Returns input_ids. Raises ValueError for other dtypes, shapes or devices."""
    _C.fill_placeholder_ids(_view(input_ids), _view(prev_rows), _view(sampled), _stream(input_ids))
    return input_ids
