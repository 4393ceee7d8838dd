"""CUDA kernels of pagedllm.ops against a naive float64 reference (issue 4).

Every case draws fresh random inputs; the paged cache is built from the same K/V as the
reference with shuffled block ids and NaN in every slot no sequence owns (so a wrong gather
shows as NaN or a wrong value); outputs are poisoned with NaN before each call. The float64
reference runs on the GPU (the 4,096-token cases would take minutes on the host).

Tolerances (max |out - ref| <= ATOL + RTOL * |ref| elementwise, and a relative L2 error bound):
  float32  1e-4 / 1e-4, rel 1e-5  (CUDA-core path; --use_fast_math exp2)
  bfloat16 2e-2 / 2e-2, rel 8e-3  (8-bit mantissa: inputs, P and the output are rounded to bf16)
  float16  4e-3 / 4e-3, rel 2e-3  (11-bit mantissa)
These tests need a CUDA GPU (marker `cuda`); scripts/test.sh deselects them elsewhere.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (marker: cuda)"),
]

import pagedllm.ops as ops  # noqa: E402

TOL = {
    torch.float32: (1e-4, 1e-4, 1e-5),
    torch.bfloat16: (2e-2, 2e-2, 8e-3),
    torch.float16: (4e-3, 4e-3, 2e-3),
}
HEAD_SIZES = (32, 64, 80, 96, 128, 256)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEV = "cuda"


# ------------------------------------------------------------------------------------ helpers
def make_paged(ctx_lens, num_kv_heads, head_size, block_size, dtype, extra_blocks=3, gen=None):
    """Random contiguous K/V per sequence (rounded to `dtype`, kept in float64) and the paged
    caches holding them: block ids shuffled, NaN in every unowned slot, unused block-table
    entries pointing at other sequences' blocks."""
    ks = [torch.randn(n, num_kv_heads, head_size, generator=gen, device=DEV, dtype=torch.float64)
          .to(dtype).double() for n in ctx_lens]
    vs = [torch.randn(n, num_kv_heads, head_size, generator=gen, device=DEV, dtype=torch.float64)
          .to(dtype).double() for n in ctx_lens]
    nblk = [max(1, math.ceil(n / block_size)) for n in ctx_lens]
    num_blocks = sum(nblk) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen, device=DEV)
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    kc = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    vc = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    max_blocks = max(nblk) + 2 if nblk else 1
    bt = perm[torch.randint(0, num_blocks, (len(ctx_lens), max_blocks), generator=gen, device=DEV)]
    bt = bt.to(torch.int32)
    used = 0
    for b, n in enumerate(ctx_lens):
        ids = perm[used:used + nblk[b]]
        used += nblk[b]
        bt[b, :nblk[b]] = ids.to(torch.int32)
        if n:
            pos = torch.arange(n, device=DEV)
            kc[ids[pos // block_size], :, pos % block_size] = ks[b].to(dtype)
            vc[ids[pos // block_size], :, pos % block_size] = vs[b].to(dtype)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    return ks, vs, kc, vc, bt, seq_lens


def ref_rows(q, k, v, positions, scale, window=0, soft_cap=0.0):
    """float64 attention of query rows q [n, Hq, D] at `positions` over contiguous k/v [L, Hkv, D]."""
    n, hq, d = q.shape
    if n == 0:
        return q.new_zeros(0, hq, d)
    g = hq // k.shape[1]
    kk = k.repeat_interleave(g, dim=1)
    vv = v.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q, kk) * scale
    if soft_cap:
        s = soft_cap * torch.tanh(s / soft_cap)
    pos = torch.as_tensor(positions, device=q.device).view(1, n, 1)
    key = torch.arange(k.shape[0], device=q.device).view(1, 1, -1)
    mask = key <= pos
    if window:
        mask &= key > pos - window
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows with no key (seq_len 0) -> zero output
    return torch.einsum("hnl,lhd->nhd", p, vv)


def check(out, ref, dtype, what=""):
    atol, rtol, rel_l2 = TOL[dtype]
    out = out.double()
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten or wrong gather)"
    err = (out - ref).abs()
    bound = atol + rtol * ref.abs()
    worst = (err - bound).max().item() if err.numel() else -1.0
    assert worst <= 0, f"{what}: max error {err.max().item():.3e} exceeds tolerance ({atol}, {rtol})"
    if ref.numel() and ref.norm() > 0:
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel <= rel_l2, f"{what}: relative L2 error {rel:.3e} > {rel_l2}"


def run_decode(dtype, head_size, block_size, hq, hkv, ctx_lens, split_ks, window=0, soft_cap=0.0, gen=None):
    ks, vs, kc, vc, bt, seq_lens = make_paged(ctx_lens, hkv, head_size, block_size, dtype, gen=gen)
    b = len(ctx_lens)
    q = torch.randn(b, hq, head_size, generator=gen, device=DEV, dtype=torch.float64).to(dtype)
    scale = head_size ** -0.5
    ref = torch.stack([ref_rows(q[i:i + 1].double(), ks[i], vs[i], [ctx_lens[i] - 1], scale, window, soft_cap)[0]
                       for i in range(b)]) if b else q.double()
    for split_k in split_ks:
        out = torch.full_like(q, float("nan"))
        ops.paged_attention(out, q, kc, vc, bt, seq_lens, scale, sliding_window=window or None,
                            soft_cap=soft_cap or None, split_k=split_k)
        torch.cuda.synchronize()
        check(out, ref, dtype, f"decode {dtype} D={head_size} bs={block_size} {hq}/{hkv} split_k={split_k}")


def run_prefill(dtype, head_size, block_size, hq, hkv, ctx_lens, q_lens, window=0, soft_cap=0.0, gen=None):
    ks, vs, kc, vc, bt, seq_lens = make_paged(ctx_lens, hkv, head_size, block_size, dtype, gen=gen)
    total = sum(q_lens)
    q = torch.randn(total, hq, head_size, generator=gen, device=DEV, dtype=torch.float64).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=DEV)
    scale = head_size ** -0.5
    refs = []
    for i, (n, ql) in enumerate(zip(ctx_lens, q_lens)):
        rows = q[int(qsl[i]):int(qsl[i + 1])].double()
        refs.append(ref_rows(rows, ks[i], vs[i], list(range(n - ql, n)), scale, window, soft_cap))
    ref = torch.cat(refs) if refs else q.double()
    out = torch.full_like(q, float("nan"))
    ops.paged_prefill_attention(out, q, kc, vc, bt, seq_lens, qsl, scale, sliding_window=window or None,
                                soft_cap=soft_cap or None)
    torch.cuda.synchronize()
    check(out, ref, dtype, f"prefill {dtype} D={head_size} bs={block_size} {hq}/{hkv}")


@pytest.fixture
def gen():
    g = torch.Generator(device=DEV)
    g.seed()  # fresh inputs every run
    return g


# ------------------------------------------------------------------------------------ decode
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", (16, 32))
def test_decode_all_sizes(dtype, head_size, block_size, gen):
    # lengths: 1, not multiples of the block size, one full block, a long one
    ctx_lens = [1, 17, block_size, 203, 77, 640]
    run_decode(dtype, head_size, block_size, 8, 2, ctx_lens, split_ks=(0, 3, 7, -1), gen=gen)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (32, 8), (32, 1), (40, 2), (12, 4)])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=lambda d: str(d).removeprefix("torch."))
