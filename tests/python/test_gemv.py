"""The GEMV kernels of pagedllm/gemv.h (cuda/gemv.cu): gemv and silu_and_mul_gemv.

Each case draws fresh random inputs (the seed is printed) and compares the kernel with a float64
reference of the same product (x and weight as rounded to the dtype, one rounding at the end):
M = 1..8 tokens, odd N and K (the element-wise path), misaligned views, strided x rows, bias,
bfloat16 and float16, every tuning variant and K split (clusters); silu_and_mul_gemv also equals
silu_and_mul followed by gemv bit for bit. A CUDA-graph capture with programmatic dependent
launch on replays the same results as eager launches. CUDA cases carry the `cuda` marker; the
refusals (CPU tensors, float32, too many tokens, bad shapes) run everywhere the build allows.
"""

from __future__ import annotations

import random

import pytest
import torch

import pagedllm.ops as ops
from pagedllm import _C

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16, torch.float16]


def dtype_id(dt):
    return str(dt).removeprefix("torch.")


def rand(shape, dtype, gen, scale=1.0, offset=0):
    """Random values on the GPU; offset > 0: a view `offset` elements into its buffer (misaligned)."""
    n = 1
    for s in shape:
        n *= s
    buf = (torch.randn(n + offset, generator=gen, dtype=torch.float64) * scale).to(dtype).cuda()
    return buf[offset:].view(shape)


def reference(x, w, bias):
    y = x.double() @ w.double().T  # on the GPU, float64
    if bias is not None:
        y = y + bias.double()
    return y


def unravel(idx, shape):
    out = []
    for s in reversed(shape):
        out.append(idx % s)
        idx //= s
    return tuple(reversed(out))


