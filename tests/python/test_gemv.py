"""The GEMV kernels of pagedllm/gemv.h (cuda/gemv.cu): gemv, silu_and_mul_gemv and the fusions
(RMSNorm prologue, SiLU-and-mul prologue staged in shared memory, residual epilogue).

Each case draws fresh random inputs (the seed is printed) and compares the kernel with a float64
reference of the same product (x and weight as rounded to the dtype, one rounding at the end):
M = 1..8 tokens, odd N and K (the element-wise path), misaligned views, strided x rows, bias,
bfloat16 and float16, every tuning variant and K split (clusters); silu_and_mul_gemv also equals
silu_and_mul followed by gemv bit for bit. A CUDA-graph capture with programmatic dependent
launch on replays the same results as eager launches. CUDA cases carry the `cuda` marker; the
refusals (CPU tensors, float32, too many tokens, bad shapes) run everywhere the build allows.

Fusions: the RMSNorm prologue against a float64 norm + product on fresh random inputs, and bit for
bit against rms_norm + gemv (same config) on inputs whose sums of squares are exact in float32 in
any order (then both kernels compute the same inv; on general inputs the summation order differs
and a normalised element can move by one ulp on a near tie, so general inputs are checked against
float64 only); the residual epilogue bit for bit against gemv + a bf16/fp16 add, in place and not,
and against float64; every tuning config; a fused decoder-layer chain in a CUDA graph with PDL
equal to eager and close to the unfused ops; the Llama model's fused decode step against its
unfused one; argument errors.
"""

from __future__ import annotations

import random

import pytest
import torch

import pagedllm.ops as ops
from pagedllm import _C

from graph_capture import capture_graph
from tiny_models import PagedHarness

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
    # same activation, same kernel arithmetic with the same split: bit for bit (the fused form stages
    # x in shared memory and may split K further where M x K does not fit: pin the split there)
    splits = 8 if k > 8192 else 0
    pinned = ops.gemv(gate_up, w, b, silu_and_mul=True, config=dict(variant=variant, splits=splits))
    same_cfg = ops.gemv(act, w, b, config=dict(variant=variant, splits=splits))
    torch.cuda.synchronize()
    assert torch.equal(pinned, same_cfg), f"fused differs from silu_and_mul + gemv in {int((pinned != same_cfg).sum())} values"
    check(fused, act, w, b, dtype, f"silu_and_mul_gemv m={m} n={n} k={k}")


def assert_graph_replays_equal_eager(fn, x, eager, gen):
    """Captures fn on a static copy of x (a 2-D CUDA tensor) in a CUDA graph on a side stream,
    after one warm-up call there, and asserts bit for bit: the replay equals `eager` (fn(x) run
    eagerly by the caller); after fresh random values of x's shape and dtype (drawn from gen) are
    copied into the static input, a second replay equals fn of them run eagerly."""
    static_x = x.clone()
    graph, static_out = capture_graph(lambda: fn(static_x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    x2 = rand(tuple(x.shape), x.dtype, gen)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, fn(x2))


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

        assert_graph_replays_equal_eager(chain, x, chain(x), gen)
    finally:
        ops.set_pdl_enabled(before)


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


# ---------------------------------------------------------------- fusions
ULP = {torch.bfloat16: 2**-8, torch.float16: 2**-11}  # relative rounding error (half an ulp)


def norm64(h, g, eps):
    """rms_norm in float64, no intermediate rounding."""
    h64 = h.double()
    return h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps) * g.double()


def check_bound(y, ref, bound, what):
    torch.cuda.synchronize()
    err = (y.double() - ref).abs()
    bad = err > bound
    if bad.any():
        i = unravel(int((err - bound).argmax()), tuple(err.shape))
        raise AssertionError(f"{what}: {int(bad.sum())} of {err.numel()} values off; worst at {i}: "
                             f"got {float(y[i]):.6g}, expected {float(ref[i]):.6g} (bound {float(bound[i]):.3g})")


def check_norm_gemv(y, h, g, eps, w, bias, dtype, what, residual=None):
    """y against float64 rms_norm(h) @ w^T (+ bias) (+ residual): x is rounded twice in the kernel
    (h * inv, then * g), the product once, and the residual sum once more."""
    x64 = norm64(h, g, eps)
    prod = x64 @ w.double().T + (0 if bias is None else bias.double())
    mag = x64.abs() @ w.double().abs().T
    ulp = ULP[dtype]
    bound = ulp * prod.abs() + 2.05 * ulp * mag + 1e-6 * mag + 1e-6
    ref = prod
    if residual is not None:
        ref = prod + residual.double()
        bound = bound + ulp * ref.abs()
    check_bound(y, ref, bound, what)


