"""pagedllm.ops.argmax_rows against torch.argmax (the sampler's greedy path): the CPU kernel, and
the CUDA kernel (marker `cuda`, on the GPU machine) on fresh random rows with planted ties, -inf
runs, NaN, strided and misaligned rows, and every dtype it takes."""

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


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _plant(logits, n, gen):
    """Ties at two random places (the first must win), a -inf run and a NaN in other rows."""
    rows = logits.shape[0]
    i, j = sorted(torch.randperm(n, generator=gen)[:2].tolist())
    logits[0, j] = logits[0, :n].float().max() + 1
    logits[0, i] = logits[0, j]
    if rows > 1:
        logits[1, : n // 2] = -float("inf")
    if rows > 2:
        logits[2, n // 3] = float("nan")
    return i


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,width,vocab,offset,pad", [
    (1, 128256, 0, 0, 5), (1, 128256, 0, 1, 5), (3, 151936, 151646, 0, 5), (4, 49152, 0, 3, 5),
    (256, 32000, 0, 0, 5), (2, 7, 0, 0, 5), (5, 1000, 999, 1, 5), (3, 33, 17, 0, 5),
    (4, 32000, 0, 0, 0), (6, 128256, 128000, 0, 0), (2, 151936, 151645, 0, 0)])
def test_argmax_rows_cuda_matches_torch(dtype, rows, width, vocab, offset, pad, gen):
    wide = torch.randn(rows, width + offset + pad, generator=gen).to(dtype).cuda()
    # row stride width + offset + pad: pad 0 with offset 0 gives contiguous 16-byte-aligned rows
    # (the vectorised kernel); otherwise rows (or the start) are misaligned (the scalar kernel)
    logits = wide[:, offset:offset + width]
    n = vocab or width
    first = _plant(logits, n, gen)
    got = ops.argmax_rows(logits, vocab)
    assert got.device == logits.device and got.dtype == torch.int64
    expected = logits[:, :n].float().cpu()
    expected = torch.where(expected.isnan(), torch.tensor(-float("inf")), expected).argmax(dim=-1)
    assert torch.equal(got.cpu(), expected)
    assert got[0].item() == first
    # the same rows through the CPU kernel (float32 copy) agree
    assert torch.equal(got.cpu(), ops.argmax_rows(logits.float().cpu().contiguous(), vocab))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3])
def test_argmax_rows_cuda_ties_at_chunk_boundaries(dtype, rows, gen):
    """A few long rows are split into chunks (cuda/sampling_ops.cu: ~4K columns each, as many as keep
    about one CTA per SM busy): the maximum tied on both sides of a chunk boundary and in a later
    chunk gives the first of them; a row ending in a partial vector (151,645 columns) too."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n in (128256, 151645):
        chunks = min(64, -(-n // 4096), max(1, sms // rows))  # the kernel's count (< 4: not split)
        chunk = -(-(-(-n // chunks)) // 8) * 8
        x = (torch.randn(rows, n, generator=gen) * 3).to(dtype).cuda()
        expected = []
        for r in range(rows):
            c = 1 + (r % max(1, chunks - 2))  # a boundary inside the row
            for col in (c * chunk - 1, c * chunk, min(n - 1, (c + 1) * chunk + 5)):
                x[r, col] = 100.0
            expected.append(c * chunk - 1)
        x[0, n - 1] = 100.0  # the last column (the partial vector) ties too: still the first wins
        assert ops.argmax_rows(x).tolist() == expected, (n, chunks, chunk)
        x[0, : n - 1] = -float("inf")
        assert ops.argmax_rows(x)[0].item() == n - 1  # the maximum alone in the tail


@pytest.mark.cuda
@needs_cuda
def test_argmax_rows_cuda_special_rows_graph_and_errors():
    x = torch.full((3, 4100), -float("inf"), device="cuda")
    x[1, :7] = float("nan")
    x[2] = float("nan")
    assert ops.argmax_rows(x).tolist() == [0, 7, 0]  # first -inf; NaN never chosen; all-NaN: 0
    # rows long enough to be split into chunks (the kernel's two passes): the same rules across
    # chunk boundaries — NaN-only and -inf-only chunks, the maximum tied in three chunks
    for dtype in (torch.float32, torch.bfloat16):
        y = torch.full((4, 128256), -float("inf"), dtype=dtype, device="cuda")
        y[0, :70000] = float("nan")
        y[1, 5000:] = 0.0
        y[1, 4095] = 3.0
        y[1, [90001, 12345]] = 3.0
        y[2] = float("nan")
        y[3, 128255] = -1.0
        assert ops.argmax_rows(y).tolist() == [70000, 4095, 0, 128255]
        assert ops.argmax_rows(y, 100000).tolist() == [70000, 4095, 0, 0]
    assert ops.argmax_rows(torch.empty(0, 10, device="cuda")).shape == (0,)
    # captured in a CUDA graph and replayed on new values
    logits = torch.zeros(2, 50000, device="cuda")
    out = torch.empty(2, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.argmax_rows(logits)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out.copy_(ops.argmax_rows(logits))
    for k in (17, 49999, 3):
        logits.zero_()
        logits[0, k] = 1.0
        logits[1, 49999 - k] = 2.0
        graph.replay()
        assert out.tolist() == [k, 49999 - k]
    with pytest.raises(ValueError, match="int32"):
        ops.argmax_rows(torch.zeros(2, 4, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="vocab = 9"):
        ops.argmax_rows(torch.zeros(2, 4, device="cuda"), 9)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ops.argmax_rows(torch.zeros(4, 2, device="cuda").t())