def test_decode_gqa_mqa(hq, hkv, dtype, gen):
    run_decode(dtype, 128, 16, hq, hkv, [5, 300, 1000], split_ks=(0, 4, -1), gen=gen)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("window,soft_cap", [(7, 0.0), (100, 0.0), (0, 5.0), (33, 30.0)])
def test_decode_window_softcap(dtype, window, soft_cap, gen):
    run_decode(dtype, 128, 16, 8, 4, [1, 20, 256, 999], split_ks=(0, 5, -1), window=window,
               soft_cap=soft_cap, gen=gen)


def test_decode_long_context_auto_split(gen):
    # the benchmark shape (GQA 32/8, d128, bf16) at 1 x 4096 takes the split-K path automatically
    run_decode(torch.bfloat16, 128, 16, 32, 8, [4096], split_ks=(-1, 0, 64), gen=gen)
    run_decode(torch.bfloat16, 128, 16, 32, 8, [4096, 1, 3000, 2049], split_ks=(-1, 0), gen=gen)


@pytest.mark.parametrize("dtype,head_size", [(torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 256)],
                         ids=["bf16-d128", "fp16-d64", "bf16-d256"])
def test_decode_many_items_per_warp(dtype, head_size, gen):
    """Far more (sequence, KV head) work items than warps in the grid: the persistent decode
    kernel's cp.async ring then runs across item boundaries (ragged lengths, empty sequences)."""
    lens = torch.randint(0, 300, (1500,), generator=gen, device=DEV)
    lens[::97] = 0
    lens[5] = 1
    ctx = [int(n) for n in lens]
    ks, vs, kc, vc, bt, seq_lens = make_paged(ctx, 4, head_size, 16, dtype, gen=gen)
    q = torch.randn(len(ctx), 8, head_size, generator=gen, device=DEV, dtype=torch.float64).to(dtype)
    scale = head_size ** -0.5
    ref = torch.stack([ref_rows(q[i:i + 1].double(), ks[i], vs[i], [ctx[i] - 1], scale)[0] for i in range(len(ctx))])
    for split_k in (0, 2, -1):
        out = torch.full_like(q, float("nan"))
        ops.paged_attention(out, q, kc, vc, bt, seq_lens, scale, split_k=split_k)
        torch.cuda.synchronize()
        check(out, ref, dtype, f"decode, 1500 sequences, split_k={split_k}")
        assert torch.equal(out[lens == 0].float(), torch.zeros_like(out[lens == 0].float()))