def exact_rows(shape, dtype, gen):
    """Values k / 8 with |k| <= 32: squares are multiples of 1/64 up to 16, so any sum of up to
    16,384 of them is exact in float32 (whatever the order)."""
    return (torch.randint(-32, 33, shape, generator=gen).double() / 8).to(dtype).cuda()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 896), (515, 333), (33, 4104), (7, 1), (130, 14336)])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gemv_rms_norm_prologue(gen, dtype, m, n, k, bias):
    eps = random.Random(gen.initial_seed()).choice([1e-6, 1e-5, 0.25])
    w = rand((n, k), dtype, gen, 0.05)
    b = rand((n,), dtype, gen) if bias else None
    g = (rand((k,), dtype, gen, 0.3).double() + 1).to(dtype)
    # fresh random h: against float64
    h = rand((m, k), dtype, gen, 3.0)
    y = ops.gemv(h, w, b, norm_weight=g, eps=eps)
    check_norm_gemv(y, h, g, eps, w, b, dtype, f"norm gemv m={m} n={n} k={k} eps={eps}")
    # sums of squares exact in float32: bit for bit equal to rms_norm + gemv with the same split
    he = exact_rows((m, k), dtype, gen)
    splits = random.Random(gen.initial_seed() + 1).choice([2, 4, 8] if m * k > 50000 else [0, 1, 2, 4, 8])
    fused = ops.gemv(he, w, b, norm_weight=g, eps=eps, config=dict(splits=splits))
    x = ops.rms_norm(torch.empty_like(he), he, g, eps)
    unfused = ops.gemv(x, w, b, config=dict(splits=splits))
    torch.cuda.synchronize()
    assert torch.equal(fused, unfused), (f"norm gemv differs from rms_norm + gemv (splits={splits}) in "
                                         f"{int((fused != unfused).sum())} of {fused.numel()} values")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_automatic_config_is_the_same_with_a_prologue(gen, m):
    """The automatic tiling does not depend on the prologue: at row counts where it takes variant 3
    for one wave (Llama-3-8B's qkv, 6,144 rows, on the H200) and around them, the RMSNorm prologue
    GEMV sums exactly as rms_norm + gemv (exact sums of squares: bit for bit)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dtype, k = torch.bfloat16, 4096
    for n in sorted({6144, 16 * 2 * sms + 16, 16 * 3 * sms}):
        w = rand((n, k), dtype, gen, 0.05)
        g = (rand((k,), dtype, gen, 0.3).double() + 1).to(dtype)
        he = exact_rows((m, k), dtype, gen)
        fused = ops.gemv(he, w, norm_weight=g, eps=1e-5)
        unfused = ops.gemv(ops.rms_norm(torch.empty_like(he), he, g, 1e-5), w)
        torch.cuda.synchronize()
        assert torch.equal(fused, unfused), f"n={n}: {int((fused != unfused).sum())} of {fused.numel()} values differ"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 14336), (515, 333), (7, 1), (33, 4104)])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "out"])
def test_gemv_residual_epilogue(gen, dtype, m, n, k, bias, inplace):
    x = rand((m, k), dtype, gen)
    w = rand((n, k), dtype, gen, 0.05)
    b = rand((n,), dtype, gen) if bias else None
    r = rand((m, n), dtype, gen, 2.0)
    r_before = r.clone()
    if inplace:
        y = ops.gemv(x, w, b, out=r, residual=r)
        assert y.data_ptr() == r.data_ptr()
    else:
        y = ops.gemv(x, w, b, residual=r)
        assert torch.equal(r, r_before)
    expected = ops.gemv(x, w, b) + r_before  # torch rounds the sum once: T(T(x W^T + b) + r)
    torch.cuda.synchronize()
    assert torch.equal(y, expected), f"residual gemv differs from gemv + add in {int((y != expected).sum())} values"
    prod = reference(x, w, b)
    ref = prod + r_before.double()
    ulp = ULP[dtype]
    mag = x.double().abs() @ w.double().abs().T
    check_bound(y, ref, ulp * (prod.abs() + ref.abs()) + 1e-6 * mag + 1e-6, f"residual gemv m={m} n={n} k={k}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("variant", [1, 2, 3])
@pytest.mark.parametrize("warps", [1, 8])
@pytest.mark.parametrize("splits", [0, 2, 8])
@pytest.mark.parametrize("kind", ["norm", "silu", "norm+residual", "silu+residual"])
def test_fused_gemv_every_config(gen, dtype, variant, warps, splits, kind):
    m, n, k = random.Random(gen.initial_seed()).choice([(1, 6144, 4096), (4, 200, 2056), (8, 48, 14336),
                                                        (3, 77, 1000), (5, 300, 333)])
    cfg = dict(variant=variant, warps=warps, splits=splits)
    w = rand((n, k), dtype, gen, 0.05)
    b = rand((n,), dtype, gen)
    r = rand((m, n), dtype, gen) if "residual" in kind else None
    what = f"{kind} gemv {cfg} m={m} n={n} k={k}"
    if kind.startswith("norm"):
        h = rand((m, k), dtype, gen, 2.0)
        g = (rand((k,), dtype, gen, 0.3).double() + 1).to(dtype)
        y = ops.gemv(h, w, b, norm_weight=g, eps=1e-5, residual=r, config=cfg)
        check_norm_gemv(y, h, g, 1e-5, w, b, dtype, what, residual=r)
    else:
        gate_up = rand((m, 2 * k), dtype, gen, 2.0)
        act = ops.silu_and_mul(torch.empty((m, k), dtype=dtype, device="cuda"), gate_up)
        y = ops.gemv(gate_up, w, b, silu_and_mul=True, residual=r, config=cfg)
        if r is None:
            check(y, act, w, b, dtype, what)
        else:
            prod = reference(act, w, b)
            ref = prod + r.double()
            mag = act.double().abs() @ w.double().abs().T
            check_bound(y, ref, ULP[dtype] * (prod.abs() + ref.abs()) + 1e-6 * mag + 1e-6, what)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
@pytest.mark.parametrize("m", [1, 5])
def test_fused_layer_chain_graph_matches_eager_and_unfused(gen, pdl, m):
    """A decoder layer's projections with the fusions (norm + qkv, o + residual in place, norm +
    gate_up, SiLU + down + residual in place, norm + LM head) as a CUDA graph with PDL on or off:
    replays equal the eager fused chain bit for bit (also after the input changes); the fused chain
    stays within bf16 rounding of the same chain of unfused ops (rms_norm / fused_add_rms_norm,
    silu_and_mul, gemv)."""
    dtype, h, inter, qkv_n, vocab = torch.bfloat16, 1024, 2816, 1536, 3000
    before = ops.pdl_enabled()
    ops.set_pdl_enabled(pdl)
    try:
        x0 = rand((m, h), dtype, gen)
        n1, n2, n3 = [(rand((h,), dtype, gen, 0.2).double() + 1).to(dtype) for _ in range(3)]
        w_qkv = rand((qkv_n, h), dtype, gen, 0.03)
        w_o = rand((h, h), dtype, gen, 0.03)
        w_gu = rand((2 * inter, h), dtype, gen, 0.03)
        w_down = rand((h, inter), dtype, gen, 0.03)
        w_head = rand((vocab, h), dtype, gen, 0.03)

        def fused(inp):
            stream = inp.clone()
            for _ in range(2):  # two layers
                qkv = ops.gemv(stream, w_qkv, norm_weight=n1, eps=1e-5)
                ops.gemv(qkv[:, :h], w_o, out=stream, residual=stream)
                gu = ops.gemv(stream, w_gu, norm_weight=n2, eps=1e-5)
                ops.gemv(gu, w_down, out=stream, residual=stream, silu_and_mul=True)
            return ops.gemv(stream, w_head, norm_weight=n3, eps=1e-5)

        def unfused(inp):
            residual = inp.clone()
            hidden = ops.rms_norm(torch.empty_like(inp), inp, n1, 1e-5)
            for layer in range(2):
                if layer:
                    ops.fused_add_rms_norm(hidden, residual, n1, 1e-5)
                qkv = ops.gemv(hidden, w_qkv)
                o = ops.gemv(qkv[:, :h], w_o)
                ops.fused_add_rms_norm(o, residual, n2, 1e-5)
                gu = ops.gemv(o, w_gu)
                act = ops.silu_and_mul(torch.empty((m, inter), dtype=dtype, device="cuda"), gu)
                hidden = ops.gemv(act, w_down)
            ops.fused_add_rms_norm(hidden, residual, n3, 1e-5)
            return ops.gemv(hidden, w_head)

        eager = fused(x0)
        ref = unfused(x0)
        torch.cuda.synchronize()
        scale = float(ref.abs().max())
        diff = float((eager.float() - ref.float()).abs().max())
        assert scale > 0.1 and diff < 0.03 * scale, f"fused chain differs from the unfused ops by {diff} (max {scale})"
        assert_graph_replays_equal_eager(fused, x0, eager, gen)
    finally:
        ops.set_pdl_enabled(before)


LLAMA_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512, intermediate_size=1376,
                    num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1000,
                    max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
QWEN2_CONFIG = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=320, intermediate_size=604,
                    num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1, vocab_size=777,
                    max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("config", [LLAMA_CONFIG, QWEN2_CONFIG], ids=["llama", "qwen2"])
def test_model_gemv_fusion_levels_agree(tmp_path, gen, monkeypatch, config):
    """The Llama model's decode steps (3 sequences, 1..3 steps after a prefill) with PAGEDLLM_GEMV_FUSE
    0 (separate norm / residual / SiLU kernels), 1 and 2, same weights and caches: the fused levels
    take the fused path and their logits agree with level 0 to bf16 rounding."""
    import json

    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.dummy import init_dummy_weights
    from pagedllm.model_executor.models import LlamaForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_pretrained(tmp_path)
    dev, dtype, bs = torch.device("cuda"), torch.bfloat16, 16
    model = LlamaForCausalLM(cfg, dtype, dev, max_positions=256)
    init_dummy_weights(model, seed=int(torch.randint(0, 1000, (1,), generator=gen)), std=0.08)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    lens = [30, 12, 19]
    ids = [torch.randint(0, cfg.vocab_size, (n + 3,), generator=gen) for n in lens]
    results = {}
    for level in (0, 1, 2):
        monkeypatch.setenv("PAGEDLLM_GEMV_FUSE", str(level))
        harness = PagedHarness(model, len(lens), max(lens) + 3, block_size=bs)  # fresh caches, same blocks
        steps = [[(s, 0, n) for s, n in enumerate(lens)]]  # prefill (> 8 tokens: unfused)
        steps += [[(s, n + i, n + i + 1) for s, n in enumerate(lens)][: 3 - i] for i in range(3)]  # 3, 2, 1 tokens
        logits = []
        for chunks in steps:
            tokens = sum(b - a for _, a, b in chunks)
            assert model._gemv_fusion(tokens) == (level if tokens <= 8 else 0)
            logits.append(harness.step([(s, ids[s][a:b].tolist()) for s, a, b in chunks]).cpu())
        results[level] = torch.cat(logits)
    scale = float(results[0].abs().max())
    for level in (1, 2):
        diff = float((results[level] - results[0]).abs().max())
        assert scale > 0.1 and diff < 0.03 * scale, f"level {level} logits differ from level 0 by {diff} (max {scale})"


@pytest.mark.cuda
@needs_cuda
def test_fused_gemv_argument_errors():
    dev, bf = "cuda", torch.bfloat16
    w = torch.zeros(8, 16, dtype=bf, device=dev)
    x = torch.zeros(2, 16, dtype=bf, device=dev)
    g = torch.ones(16, dtype=bf, device=dev)
    with pytest.raises(ValueError, match=r"norm_weight dimension 0 \(in_features, must match weight.size\(1\)\) must be 16, got 15"):
        ops.gemv(x, w, norm_weight=g[:15])
    with pytest.raises(ValueError, match="norm_weight must be 1-D"):
        ops.gemv(x, w, norm_weight=g.view(2, 8))
    with pytest.raises(ValueError, match="norm_weight must be bfloat16, got float16"):
        ops.gemv(x, w, norm_weight=g.half())
    with pytest.raises(ValueError, match="eps must be finite and >= 0, got -1"):
        ops.gemv(x, w, norm_weight=g, eps=-1.0)
    with pytest.raises(ValueError, match="norm_weight .* and silu_and_mul cannot be combined"):
        ops.gemv(torch.zeros(2, 32, dtype=bf, device=dev), w, norm_weight=g, silu_and_mul=True)
    with pytest.raises(ValueError, match="out overlaps norm_weight"):
        big = torch.ones(64, dtype=bf, device=dev)
        ops.gemv(x, w, norm_weight=big[:16], out=big[:16].view(2, 8))
    r = torch.zeros(2, 8, dtype=bf, device=dev)
    with pytest.raises(ValueError, match=r"residual dimension 1 \(out_features, must match weight.size\(0\)\) must be 8, got 7"):
        ops.gemv(x, w, residual=torch.zeros(2, 7, dtype=bf, device=dev))
    with pytest.raises(ValueError, match=r"residual dimension 0 \(num_tokens, must match input\) must be 2, got 3"):
        ops.gemv(x, w, residual=torch.zeros(3, 8, dtype=bf, device=dev))
    with pytest.raises(ValueError, match="residual must be bfloat16, got float32"):
        ops.gemv(x, w, residual=r.float())
    with pytest.raises(ValueError, match="residual must be contiguous"):
        ops.gemv(x, w, residual=torch.zeros(8, 2, dtype=bf, device=dev).T)
    buf = torch.zeros(24, dtype=bf, device=dev)
    with pytest.raises(ValueError, match="residual overlaps out without being out"):
        ops.gemv(x, w, out=buf[:16].view(2, 8), residual=buf[8:24].view(2, 8))
    with pytest.raises(ValueError, match="more than this device allows"):
        ops.gemv(torch.zeros(8, 1 << 20, dtype=bf, device=dev), torch.zeros(1, 1 << 20, dtype=bf, device=dev),
                 norm_weight=torch.ones(1 << 20, dtype=bf, device=dev))
    assert ops.gemv_fusion_fits(8, 14336, bf) and not ops.gemv_fusion_fits(8, 1 << 20, bf)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m", [1, 5, 8])
def test_gemv_float32_out_is_the_rounded_product(gen, dtype, m):
    """A float32 out holds the product rounded to the dtype, as float32: bit for bit gemv(...).float()
    (an LM head's logits without the .float() kernel); refused with a residual or the rope epilogue."""
    x = rand((m, 1024), dtype, gen)
    w = rand((3001, 1024), dtype, gen, 0.05)
    b = rand((3001,), dtype, gen)
    ref = ops.gemv(x, w, b).float()
    out = torch.full((m, 3001), float("nan"), device="cuda")
    assert ops.gemv(x, w, b, out=out) is out
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="a float32 out .* cannot be combined with a residual or the rope"):
        ops.gemv(x, w[:1024], out=torch.empty((m, 1024), device="cuda"),
                 residual=torch.zeros((m, 1024), dtype=dtype, device="cuda"))
    xr, wr, _, cos, sin, positions, slots, (kc, vc), qo = _rope_case(gen, dtype, m, 4, 2, 128, 64, False)
    with pytest.raises(ValueError, match="a float32 out .* cannot be combined with a residual or the rope"):
        ops.gemv(xr, wr, out=torch.empty((m, wr.shape[0]), device="cuda"),
                 rope=ops.GemvRope(4, 2, positions, cos, sin, qo, kc, vc, slots, paired_rows=True))
    with pytest.raises(ValueError, match="out dtype int32 must be the input's .* or float32"):
        ops.gemv(x, w, out=torch.empty((m, 3001), dtype=torch.int32, device="cuda"))