def check(y, x, w, bias, dtype, what):
    torch.cuda.synchronize()
    ref = reference(x, w, bias)  # float64 on the GPU
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    # |error| <= half an ulp of the result (rounding) + fp32 accumulation error over K terms
    mag = x.double().abs() @ w.double().abs().T
    bound = ulp * ref.abs() + 1e-6 * mag + 1e-6
    err = (y.double() - ref).abs()
    bad = err > bound
    if bad.any():
        i = unravel(int((err - bound).argmax()), tuple(err.shape))
        raise AssertionError(f"{what}: {int(bad.sum())} of {err.numel()} values off; worst at {i}: "
                             f"got {float(y[i]):.6g}, expected {float(ref[i]):.6g}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 896), (37, 1000), (515, 333), (16, 8), (33, 4104), (7, 1)])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gemv_matches_float64(gen, dtype, m, n, k, bias):
    x = rand((m, k), dtype, gen)
    w = rand((n, k), dtype, gen, 0.05)
    b = rand((n,), dtype, gen) if bias else None
    y = ops.gemv(x, w, b)
    check(y, x, w, b, dtype, f"gemv m={m} n={n} k={k}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("variant", [1, 2, 3])
@pytest.mark.parametrize("warps", [1, 4, 8])
@pytest.mark.parametrize("splits", [1, 2, 4, 8])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_gemv_every_config(gen, dtype, variant, warps, splits, prefetch):
    m, n, k = random.Random(gen.initial_seed()).choice([(1, 6144, 4096), (4, 200, 2056), (8, 48, 14336)])
    x = rand((m, k), dtype, gen)
    w = rand((n, k), dtype, gen, 0.05)
    b = rand((n,), dtype, gen)
    cfg = dict(variant=variant, warps=warps, splits=splits, prefetch=prefetch)
    y = ops.gemv(x, w, b, config=cfg)
    check(y, x, w, b, dtype, f"gemv {cfg} m={m} n={n} k={k}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_gemv_strided_and_misaligned_x(gen, dtype, offset):
    m, n, k = 6, 300, 1024
    base = rand((m, 3 * k + offset), dtype, gen)
    x = base[:, offset:offset + k]  # row stride 3k + offset, possibly not 16-byte aligned
    w = rand((n, k), dtype, gen, 0.05)
    y = ops.gemv(x, w)
    check(y, x, w, None, dtype, f"strided x offset={offset}")
    wm = rand((n, k), dtype, gen, 0.05, offset=offset)  # misaligned weight: element-wise path
    check(ops.gemv(x, wm), x, wm, None, dtype, "misaligned weight")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("n,k", [(4096, 14336), (896, 4864), (100, 200), (33, 37)])
@pytest.mark.parametrize("variant", [0, 1, 2, 3])
def test_silu_and_mul_gemv(gen, dtype, m, n, k, variant):
    gate_up = rand((m, 2 * k), dtype, gen, 2.0)
    w = rand((n, k), dtype, gen, 0.05)
    b = rand((n,), dtype, gen)
    act = ops.silu_and_mul(torch.empty((m, k), dtype=dtype, device="cuda"), gate_up)
    fused = ops.gemv(gate_up, w, b, silu_and_mul=True, config=dict(variant=variant))
    same_cfg = ops.gemv(act, w, b, config=dict(variant=variant, splits=0))
    torch.cuda.synchronize()
    # same activation, same kernel arithmetic: bit for bit (splits auto in both)
    assert torch.equal(fused, same_cfg), f"fused differs from silu_and_mul + gemv in {int((fused != same_cfg).sum())} values"
    check(fused, act, w, b, dtype, f"silu_and_mul_gemv m={m} n={n} k={k}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
def test_graph_capture_chain_matches_eager(gen, pdl):
    """A chain of dependent kernels (rms_norm -> gemv -> silu_and_mul_gemv -> fused_add_rms_norm ->
    gemv), captured in a CUDA graph with PDL on or off: replays equal the eager results, also after
    the inputs change between replays (the graph reads them anew)."""
    dtype, m, h, inter = torch.bfloat16, 2, 1024, 2816
    before = ops.pdl_enabled()
    ops.set_pdl_enabled(pdl)
    try:
        x = rand((m, h), dtype, gen)
        norm_w = rand((h,), dtype, gen, 0.1) + 1
        w_up = rand((2 * inter, h), dtype, gen, 0.05)
        w_down = rand((h, inter), dtype, gen, 0.05)
        w_out = rand((h, h), dtype, gen, 0.05)

        def chain(inp):
            h1 = ops.rms_norm(torch.empty_like(inp), inp, norm_w, 1e-5)
            gu = ops.gemv(h1, w_up)
            d = ops.gemv(gu, w_down, silu_and_mul=True)
            res = inp.clone()
            ops.fused_add_rms_norm(d, res, norm_w, 1e-5)
            return ops.gemv(d, w_out)

        eager = chain(x)
        static_x = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(static_x)  # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                static_out = chain(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)
        x2 = rand((m, h), dtype, gen)
        static_x.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, chain(x2))
    finally:
        ops.set_pdl_enabled(before)


@pytest.mark.cuda
@needs_cuda
def test_l2_prefetch_leaves_data_and_order(gen):
    """l2_prefetch reads nothing into registers and writes nothing; a GEMV right after it (same
    stream, PDL on) still sees the input written just before."""
    w = rand((4096, 1024), torch.bfloat16, gen, 0.05)
    before = w.clone()
    x = torch.zeros(1, 1024, dtype=torch.bfloat16, device="cuda")
    src = rand((1, 1024), torch.bfloat16, gen)
    x.copy_(src)
    ops.l2_prefetch(w)
    y = ops.gemv(x, w)
    ops.l2_prefetch(w[1:3])  # unaligned start: rounded inward
    check(y, src, w, None, torch.bfloat16, "gemv after l2_prefetch")
    assert torch.equal(w, before)


# ---------------------------------------------------------------- refusals
def test_gemv_refuses_cpu_tensors():
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA only"):
        ops.gemv(x, w)
    out = torch.empty(1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA only"):
        _C.gemv(ops._view(out), ops._view(x), ops._view(w))
    assert not ops.gemv_supported("cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        ops.l2_prefetch(w)


@pytest.mark.cuda
@needs_cuda
def test_gemv_argument_errors():
    dev = "cuda"
    w = torch.zeros(8, 16, dtype=torch.bfloat16, device=dev)
    with pytest.raises(ValueError, match="float32 is not supported|dtype float32"):
        ops.gemv(torch.zeros(1, 16, device=dev), w.float())
    with pytest.raises(ValueError, match="at most 8"):
        ops.gemv(torch.zeros(9, 16, dtype=torch.bfloat16, device=dev), w)
    with pytest.raises(ValueError, match="in_features"):
        ops.gemv(torch.zeros(1, 15, dtype=torch.bfloat16, device=dev), w)
    with pytest.raises(ValueError, match="2 \\* in_features"):
        ops.gemv(torch.zeros(1, 16, dtype=torch.bfloat16, device=dev), w, silu_and_mul=True)
    with pytest.raises(ValueError, match="bias"):
        ops.gemv(torch.zeros(1, 16, dtype=torch.bfloat16, device=dev), w,
                 torch.zeros(7, dtype=torch.bfloat16, device=dev))
    with pytest.raises(ValueError, match="weight must be bfloat16"):
        ops.gemv(torch.zeros(1, 16, dtype=torch.bfloat16, device=dev), w.half())
    with pytest.raises(ValueError, match="weight must be contiguous"):
        ops.gemv(torch.zeros(1, 8, dtype=torch.bfloat16, device=dev), w.T)
    with pytest.raises(ValueError, match="config.splits"):
        ops.gemv(torch.zeros(1, 16, dtype=torch.bfloat16, device=dev), w, config=dict(splits=3))
    x = torch.zeros(1, 16, dtype=torch.bfloat16, device=dev)
    with pytest.raises(ValueError, match="overlaps"):
        ops.gemv(x, w, out=w[:1, :8])
    assert ops.gemv_supported(dev, torch.bfloat16) and not ops.gemv_supported(dev, torch.float32)