def test_decode_empty_sequence_writes_zeros(gen):
    for dtype in DTYPES:
        ks, vs, kc, vc, bt, _ = make_paged([5, 9], 2, 64, 16, dtype, gen=gen)
        seq_lens = torch.tensor([0, 9], dtype=torch.int32, device=DEV)
        q = torch.randn(2, 4, 64, device=DEV).to(dtype)
        for split_k in (0, 2):
            out = torch.full_like(q, float("nan"))
            ops.paged_attention(out, q, kc, vc, bt, seq_lens, 0.125, split_k=split_k)
            torch.cuda.synchronize()
            assert torch.equal(out[0].float(), torch.zeros(4, 64, device=DEV)), "seq_len 0 must give a zero row"
            ref = ref_rows(q[1:2].double(), ks[1], vs[1], [8], 0.125)
            check(out[1:2], ref, dtype, f"decode next to an empty sequence, {dtype}")


def test_empty_batch_is_noop():
    kc, vc = ops.allocate_kv_cache(4, 16, 2, 64, torch.bfloat16, DEV)
    q = torch.empty(0, 4, 64, dtype=torch.bfloat16, device=DEV)
    out = torch.empty_like(q)
    ops.paged_attention(out, q, kc, vc, torch.zeros(0, 2, dtype=torch.int32, device=DEV),
                        torch.zeros(0, dtype=torch.int32, device=DEV), 0.125)
    ops.paged_prefill_attention(out, q, kc, vc, torch.zeros(0, 2, dtype=torch.int32, device=DEV),
                                torch.zeros(0, dtype=torch.int32, device=DEV),
                                torch.zeros(1, dtype=torch.int32, device=DEV), 0.125)
    torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ prefill
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", (16, 32))
def test_prefill_mixed_batch(dtype, head_size, block_size, gen):
    # full prefills, chunked prefill (context before the chunk), decode rows, a 1-token prompt,
    # an empty chunk, lengths that are not multiples of the block size or the 64-row tile
    ctx_lens = [37, 100, 300, 1, 64, 129, 50, 200]
    q_lens = [37, 1, 45, 1, 64, 0, 1, 133]
    run_prefill(dtype, head_size, block_size, 8, 2, ctx_lens, q_lens, gen=gen)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (32, 8), (32, 1), (40, 2), (6, 2)])