# ---------------------------------------------------------------------------------------------
# The rope epilogue (GemvRope): rotary embedding + paged KV-cache write of a qkv projection

ROPE_SHAPES = [(32, 8, 128, 64, False), (14, 2, 64, 32, True), (4, 2, 128, 16, False)]  # Hq, Hkv, D, half, bias


def _rope_reference(y, m, hq, hkv, d, positions, cos, sin, qo, kc, vc, slots):
    """rotary_embedding_and_cache of a standard-order qkv output y [m, (hq + 2 hkv) * d] into copies
    of qo, kc and vc: the (query_out, key_cache, value_cache) a fused rope epilogue must give."""
    q, k, v = y.view(m, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    ref_qo, ref_kc, ref_vc = qo.clone(), kc.clone(), vc.clone()
    ops.rotary_embedding_and_cache(positions, q, k, v, cos, sin, ref_qo, ref_kc, ref_vc, slots)
    return ref_qo, ref_kc, ref_vc


def _rope_case(gen, dtype, m, hq, hkv, d, half, bias, num_blocks=16, block_size=16, max_pos=64):
    """Random inputs of a qkv GEMV with its rope epilogue; caches and query_out filled with NaN."""
    k = 512
    n = (hq + 2 * hkv) * d
    x = rand((m, k), dtype, gen)
    w = rand((n, k), dtype, gen, 0.05)
    b = rand((n,), dtype, gen) if bias else None
    cos = rand((max_pos, half), dtype, gen)
    sin = rand((max_pos, half), dtype, gen)
    positions = torch.randint(0, max_pos, (m,), generator=gen).cuda()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:m]
    if m > 1:
        slots[-1] = -1  # a padding row: writes no key / value
    slots = slots.cuda()
    nan = lambda *shape: torch.full(shape, float("nan"), dtype=dtype, device="cuda")  # noqa: E731
    caches = (nan(num_blocks, hkv, block_size, d), nan(num_blocks, hkv, block_size, d))
    return x, w, b, cos, sin, positions, slots, caches, nan(m, hq, d)


