"""pagedllm.ops.argmax_rows against torch.argmax (the sampler's greedy path on the CPU)."""

from __future__ import annotations


import pytest
import torch

import pagedllm.ops as ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width,vocab", [(0, 100, 0), (1, 7, 0), (5, 49152, 49152), (64, 49160, 49152),
                                              (300, 1000, 999), (3, 33, 17)])
def test_argmax_rows_matches_torch(dtype, rows, width, vocab, gen):
    wide = torch.randn(rows, width + 11, generator=gen).to(dtype)
    logits = wide[:, 3:3 + width]  # strided rows
    if rows:
        # ties: the first index must win, also across SIMD lanes and in the scalar tail
        n = vocab or width
        logits[0, n - 1] = logits[0, :n].max() + 1
        logits[0, 2] = logits[0, n - 1]
        if rows > 1:
            logits[-1, : n // 2] = -float("inf")
    got = ops.argmax_rows(logits, vocab)
    expected = logits[:, : vocab or width].float().argmax(dim=-1)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)
    if rows:
        assert got[0].item() == 2


def test_argmax_rows_all_minus_inf_and_errors():
    minus_inf = torch.full((2, 40), -float("inf"))
    minus_inf[1, :5] = float("nan")
    assert ops.argmax_rows(minus_inf).tolist() == [0, 5]
    with pytest.raises(ValueError, match="float16"):
        ops.argmax_rows(torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="vocab = 5"):
        ops.argmax_rows(torch.zeros(2, 4), 5)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ops.argmax_rows(torch.zeros(4, 2).t())