def test_prefill_gqa_mqa(hq, hkv, gen):
    run_prefill(torch.bfloat16, 64, 16, hq, hkv, [70, 33, 260, 5], [70, 1, 100, 5], gen=gen)
    run_prefill(torch.float32, 64, 16, hq, hkv, [70, 33], [70, 1], gen=gen)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("window,soft_cap", [(7, 0.0), (100, 0.0), (0, 5.0), (33, 30.0)])
def test_prefill_window_softcap(dtype, window, soft_cap, gen):
    run_prefill(dtype, 128, 16, 8, 4, [300, 90, 17, 500], [300, 1, 10, 129], window=window,
                soft_cap=soft_cap, gen=gen)


def test_prefill_long_sequence(gen):
    # the benchmark shape: one 4,096-token prompt, GQA 32/8, d128, bf16
    run_prefill(torch.bfloat16, 128, 16, 32, 8, [4096], [4096], gen=gen)
    run_prefill(torch.float16, 256, 32, 16, 4, [2000, 1500], [1000, 1500], gen=gen)


def test_prefill_matches_decode(gen):
    """A batch of decode rows through the prefill kernel equals the decode kernel."""
    ctx = [100, 1, 513]
    ks, vs, kc, vc, bt, seq_lens = make_paged(ctx, 2, 128, 16, torch.bfloat16, gen=gen)
    q = torch.randn(3, 8, 128, device=DEV).to(torch.bfloat16)
    a, b = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    ops.paged_attention(a, q, kc, vc, bt, seq_lens, 0.1, split_k=0)
    ops.paged_prefill_attention(b, q, kc, vc, bt, seq_lens, torch.arange(4, dtype=torch.int32, device=DEV), 0.1)
    torch.cuda.synchronize()
    ref = torch.cat([ref_rows(q[i:i + 1].double(), ks[i], vs[i], [ctx[i] - 1], 0.1) for i in range(3)])
    check(a, ref, torch.bfloat16, "decode")
    check(b, ref, torch.bfloat16, "prefill with decode rows")


# ------------------------------------------------------------------------------------ forced decode plans
@pytest.mark.skipif(bool(os.environ.get("PAGEDLLM_DECODE_MODE")), reason="already under a forced plan")
@pytest.mark.parametrize("mode,reduce,combine", [
    ("warp", "warp", "kernel"), ("pair", "cta", "kernel"), ("cta", "warp", "kernel"), ("cta", "cta", "kernel"),
    ("warp", "warp", "inkernel"), ("pair", "warp", "inkernel"), ("cta", "warp", "inkernel")])
def test_decode_under_forced_plans(mode, reduce, combine):
    """The decode tests of this file (the CUDA-graph, two-stream and empty-batch ones included)
    again with the v2 kernel's work items forced onto single warps, pairs of warps or whole CTAs
    (PAGEDLLM_DECODE_MODE), the split-K partitions combined by the reduction kernel (forced to warp
    rows or CTA rows, PAGEDLLM_REDUCE) or inside the decode kernel by the last partition to finish
    (PAGEDLLM_SPLITK_COMBINE=inkernel, at every split count), whatever the cost model would choose:
    these settings are read once per process, so each runs in a child pytest."""
    env = dict(os.environ, PAGEDLLM_DECODE_MODE=mode, PAGEDLLM_REDUCE=reduce, PAGEDLLM_SPLITK_COMBINE=combine)
    cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider", "-m", "cuda",
           "-k", "(decode or graph or combine or empty) and not forced_plans and not fallbacks"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"decode tests under {mode} items / {reduce} reduction / {combine} combine failed:\n{r.stdout[-3000:]}"
    assert " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-3000:]