def _bits(t):
    return t.view(torch.int16)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: f"hq{s[0]}-hkv{s[1]}-d{s[2]}-half{s[3]}")
@pytest.mark.parametrize("cfg", [{}, {"variant": 2}, {"splits": 2}], ids=["auto", "rows32", "split2"])
@pytest.mark.parametrize("norm", [False, True], ids=["x", "rmsnorm"])
def test_gemv_rope_epilogue_equals_gemv_then_rotary(gen, dtype, m, shape, cfg, norm):
    """The qkv GEMV with the rope epilogue against gemv (same config, same prologue) then
    rotary_embedding_and_cache: out, query_out and both caches (NaN-filled, untouched slots included)
    bit for bit; a padding slot (-1) writes nothing; the arrival counters are zero again. 16- and
    32-row tiles, a cluster K split (the epilogue in rank 0 only), the RMSNorm prologue."""
    hq, hkv, d, half, bias = shape
    x, w, b, cos, sin, positions, slots, (kc, vc), qo = _rope_case(gen, dtype, m, hq, hkv, d, half, bias)
    pro = {"norm_weight": rand((x.shape[1],), dtype, gen), "eps": 1e-5} if norm else {}
    ref_y = ops.gemv(x, w, b, config=cfg, **pro)
    ref_qo, ref_kc, ref_vc = _rope_reference(ref_y, m, hq, hkv, d, positions, cos, sin, qo, kc, vc, slots)
    counters = torch.zeros(hq + 2 * hkv + 3, dtype=torch.int32, device="cuda")
    y = ops.gemv(x, w, b, config=cfg, rope=ops.GemvRope(hq, hkv, positions, cos, sin, qo, kc, vc, slots, counters),
                 **pro)
    torch.cuda.synchronize()
    assert torch.equal(_bits(y), _bits(ref_y))
    assert torch.equal(_bits(qo), _bits(ref_qo))
    assert torch.equal(_bits(kc), _bits(ref_kc)) and torch.equal(_bits(vc), _bits(ref_vc))
    assert int(counters.abs().sum()) == 0
    if not norm:
        check(y, x, w, b, dtype, "rope qkv")  # and the product itself against float64


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("pdl", [True, False])
def test_gemv_rope_epilogue_in_a_cuda_graph(gen, pdl):
    """Captured once (with a kernel before it, as in a decoder layer), replayed over new inputs
    written in place: each replay equals the unfused ops on those inputs."""
    dtype, m, (hq, hkv, d, half, bias) = torch.bfloat16, 2, ROPE_SHAPES[0]
    x, w, b, cos, sin, positions, slots, (kc, vc), qo = _rope_case(gen, dtype, m, hq, hkv, d, half, bias)
    h = x.clone()
    counters = torch.zeros(hq + 2 * hkv, dtype=torch.int32, device="cuda")
    rope = ops.GemvRope(hq, hkv, positions, cos, sin, qo, kc, vc, slots, counters)
    norm_w = rand((x.shape[1],), dtype, gen)
    xn = torch.empty_like(h)

    def body():
        ops.rms_norm(xn, h, norm_w, 1e-5)
        return ops.gemv(xn, w, b, rope=rope)

    graph, y = capture_graph(body, pdl)
    for _ in range(2):
        h.copy_(rand(tuple(h.shape), dtype, gen))
        positions.copy_(torch.randint(0, cos.shape[0], (m,), generator=gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        ref_y = ops.gemv(ops.rms_norm(torch.empty_like(h), h, norm_w, 1e-5), w, b)
        ref_qo, ref_kc, ref_vc = _rope_reference(ref_y, m, hq, hkv, d, positions, cos, sin, qo, kc, vc, slots)
        torch.cuda.synchronize()
        assert torch.equal(_bits(y), _bits(ref_y)) and torch.equal(_bits(qo), _bits(ref_qo))
        assert torch.equal(_bits(kc), _bits(ref_kc)) and torch.equal(_bits(vc), _bits(ref_vc))
        assert int(counters.abs().sum()) == 0


@pytest.mark.cuda
@needs_cuda
def test_gemv_rope_epilogue_argument_errors(gen):
    dtype = torch.bfloat16
    x, w, b, cos, sin, positions, slots, (kc, vc), qo = _rope_case(gen, dtype, 2, 4, 2, 128, 64, False)
    counters = torch.zeros(8, dtype=torch.int32, device="cuda")

    def call(**kw):
        args = dict(num_heads=4, num_kv_heads=2, positions=positions, cos_cache=cos, sin_cache=sin, query_out=qo,
                    key_cache=kc, value_cache=vc, slot_mapping=slots, counters=counters)
        args.update(kw)
        ops.gemv(x, w, b, rope=ops.GemvRope(**args))

    call()  # valid
    with pytest.raises(ValueError, match="counters has 7 entries, fewer than num_heads \\+ 2 \\* num_kv_heads = 8"):
        call(counters=counters[:7])
    with pytest.raises(ValueError, match="counters must be int32"):
        call(counters=counters.long())
    with pytest.raises(ValueError, match=r"out has 1024 columns but \(num_heads 5"):
        call(num_heads=5)
    with pytest.raises(ValueError, match="slot_mapping"):
        call(slot_mapping=slots[:1])
    with pytest.raises(ValueError, match="cannot be combined with a residual"):
        y = torch.empty((2, w.shape[0]), dtype=dtype, device="cuda")
        ops.gemv(x, w, b, residual=y, rope=ops.GemvRope(4, 2, positions, cos, sin, qo, kc, vc, slots, counters))
    x80, w80, _, cos80, sin80, pos80, slots80, (kc80, vc80), qo80 = _rope_case(gen, dtype, 2, 2, 1, 80, 40, False)
    with pytest.raises(ValueError, match="head_size % 32 == 0, got 80"):
        ops.gemv(x80, w80, rope=ops.GemvRope(2, 1, pos80, cos80, sin80, qo80, kc80, vc80, slots80, counters))


@pytest.mark.cuda
@needs_cuda
def test_model_rope_epilogue_gives_the_same_logits(tmp_path, gen):
    """The Llama model's GEMV-sized steps with the qkv GEMV's rope epilogue and with the separate
    rotary kernel (layer.rope_counters = None), same weights and caches: logits bit for bit."""
    import json

    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.dummy import init_dummy_weights
    from pagedllm.model_executor.models import LlamaForCausalLM

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512, intermediate_size=1024,
                  num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1000,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_pretrained(tmp_path)
    model = LlamaForCausalLM(cfg, torch.bfloat16, torch.device("cuda"), max_positions=256)
    init_dummy_weights(model, seed=int(torch.randint(0, 1000, (1,), generator=gen)), std=0.08)
    counters = model.layers[0].rope_counters
    assert counters is not None and all(layer.rope_counters is counters for layer in model.layers)
    lens = [30, 12, 19]
    ids = [torch.randint(0, cfg.vocab_size, (n + 3,), generator=gen) for n in lens]
    results = {}
    for fused in (True, False):
        for layer in model.layers:
            layer.rope_counters = counters if fused else None
        harness = PagedHarness(model, len(lens), max(lens) + 3, block_size=16)
        steps = [[(s, 0, n) for s, n in enumerate(lens)]]
        steps += [[(s, n + i, n + i + 1) for s, n in enumerate(lens)][: 3 - i] for i in range(3)]
        results[fused] = torch.cat([harness.step([(s, ids[s][a:b].tolist()) for s, a, b in chunks]).cpu()
                                    for chunks in steps])
    assert torch.equal(results[True], results[False])
