"""paged_attention (decode) and paged_prefill_attention against the float64 reference.

Fresh random inputs every run (seeded from the OS, the seed is printed on failure); every output
is poisoned with NaN before each call; caches have shuffled block ids and NaN in unowned slots
(kernel_reference.build_paged_cache). CUDA cases carry the `cuda` marker.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch

import pagedllm.ops as ops
from pagedllm import _C
from graph_capture import capture_graph
from kernel_reference import (DEVICE_DTYPES, DEVICES, TOLERANCES, assert_close_to_reference, build_paged_cache,
                              poisoned, random_kv, reference_attention)

torch.set_num_threads(2)


@pytest.fixture
def gen(request):
    seed = random.SystemRandom().randrange(2**31)
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _two_threads():
    ops.set_num_threads(2)
    yield
    ops.set_num_threads(0)


def run_decode(device, dtype, seq_lens, num_heads, num_kv_heads, head_size, block_size, gen,
               split_modes=(None,), sliding_window=None, soft_cap=None):
    """Build a cache, run decode with each split mode on the same inputs, compare each result."""
    keys, values = random_kv(seq_lens, num_kv_heads, head_size, dtype, gen)
    cache = build_paged_cache(keys, values, block_size, dtype, device, gen,
                              num_kv_heads=num_kv_heads, head_size=head_size)
    B = len(seq_lens)
    query = torch.randn(B, num_heads, head_size, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(head_size) * (1.0 + torch.rand(1, generator=gen).item())
    ref = torch.zeros(B, num_heads, head_size, dtype=torch.float64)
    for b, length in enumerate(seq_lens):
        if length:
            ref[b] = reference_attention(query[b:b + 1], keys[b], values[b],
                                         torch.tensor([length - 1]), scale, sliding_window,
                                         soft_cap)[0]
    q_dev = query.to(device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    outs = []
    for split_k in split_modes:
        out = poisoned((B, num_heads, head_size), dtype, device)
        ops.paged_attention(out, q_dev, cache.key_cache, cache.value_cache, cache.block_tables,
                            seq_lens_t, scale, sliding_window=sliding_window, soft_cap=soft_cap,
                            split_k=split_k)
        if device == "cuda":
            torch.cuda.synchronize()
        assert_close_to_reference(out, ref, dtype)
        outs.append(out)
    return outs


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference_single_pass_and_split_k(device, dtype, head_size, block_size, gen):
    # Lengths: 1, not multiples of the block size, an exact multiple, a long one (auto split).
    seq_lens = [1, 19, 2 * block_size, 3 * block_size + 5, 700]
    run_decode(device, dtype, seq_lens, 8, 2, head_size, block_size, gen,
               split_modes=(0, None, 1, 3, 7))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 1), (12, 3), (9, 3), (32, 8)])
def test_decode_gqa_and_mqa(device, dtype, num_heads, num_kv_heads, gen):
    run_decode(device, dtype, [33, 1, 130], num_heads, num_kv_heads, 64, 16, gen,
               split_modes=(0, 4))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("sliding_window", [1, 7, 40, 1000])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
def test_decode_sliding_window_and_soft_cap(device, dtype, sliding_window, soft_cap, gen):
    run_decode(device, dtype, [1, 23, 97, 300], 8, 2, 128, 16, gen, split_modes=(0, 3),
               sliding_window=sliding_window, soft_cap=soft_cap)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_decode_soft_cap_without_window(device, dtype, gen):
    run_decode(device, dtype, [5, 77, 260], 4, 2, 96, 32, gen, split_modes=(0, 2), soft_cap=2.0)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_split_k_auto_on_long_context_single_sequence(device, gen):
    # One sequence, long context, few heads: the auto heuristic splits; all modes agree.
    outs = run_decode(device, torch.float32, [3000], 6, 2, 64, 16, gen, split_modes=(None, 0, 5))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("seq_lens,split_k", [([300], None), ([300], 8), ([17, 300, 1200, 5], 4), ([2000], 16)])
def test_decode_workspace_gives_the_same_bits(seq_lens, split_k, gen):
    """A split decode (checked: more than one partition) with the caller's split-K workspace (large
    enough, NaN-filled beforehand), one too small or one misaligned (the call allocates its own)
    gives the bits of the call without one, eagerly and in a CUDA graph; the result matches the
    float64 reference; a misaligned workspace is refused by the Python op."""
    if not torch.cuda.is_available():
        pytest.fail("marked cuda but no CUDA device")
    dtype, Hq, Hkv, D = torch.bfloat16, 32, 8, 128
    keys, values = random_kv(seq_lens, Hkv, D, dtype, gen)
    cache = build_paged_cache(keys, values, 16, dtype, "cuda", gen, num_kv_heads=Hkv, head_size=D)
    B = len(seq_lens)
    query = torch.randn(B, Hq, D, generator=gen).to(dtype)
    ref = torch.stack([reference_attention(query[b:b + 1], keys[b], values[b], torch.tensor([n - 1]),
                                           D ** -0.5, None, None)[0] for b, n in enumerate(seq_lens)])
    q = query.cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")

    def call(out, workspace):
        ops.paged_attention(out, q, cache.key_cache, cache.value_cache, cache.block_tables, lens, D ** -0.5,
                            split_k=split_k, workspace=workspace)

    plain = poisoned((B, Hq, D), dtype, "cuda")
    call(plain, None)
    torch.cuda.synchronize()
    assert ops.last_cuda_decode_plan()["splits"] > 1
    assert_close_to_reference(plain, ref, dtype)
    big = torch.full((16 << 20,), 0xFF, dtype=torch.uint8, device="cuda")  # NaN bytes as floats
    small = torch.empty(64, dtype=torch.uint8, device="cuda")
    for workspace in (big, small):
        out = poisoned((B, Hq, D), dtype, "cuda")
        call(out, workspace)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), plain.view(torch.int16))
    graph_out = poisoned((B, Hq, D), dtype, "cuda")
    graph, _ = capture_graph(lambda: call(graph_out, big))
    graph_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out.view(torch.int16), plain.view(torch.int16))
    with pytest.raises(ValueError, match="workspace must be a contiguous tensor on cuda"):
        call(plain, torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match="workspace must start on a 16-byte boundary"):
        call(plain, big[4:])


@pytest.mark.cuda
@pytest.mark.parametrize("seq_lens,split_k", [([300], None), ([300], 8), ([17, 300, 1200, 5, 16, 33], None),
                                              ([2000], 16), ([1, 2, 16, 17], 0)])
def test_decode_early_context_loads_see_the_new_token(seq_lens, split_k, gen):
    """early_context_loads behind rotary_embedding_and_cache writing each sequence's last token
    (a PDL chain, as in a model layer), eagerly and in a CUDA graph replayed over fresh tokens:
    bit for bit the same call made after a synchronize (when nothing is left to race with), and
    within bf16 rounding of the call without early loads (whose cost model may split otherwise).
    A tile that held the new token and was read before the wait would see the previous token's
    key / value."""
    if not torch.cuda.is_available():
        pytest.fail("marked cuda but no CUDA device")
    dtype, Hq, Hkv, D, bs = torch.bfloat16, 32, 8, 128, 16
    keys, values = random_kv(seq_lens, Hkv, D, dtype, gen)
    cache = build_paged_cache(keys, values, bs, dtype, "cuda", gen, num_kv_heads=Hkv, head_size=D)
    B = len(seq_lens)
    tables = cache.block_tables.cpu()
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(seq_lens)],
                         dtype=torch.int64, device="cuda")
    positions = torch.tensor([n - 1 for n in seq_lens], dtype=torch.int64, device="cuda")
    cos, sin = (torch.randn(max(seq_lens), D // 2, generator=gen).to(dtype).cuda() for _ in range(2))
    q_in = torch.empty(B, Hq, D, dtype=dtype, device="cuda")
    k_in, v_in = (torch.empty(B, Hkv, D, dtype=dtype, device="cuda") for _ in range(2))
    query = torch.empty(B, Hq, D, dtype=dtype, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")

    def attention(out, early):
        ops.paged_attention(out, query, cache.key_cache, cache.value_cache, cache.block_tables, lens, D ** -0.5,
                            split_k=split_k, early_context_loads=early)

    def step(out):
        ops.rotary_embedding_and_cache(positions, q_in, k_in, v_in, cos, sin, query, cache.key_cache,
                                       cache.value_cache, slots)
        attention(out, True)

    def fresh_token():
        for t in (q_in, k_in, v_in):
            t.copy_(torch.randn(tuple(t.shape), generator=gen).to(dtype))

    def expected():  # the same call (same plan) once the write is complete: nothing to race with
        torch.cuda.synchronize()
        out = poisoned((B, Hq, D), dtype, "cuda")
        attention(out, True)
        plain = poisoned((B, Hq, D), dtype, "cuda")
        attention(plain, False)  # without early loads: another split count, maybe (the cost model)
        torch.cuda.synchronize()
        torch.testing.assert_close(plain.float(), out.float(), atol=2e-2, rtol=2e-2)
        return out

    for _ in range(3):
        fresh_token()
        out = poisoned((B, Hq, D), dtype, "cuda")
        step(out)
        assert torch.equal(out.view(torch.int16), expected().view(torch.int16))
    graph_out = poisoned((B, Hq, D), dtype, "cuda")
    graph, _ = capture_graph(lambda: step(graph_out))
    for _ in range(3):
        fresh_token()
        graph_out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(graph_out.view(torch.int16), expected().view(torch.int16))
    if split_k is None:  # whole-CTA items take at least as many partitions with early loads
        attention(poisoned((B, Hq, D), dtype, "cuda"), False)
        plain = ops.last_cuda_decode_plan()
        attention(poisoned((B, Hq, D), dtype, "cuda"), True)
        early = ops.last_cuda_decode_plan()
        if early["kernel"] == plain["kernel"] == "v2-cta":
            assert early["splits"] >= plain["splits"], (early, plain)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_seq_len_zero_writes_zero_row(device, gen):
    keys, values = random_kv([0, 5], 2, 64, torch.float32, gen)
    cache = build_paged_cache(keys, values, 16, torch.float32, device, gen)
    query = torch.randn(2, 4, 64, generator=gen, device="cpu").to(device)
    for split_k in (0, 3):
        out = poisoned((2, 4, 64), torch.float32, device)
        ops.paged_attention(out, query, cache.key_cache, cache.value_cache, cache.block_tables,
                            torch.tensor([0, 5], dtype=torch.int32, device=device), 0.125,
                            split_k=split_k)
        assert torch.equal(out[0].cpu(), torch.zeros(4, 64))
        ref = reference_attention(query[1:2], keys[1], values[1], torch.tensor([4]), 0.125)
        assert_close_to_reference(out[1:2], ref, torch.float32)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_empty_batch_is_a_noop(device, dtype, gen):
    kc, vc = ops.allocate_kv_cache(4, 16, 2, 64, dtype, device)
    out = poisoned((0, 4, 64), dtype, device)
    query = torch.empty(0, 4, 64, dtype=dtype, device=device)
    ops.paged_attention(out, query, kc, vc, torch.zeros(0, 3, dtype=torch.int32, device=device),
                        torch.zeros(0, dtype=torch.int32, device=device), 0.125)
    ops.paged_prefill_attention(out, query, kc, vc,
                                torch.zeros(0, 3, dtype=torch.int32, device=device),
                                torch.zeros(0, dtype=torch.int32, device=device),
                                torch.zeros(1, dtype=torch.int32, device=device), 0.125)
    # Sequences with no query rows (T = 0) are a no-op too.
    ops.paged_prefill_attention(out, query, kc, vc,
                                torch.zeros(2, 3, dtype=torch.int32, device=device),
                                torch.tensor([3, 5], dtype=torch.int32, device=device),
                                torch.zeros(3, dtype=torch.int32, device=device), 0.125)
    assert out.shape == (0, 4, 64)


# ----------------------------------------------------------------------------- prefill


def run_prefill(device, dtype, contexts, num_heads, num_kv_heads, head_size, block_size, gen,
                sliding_window=None, soft_cap=None):
    """contexts: list of (seq_len incl. chunk, q_len). Compares the whole mixed batch."""
    seq_lens = [c for c, _ in contexts]
    q_lens = [q for _, q in contexts]
    keys, values = random_kv(seq_lens, num_kv_heads, head_size, dtype, gen)
    cache = build_paged_cache(keys, values, block_size, dtype, device, gen,
                              num_kv_heads=num_kv_heads, head_size=head_size)
    T = sum(q_lens)
    query = torch.randn(T, num_heads, head_size, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(head_size)
    ref = torch.zeros(T, num_heads, head_size, dtype=torch.float64)
    qsl = [0]
    for b, (length, q_len) in enumerate(contexts):
        s = qsl[-1]
        positions = torch.arange(length - q_len, length)
        ref[s:s + q_len] = reference_attention(query[s:s + q_len], keys[b], values[b], positions,
                                               scale, sliding_window, soft_cap)
        qsl.append(s + q_len)
    out = poisoned((T, num_heads, head_size), dtype, device)
    ops.paged_prefill_attention(out, query.to(device), cache.key_cache, cache.value_cache,
                                cache.block_tables,
                                torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                torch.tensor(qsl, dtype=torch.int32, device=device), scale,
                                sliding_window=sliding_window, soft_cap=soft_cap)
    if device == "cuda":
        torch.cuda.synchronize()
    assert_close_to_reference(out, ref, dtype)


# (context length including the chunk, chunk length): a full prompt, a chunk after a cached
# prefix (prefix-cache hit / chunked prefill), decode rows, a 1-token prompt, an exact block
# multiple, a sequence with no rows this step.
MIXED = [(37, 37), (100, 23), (50, 1), (1, 1), (64, 64), (20, 0), (129, 1)]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_mixed_batch_matches_reference(device, dtype, head_size, block_size, gen):
    run_prefill(device, dtype, MIXED, 8, 2, head_size, block_size, gen)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 1), (9, 3), (32, 8), (80, 1)])
def test_prefill_gqa_and_mqa(device, dtype, num_heads, num_kv_heads, gen):
    run_prefill(device, dtype, [(45, 45), (70, 30), (9, 1)], num_heads, num_kv_heads, 64, 16, gen)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("sliding_window", [1, 5, 33])
@pytest.mark.parametrize("soft_cap", [None, 3.0])
def test_prefill_sliding_window_and_soft_cap(device, dtype, sliding_window, soft_cap, gen):
    run_prefill(device, dtype, MIXED, 8, 2, 64, 16, gen, sliding_window=sliding_window,
                soft_cap=soft_cap)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_long_prompt(device, gen):
    run_prefill(device, torch.float32, [(600, 600), (300, 150)], 6, 2, 128, 16, gen)


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (300, None), (None, 4.0)])
def test_cpu_bf16_prefill_long_prompts(head_size, block_size, sliding_window, soft_cap, gen):
    """bfloat16 prefill past the AMX path's 256-token segments (cpu_attention_amx.h): rows whose
    16-row groups straddle a segment boundary, a window longer than a segment, a soft cap."""
    run_prefill("cpu", torch.bfloat16, [(600, 600), (300, 150), (520, 9), (257, 3)], 6, 2, head_size, block_size,
                gen, sliding_window=sliding_window, soft_cap=soft_cap)


def test_cpu_attention_uses_amx_exactly_where_the_build_and_os_allow_it():
    """The AMX attention path is on wherever amx_linear can run (same build and OS permission),
    unless PAGEDLLM_CPU_ATTENTION_AMX=0; and a CPU that lists AMX-BF16 must get it (a refused
    tile permission or a build without AMX would otherwise leave the AMX kernels untested)."""
    expected = ops.amx_linear_supported() and os.environ.get("PAGEDLLM_CPU_ATTENTION_AMX") != "0"
    assert _C.cpu_attention_uses_amx() == expected
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    if "amx_bf16" in flags and "amx_tile" in flags:
        assert ops.amx_linear_supported(), "this CPU has AMX-BF16 but the build or the OS does not allow it"


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_prefill_decode_rows_equal_decode_kernel(device, dtype, gen):
    """A batch of q_len-1 rows through the prefill kernel equals the decode kernel (same inputs)."""
    seq_lens = [1, 17, 300]
    keys, values = random_kv(seq_lens, 2, 64, dtype, gen)
    cache = build_paged_cache(keys, values, 16, dtype, device, gen)
    query = torch.randn(3, 8, 64, generator=gen).to(dtype).to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    a = poisoned((3, 8, 64), dtype, device)
    b = poisoned((3, 8, 64), dtype, device)
    ops.paged_attention(a, query, cache.key_cache, cache.value_cache, cache.block_tables, sl, 0.125,
                        split_k=0)
    ops.paged_prefill_attention(b, query, cache.key_cache, cache.value_cache, cache.block_tables, sl,
                                torch.arange(4, dtype=torch.int32, device=device), 0.125)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=tol["atol"], rtol=tol["rtol"])


# ----------------------------------------------------------------------------- errors (CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_take_q_k_v_as_views_of_a_fused_qkv(dtype, gen):
    """On the CPU q (both kernels) and k, v (reshape_and_cache) may be token-strided views of one
    [T, (Hq + 2 Hkv) D] projection: results equal those of contiguous copies, bit for bit."""
    T, Hq, Hkv, D, bs = 6, 8, 2, 64, 16
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen).to(dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D: (Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    slots = torch.tensor([3, 17, 40, 41, 63, 5], dtype=torch.int64)
    caches = []
    for kk, vv in ((k, v), (k.contiguous(), v.contiguous())):
        kc, vc = ops.allocate_kv_cache(4, bs, Hkv, D, dtype)
        ops.reshape_and_cache(kk, vv, kc, vc, slots)
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    kc, vc = caches[0]
    tables = torch.tensor([[0, 1, 2, 3]] * T, dtype=torch.int32)
    lens = torch.tensor([4, 18, 41, 42, 64, 6], dtype=torch.int32)
    outs = []
    for qq in (q, q.contiguous()):
        out = poisoned((T, Hq, D), dtype, "cpu")
        ops.paged_attention(out, qq, kc, vc, tables, lens, 0.125)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    qsl = torch.tensor([0, 2, 6], dtype=torch.int32)
    outs = []
    for qq in (q, q.contiguous()):
        out = poisoned((T, Hq, D), dtype, "cpu")
        ops.paged_prefill_attention(out, qq, kc, vc, tables[:2], torch.tensor([30, 64], dtype=torch.int32), qsl, 0.125)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def _decode_args(dtype=torch.float32, B=2, Hq=4, Hkv=2, D=64, block_size=16, num_blocks=8):
    kc = torch.zeros(num_blocks, Hkv, block_size, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    return dict(out=poisoned((B, Hq, D), dtype, "cpu"), query=torch.randn(B, Hq, D).to(dtype),
                key_cache=kc, value_cache=vc,
                block_tables=torch.arange(B * 2, dtype=torch.int32).view(B, 2),
                seq_lens=torch.tensor([5, 20][:B], dtype=torch.int32), scale=0.125)


def _expect_error(fn, *fragments, **kwargs):
    with pytest.raises(ValueError) as info:
        fn(**kwargs)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in error message {msg!r}"
    out = kwargs.get("out")
    if out is not None and out.numel():
        assert torch.isnan(out.float()).all(), "a rejected call wrote into out"


def test_fp16_on_cpu_is_refused_listing_supported_dtypes():
    args = _decode_args()
    for key in ("out", "query", "key_cache", "value_cache"):
        args[key] = args[key].half()
    _expect_error(ops.paged_attention, "float16", "float32, bfloat16", **args)
    with pytest.raises(ValueError, match="float16.*float32, bfloat16"):
        ops.allocate_kv_cache(4, 16, 2, 64, torch.float16, "cpu")


def test_unsupported_block_and_head_sizes_are_named():
    args = _decode_args()
    args["key_cache"] = torch.zeros(8, 2, 24, 64)
    args["value_cache"] = torch.zeros(8, 2, 24, 64)
    _expect_error(ops.paged_attention, "block size 24", "16, 32", **args)
    args = _decode_args(D=72)
    _expect_error(ops.paged_attention, "head size 72", "64, 80, 96, 128, 256", **args)
    with pytest.raises(ValueError, match="block size 12.*16, 32"):
        ops.kv_cache_shape(10, 12, 2, 64)
    with pytest.raises(ValueError, match="head size 100"):
        ops.allocate_kv_cache(10, 16, 2, 100)
    assert ops.kv_cache_shape(10, 32, 3, 64) == (10, 3, 32, 64)


@pytest.mark.parametrize("case,fragments", [
    ("query_head_size", ["query dimension 2", "must be 64", "got 128"]),
    ("query_dtype", ["query must be float32", "got bfloat16"]),
    ("cache_dtype_mismatch", ["value_cache dtype bfloat16", "key_cache dtype float32"]),
    ("block_tables_int64", ["block_tables must be int32", "got int64"]),
    ("seq_lens_2d", ["seq_lens must be 1-D"]),
    ("seq_lens_batch", ["seq_lens dimension 0", "must be 2", "got 3"]),
    ("gqa_ratio", ["num_heads 5", "num_kv_heads 2"]),
    ("non_contiguous", ["query must have contiguous [num_heads, head_size] rows"]),
    ("seq_len_too_long", ["seq_lens[1] = 33", "[0, 32]"]),
    ("negative_seq_len", ["seq_lens[0] = -1"]),
    ("block_id_out_of_range", ["block_tables[1][1] = 99", "[0, 8)"]),
    ("bad_split_k", ["split_k", "-2"]),
    ("bad_window", ["sliding_window", "-3"]),
    ("bad_scale", ["scale must be finite", "nan"]),
])
def test_decode_errors_name_the_bad_value(case, fragments):
    args = _decode_args()
    extra = {}
    if case == "query_head_size":
        args["query"] = torch.randn(2, 4, 128)
        args["out"] = poisoned((2, 4, 128), torch.float32, "cpu")
    elif case == "query_dtype":
        args["query"] = args["query"].bfloat16()
    elif case == "cache_dtype_mismatch":
        args["value_cache"] = args["value_cache"].bfloat16()
    elif case == "block_tables_int64":
        args["block_tables"] = args["block_tables"].long()
    elif case == "seq_lens_2d":
        args["seq_lens"] = args["seq_lens"].view(2, 1)
    elif case == "seq_lens_batch":
        args["seq_lens"] = torch.tensor([1, 2, 3], dtype=torch.int32)
    elif case == "gqa_ratio":
        args["query"] = torch.randn(2, 5, 64)
        args["out"] = poisoned((2, 5, 64), torch.float32, "cpu")
    elif case == "non_contiguous":
        args["query"] = torch.randn(2, 64, 4).transpose(1, 2)
    elif case == "seq_len_too_long":
        args["seq_lens"] = torch.tensor([5, 33], dtype=torch.int32)
    elif case == "negative_seq_len":
        args["seq_lens"] = torch.tensor([-1, 3], dtype=torch.int32)
    elif case == "block_id_out_of_range":
        args["block_tables"] = torch.tensor([[0, 1], [2, 99]], dtype=torch.int32)
    elif case == "bad_split_k":
        extra["split_k"] = -2
    elif case == "bad_window":
        extra["sliding_window"] = -3
    elif case == "bad_scale":
        args["scale"] = float("nan")
    _expect_error(lambda **kw: ops.paged_attention(**kw, **extra), *fragments, **args)


def test_prefill_errors_name_the_bad_value():
    args = _decode_args()
    args["query"] = torch.randn(3, 4, 64)
    args["out"] = poisoned((3, 4, 64), torch.float32, "cpu")
    args["query_start_loc"] = torch.tensor([0, 1, 3], dtype=torch.int32)
    args["seq_lens"] = torch.tensor([5, 1], dtype=torch.int32)
    _expect_error(ops.paged_prefill_attention, "sequence 1 has 2 query tokens", "seq_lens[1] = 1",
                  **args)
    _expect_error(ops.paged_prefill_attention, "query_start_loc[2] = 1",
                  "number of query tokens 3",
                  **{**args, "query_start_loc": torch.tensor([0, 1, 1], dtype=torch.int32)})
    _expect_error(ops.paged_prefill_attention, "non-decreasing",
                  **{**args, "query_start_loc": torch.tensor([0, 4, 3], dtype=torch.int32),
                     "seq_lens": torch.tensor([5, 5], dtype=torch.int32)})
    _expect_error(ops.paged_prefill_attention, "query_start_loc dimension 0", "must be 3", "got 2",
                  **{**args, "query_start_loc": torch.tensor([0, 2], dtype=torch.int32)})


def test_device_mismatch_is_named():
    """A CUDA view mixed with CPU views is refused before any CUDA code runs."""
    args = _decode_args()
    views = {k: ops._view(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    q = args["query"]
    views["query"] = _C.TensorView(q.data_ptr(), "float32", list(q.shape), list(q.stride()), "cuda", 0)
    with pytest.raises(ValueError, match=r"query is on cuda:0 but key_cache is on cpu"):
        _C.paged_attention(views["out"], views["query"], views["key_cache"], views["value_cache"],
                           views["block_tables"], views["seq_lens"], 0.125)
    assert torch.isnan(args["out"]).all()


def test_num_threads_setting():
    ops.set_num_threads(1)
    assert ops.get_num_threads() == 1
    ops.set_num_threads(0)
    assert ops.get_num_threads() >= 1


@pytest.mark.skipif(os.environ.get("PAGEDLLM_CPU_ATTENTION_AMX") == "0", reason="already on the AVX-512 path")
def test_cpu_bf16_attention_without_amx():
    """The CPU decode and prefill reference tests of this file again with PAGEDLLM_CPU_ATTENTION_AMX=0:
    on a CPU with AMX, bfloat16 caches of head size 64 and 128 otherwise take the AMX tile path
    (cpu_attention_amx.h), so this child pytest is what checks the AVX-512 path for them (the
    setting is read once per process)."""
    env = dict(os.environ, PAGEDLLM_CPU_ATTENTION_AMX="0")
    cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider",
           "-m", "not cuda", "-k", "(decode or prefill) and cpu and not errors and not float32"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"CPU attention tests on the AVX-512 path failed:\n{r.stdout[-3000:]}"
    assert " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-3000:]