# ------------------------------------------------------------------------------------ split-K combine
# With PAGEDLLM_SPLITK_COMBINE=inkernel (the forced-plan children above) every v2 split decode must
# combine in the kernel (last arriver, persistent zeroed counters) unless a stream's counters are too
# few for its groups, with =kernel never; without it the cost model decides. Each test below
# therefore checks the plan it got against that setting.
FORCED_COMBINE = os.environ.get("PAGEDLLM_SPLITK_COMBINE")
COUNTERS_PER_STREAM = 16384  # kSplitCountersPerSlab (cuda/attention_launch.h)


def check_combine(splits, groups=1):
    """The last call's plan: `splits` partitions, combined as PAGEDLLM_SPLITK_COMBINE says (v2 only)."""
    plan = ops.last_cuda_decode_plan()
    assert plan["splits"] == splits, plan
    if splits == 1:
        assert plan["combine"] == "none", plan
    elif not plan["kernel"].startswith("v2") or FORCED_COMBINE == "kernel" or groups > COUNTERS_PER_STREAM:
        assert plan["combine"] == "kernel", plan
    elif FORCED_COMBINE == "inkernel":
        assert plan["combine"] == "in-kernel", plan
    else:
        assert plan["combine"] in ("kernel", "in-kernel"), plan
    return plan


@pytest.mark.parametrize("dtype,head_size,hq,hkv", [
    (torch.bfloat16, 128, 32, 8), (torch.float16, 64, 8, 2), (torch.bfloat16, 96, 40, 2), (torch.float16, 80, 4, 4)],
    ids=["bf16-d128-32/8", "fp16-d64-8/2", "bf16-d96-40/2", "fp16-d80-4/4"])
def test_decode_combine_split_counts(dtype, head_size, hq, hkv, gen):
    """Split counts 2..4 (and 5, 8, 12, 16) on lengths 1, not multiples of the block size, shorter than the
    partition count in tiles, and long; each split count three times in a row with fresh queries,
    so a counter left non-zero by one call would corrupt the next."""
    ctx = [1, 17, 100, 333, 1000, 4095]
    ks, vs, kc, vc, bt, seq_lens = make_paged(ctx, hkv, head_size, 16, dtype, gen=gen)
    scale = head_size ** -0.5
    groups = len(ctx) * hkv * math.ceil(hq // hkv / 16)
    for split_k in (2, 3, 4, 5, 8, 12, 16):
        for _ in range(3):
            q = torch.randn(len(ctx), hq, head_size, generator=gen, device=DEV, dtype=torch.float64).to(dtype)
            ref = torch.stack([ref_rows(q[i:i + 1].double(), ks[i], vs[i], [ctx[i] - 1], scale)[0]
                               for i in range(len(ctx))])
            out = torch.full_like(q, float("nan"))
            ops.paged_attention(out, q, kc, vc, bt, seq_lens, scale, split_k=split_k)
            check_combine(split_k, groups)
            torch.cuda.synchronize()
            check(out, ref, dtype, f"decode {dtype} D={head_size} {hq}/{hkv} split_k={split_k}")


def test_decode_combine_two_streams(gen):
    """Split decodes enqueued alternately on two streams without synchronising in between (each
    stream has its own counters): every output matches the reference and its stream's other runs."""
    dtype, hq, hkv, d = torch.bfloat16, 32, 8, 128
    sets = []
    for lens, split_k in (([2048] * 12 + [77, 1], 2), ([1500] * 10 + [3, 999], 3)):
        ks, vs, kc, vc, bt, seq_lens = make_paged(lens, hkv, d, 16, dtype, gen=gen)
        q = torch.randn(len(lens), hq, d, generator=gen, device=DEV, dtype=torch.float64).to(dtype)
        ref = torch.stack([ref_rows(q[i:i + 1].double(), ks[i], vs[i], [lens[i] - 1], 0.09)[0]
                           for i in range(len(lens))])
        outs = [torch.full_like(q, float("nan")) for _ in range(6)]
        sets.append((q, kc, vc, bt, seq_lens, split_k, ref, outs, torch.cuda.Stream()))
    torch.cuda.synchronize()
    for i in range(6):
        for q, kc, vc, bt, seq_lens, split_k, _, outs, stream in sets:
            with torch.cuda.stream(stream):
                ops.paged_attention(outs[i], q, kc, vc, bt, seq_lens, 0.09, split_k=split_k)
            check_combine(split_k)
    torch.cuda.synchronize()
    for q, _, _, _, _, split_k, ref, outs, _ in sets:
        for i, out in enumerate(outs):
            check(out, ref, dtype, f"two streams, split_k={split_k}, call {i}")
            assert torch.equal(out, outs[0]), f"split_k={split_k}: call {i} differs from call 0"


def test_decode_combine_cuda_graph(gen):
    """Split decodes (2, 3 and 4 partitions) captured in one CUDA graph and replayed several times
    with new queries: every replay equals eager calls on the same inputs bit for bit, and the
    reference."""
    dtype, hq, hkv, d = torch.bfloat16, 32, 8, 128
    lens = [4096, 1, 300, 2049, 640]
    ks, vs, kc, vc, bt, seq_lens = make_paged(lens, hkv, d, 16, dtype, gen=gen)
    q = torch.randn(len(lens), hq, d, device=DEV).to(dtype)
    splits = (2, 3, 4)
    outs = [torch.full_like(q, float("nan")) for _ in splits]

    def step():
        for out, split_k in zip(outs, splits):
            ops.paged_attention(out, q, kc, vc, bt, seq_lens, 0.08, split_k=split_k)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture (kernel attributes, the counters)
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    check_combine(splits[-1])
    for _ in range(4):
        q.copy_(torch.randn(len(lens), hq, d, device=DEV).to(dtype))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = [out.clone() for out in outs]
        ref = torch.stack([ref_rows(q[i:i + 1].double(), ks[i], vs[i], [lens[i] - 1], 0.08)[0]
                           for i in range(len(lens))])
        for out in outs:
            out.fill_(float("nan"))
        step()
        torch.cuda.synchronize()
        for r, e, split_k in zip(replayed, outs, splits):
            check(r, ref, dtype, f"graph-replayed decode, split_k={split_k}")
            assert torch.equal(r, e), f"split_k={split_k}: graph replay differs from the eager call"


def test_decode_combine_fallbacks():
    """In a fresh process with the in-kernel combine forced: a CUDA graph captured before any eager
    split decode (no counter buffer yet) falls back to the reduction kernel and is still right; an
    eager call then allocates the counters and a second capture combines in the kernel; a call with
    more (sequence, KV head) groups than a stream's counters falls back to the reduction kernel."""
    script = r"""
import torch, pagedllm.ops as ops
dev = "cuda"
def ref(q, kc, vc, bt, lens, scale):
    rows = []
    g = q.shape[1] // kc.shape[1]
    for i, n in enumerate(lens):
        pos = torch.arange(n, device=dev)
        k = kc[bt[i, pos // 16].long(), :, pos % 16].double().repeat_interleave(g, 1)
        v = vc[bt[i, pos // 16].long(), :, pos % 16].double().repeat_interleave(g, 1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i].double(), k) * scale, -1)
        rows.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(rows)
def close(out, r, what):
    err = ((out.double() - r).norm() / r.norm()).item()
    assert err < 8e-3, (what, err)
lens = [300, 1000, 17]
kc = torch.randn(200, 8, 16, 128, device=dev).to(torch.bfloat16)
vc = torch.randn_like(kc)
bt = torch.randperm(200, device=dev)[:3 * 63].view(3, 63).to(torch.int32)
sl = torch.tensor(lens, dtype=torch.int32, device=dev)
q = torch.randn(3, 32, 128, device=dev).to(torch.bfloat16)
out = torch.full_like(q, float("nan"))
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    ops.paged_attention(out, q, kc, vc, bt, sl, 0.1, split_k=2)
assert ops.last_cuda_decode_plan()["combine"] == "kernel", ops.last_cuda_decode_plan()
g.replay(); torch.cuda.synchronize()
close(out, ref(q, kc, vc, bt, lens, 0.1), "graph captured before the counters")
out2 = torch.full_like(q, float("nan"))
ops.paged_attention(out2, q, kc, vc, bt, sl, 0.1, split_k=2)
assert ops.last_cuda_decode_plan()["combine"] == "in-kernel", ops.last_cuda_decode_plan()
torch.cuda.synchronize()
close(out2, ref(q, kc, vc, bt, lens, 0.1), "eager")
g2 = torch.cuda.CUDAGraph()
out3 = torch.full_like(q, float("nan"))
with torch.cuda.graph(g2):
    ops.paged_attention(out3, q, kc, vc, bt, sl, 0.1, split_k=2)
assert ops.last_cuda_decode_plan()["combine"] == "in-kernel", ops.last_cuda_decode_plan()
g2.replay(); torch.cuda.synchronize()
assert torch.equal(out3, out2), "graph with counters != eager"
# more groups than one stream's counters: 2100 sequences x 8 KV heads = 16,800 > 16,384
n = 2100
lens = torch.randint(1, 40, (n,)).tolist()
kc = torch.randn(n * 3 + 1, 8, 16, 64, device=dev).to(torch.float16)
vc = torch.randn_like(kc)
bt = torch.randperm(n * 3 + 1, device=dev)[:n * 3].view(n, 3).to(torch.int32)
sl = torch.tensor(lens, dtype=torch.int32, device=dev)
q = torch.randn(n, 8, 64, device=dev).to(torch.float16)
out = torch.full_like(q, float("nan"))
ops.paged_attention(out, q, kc, vc, bt, sl, 0.125, split_k=2)
assert ops.last_cuda_decode_plan() == {"kernel": "v2-warp", "splits": 2, "combine": "kernel"}, ops.last_cuda_decode_plan()
torch.cuda.synchronize()
close(out, ref(q, kc, vc, bt, lens, 0.125), "too many groups")
print("FALLBACKS OK")
"""
    env = dict(os.environ, PAGEDLLM_SPLITK_COMBINE="inkernel", PAGEDLLM_DECODE_MODE="warp")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "FALLBACKS OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


# ------------------------------------------------------------------------------------ streams, graphs
def test_cuda_graph_capture_and_side_stream(gen):
    """Decode (split-K with its stream-ordered workspace) and prefill captured in a CUDA graph on a
    side stream; replays with new inputs copied into the captured buffers give fresh results."""
    ctx = [4096, 300]
    dtype = torch.bfloat16
    ks, vs, kc, vc, bt, seq_lens = make_paged(ctx, 8, 128, 16, dtype, gen=gen)
    q = torch.randn(2, 32, 128, device=DEV).to(dtype)
    qp = torch.randn(sum(ctx), 32, 128, device=DEV).to(dtype)
    qsl = torch.tensor([0, ctx[0], sum(ctx)], dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    outp = torch.full_like(qp, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (first launches set kernel attributes)
        ops.paged_attention(out, q, kc, vc, bt, seq_lens, 0.08, split_k=16)
        ops.paged_prefill_attention(outp, qp, kc, vc, bt, seq_lens, qsl, 0.08)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.paged_attention(out, q, kc, vc, bt, seq_lens, 0.08, split_k=16)
        ops.paged_prefill_attention(outp, qp, kc, vc, bt, seq_lens, qsl, 0.08)
    for _ in range(2):
        q.copy_(torch.randn(2, 32, 128, device=DEV).to(dtype))
        qp.copy_(torch.randn(sum(ctx), 32, 128, device=DEV).to(dtype))
        out.fill_(float("nan"))
        outp.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.cat([ref_rows(q[i:i + 1].double(), ks[i], vs[i], [ctx[i] - 1], 0.08) for i in range(2)])
        check(out, ref, dtype, "graph-replayed decode")
        refp = torch.cat([ref_rows(qp[:ctx[0]].double(), ks[0], vs[0], list(range(ctx[0])), 0.08),
                          ref_rows(qp[ctx[0]:].double(), ks[1], vs[1], list(range(ctx[1])), 0.08)])
        check(outp, refp, dtype, "graph-replayed prefill")


# ------------------------------------------------------------------------------------ cache ops
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("head_size", (64, 80, 256))
@pytest.mark.parametrize("block_size", (16, 32))
def test_reshape_and_cache(dtype, head_size, block_size, gen):
    num_blocks, hkv, t = 9, 3, 40
    kc = torch.full((num_blocks, hkv, block_size, head_size), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    key = torch.randn(t, hkv, head_size, generator=gen, device=DEV).to(dtype)
    value = torch.randn(t, hkv, head_size, generator=gen, device=DEV).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEV)[:t].to(torch.int64)
    slots[::7] = -1  # padding tokens are skipped
    ops.reshape_and_cache(key, value, kc, vc, slots)
    torch.cuda.synchronize()
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEV)
    for i in range(t):
        s = int(slots[i])
        if s < 0:
            continue
        blk, row = s // block_size, s % block_size
        written[blk, row] = True
        assert torch.equal(kc[blk, :, row], key[i]) and torch.equal(vc[blk, :, row], value[i]), f"token {i}"
    untouched = ~written
    assert torch.isnan(kc.permute(0, 2, 1, 3)[untouched].float()).all(), "a slot nobody wrote was changed"
    assert torch.isnan(vc.permute(0, 2, 1, 3)[untouched].float()).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_copy_blocks(dtype, gen):
    layers, shape = 3, (12, 2, 16, 80)
    kcs = [torch.randn(shape, generator=gen, device=DEV).to(dtype) for _ in range(layers)]
    vcs = [torch.randn(shape, generator=gen, device=DEV).to(dtype) for _ in range(layers)]
    before_k = [k.clone() for k in kcs]
    before_v = [v.clone() for v in vcs]
    mapping = torch.tensor([[0, 5], [3, 7], [11, 1], [4, 9]], dtype=torch.int64, device=DEV)
    ops.copy_blocks(kcs, vcs, mapping)
    torch.cuda.synchronize()
    for layer in range(layers):
        ek, ev = before_k[layer].clone(), before_v[layer].clone()
        for src, dst in mapping.tolist():
            ek[dst] = before_k[layer][src]
            ev[dst] = before_v[layer][src]
        assert torch.equal(kcs[layer], ek) and torch.equal(vcs[layer], ev), f"layer {layer}"


@pytest.mark.parametrize("pinned", (False, True))
def test_swap_blocks_roundtrip(pinned, gen):
    shape = (10, 2, 16, 64)
    gpu = torch.randn(shape, generator=gen, device=DEV).to(torch.bfloat16)
    cpu = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    if pinned:
        cpu = cpu.pin_memory()
    out_map = torch.tensor([[2, 0], [3, 1], [4, 2], [9, 5]], dtype=torch.int64)  # a run + a single
    ops.swap_blocks(gpu, cpu, out_map)
    torch.cuda.synchronize()
    for src, dst in out_map.tolist():
        assert torch.equal(cpu[dst], gpu[src].cpu())
    back = torch.full_like(gpu, float("nan"))
    in_map = torch.tensor([[5, 8], [0, 0], [1, 1]], dtype=torch.int64)
    ops.swap_blocks(cpu, back, in_map)
    torch.cuda.synchronize()
    assert torch.equal(back[8], gpu[9]) and torch.equal(back[0], gpu[2]) and torch.equal(back[1], gpu[3])
    assert torch.isnan(back[2:8].float()).all()
