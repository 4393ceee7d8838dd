"""FP8 KV caches (float8_e4m3fn, float8_e5m2) in every KV kernel, against float64 references.

The writer (reshape_and_cache) is checked bit for bit against PyTorch's own conversion of
``(x / scale).clamp(-max, max)`` (round to nearest-even, saturating). The attention kernels are
checked against the float64 reference attention (kernel_reference.reference_attention) over the
*dequantized* cache (code * scale) of identical inputs, so the only differences are the kernels'
float32 sums and the output rounding. Fresh random inputs every run (the seed is printed); slots
no sequence owns hold NaN codes (0x7f in both formats) and every output is poisoned with NaN
first, so a wrong gather or an unwritten row shows. CUDA cases carry the `cuda` marker.
"""

from __future__ import annotations

import math

import pytest
import torch

import pagedllm.ops as ops
from kernel_reference import assert_close_to_reference, build_paged_cache, poisoned, reference_attention
from test_layer_ops_cuda import rope_tables, rope_torch

torch.set_num_threads(2)

FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_IDS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}

#: (device, fp8 cache dtype, query dtype): the CPU takes float32 and bfloat16 queries, CUDA
#: bfloat16 and float16 (ops.fp8_query_dtypes)
CASES = [pytest.param("cpu", kv, q, id=f"cpu-{FP8_IDS[kv]}-{str(q)[6:]}")
         for kv in FP8 for q in (torch.float32, torch.bfloat16)] + [
    pytest.param("cuda", kv, q, id=f"cuda-{FP8_IDS[kv]}-{str(q)[6:]}", marks=pytest.mark.cuda)
    for kv in FP8 for q in (torch.bfloat16, torch.float16)]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


@pytest.fixture(autouse=True)
def _two_threads():
    ops.set_num_threads(2)
    yield
    ops.set_num_threads(0)


def reference_codes(x: torch.Tensor, scale: float, kv_dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's saturating FP8 codes of x / scale (uint8 view)."""
    mx = FP8[kv_dtype]
    return (x.float() / torch.tensor(scale, dtype=torch.float32)).clamp(-mx, mx).to(kv_dtype).view(torch.uint8)


def dequantized(x: torch.Tensor, scale: float, kv_dtype: torch.dtype) -> torch.Tensor:
    """float64 values the cache stands for: code * scale."""
    return reference_codes(x, scale, kv_dtype).view(kv_dtype).to(torch.float64) * scale


class Fp8Cache:
    """A paged FP8 cache written through ops.reshape_and_cache from per-sequence K/V [L, Hkv, D] in
    the query dtype (block tables, slots and unowned blocks as kernel_reference.build_paged_cache),
    with the float64 dequantized K/V of each sequence for the reference."""

    def __init__(self, seq_lens, num_kv_heads, head_size, block_size, kv_dtype, q_dtype, device, gen):
        # codes of standard normal values up to 5 sigma stay below e4m3's 448 (no saturation here):
        # most are normal numbers, the smallest subnormal
        self.k_scale = float(torch.empty(1).uniform_(0.012, 0.03, generator=gen))
        self.v_scale = float(torch.empty(1).uniform_(0.012, 0.03, generator=gen))
        self.keys = [(torch.randn(n, num_kv_heads, head_size, generator=gen)).to(q_dtype)
                     for n in seq_lens]
        self.values = [(torch.randn(n, num_kv_heads, head_size, generator=gen)).to(q_dtype)
                       for n in seq_lens]
        layout = build_paged_cache(self.keys, self.values, block_size, torch.float32, "cpu", gen,
                                   num_kv_heads=num_kv_heads, head_size=head_size)
        shape = layout.key_cache.shape
        self.key_cache = torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(kv_dtype)  # NaN codes
        self.value_cache = torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(kv_dtype)
        self.block_tables = layout.block_tables.to(device)
        self.slot_mappings = layout.slot_mappings
        self.k_scale_t = torch.tensor([self.k_scale], dtype=torch.float32, device=device)
        self.v_scale_t = torch.tensor([self.v_scale], dtype=torch.float32, device=device)
        if seq_lens and sum(seq_lens):
            ops.reshape_and_cache(torch.cat(self.keys).to(device), torch.cat(self.values).to(device), self.key_cache,
                                  self.value_cache, torch.cat(self.slot_mappings).to(device), self.k_scale_t,
                                  self.v_scale_t)
        self.deq_keys = [dequantized(k, self.k_scale, kv_dtype) for k in self.keys]
        self.deq_values = [dequantized(v, self.v_scale, kv_dtype) for v in self.values]


def check_decode(device, kv_dtype, q_dtype, seq_lens, num_heads, num_kv_heads, head_size, block_size, gen,
                 split_modes=(None, 0, 4), sliding_window=None, soft_cap=None):
    cache = Fp8Cache(seq_lens, num_kv_heads, head_size, block_size, kv_dtype, q_dtype, device, gen)
    B = len(seq_lens)
    query = torch.randn(B, num_heads, head_size, generator=gen).to(q_dtype)
    scale = 1.0 / math.sqrt(head_size)
    ref = torch.zeros(B, num_heads, head_size, dtype=torch.float64)
    for b, n in enumerate(seq_lens):
        if n:
            ref[b] = reference_attention(query[b:b + 1], cache.deq_keys[b], cache.deq_values[b],
                                         torch.tensor([n - 1]), scale, sliding_window, soft_cap)[0]
    for split_k in split_modes:
        out = poisoned((B, num_heads, head_size), q_dtype, device)
        ops.paged_attention(out, query.to(device), cache.key_cache, cache.value_cache, cache.block_tables,
                            torch.tensor(seq_lens, dtype=torch.int32, device=device), scale,
                            sliding_window=sliding_window, soft_cap=soft_cap, split_k=split_k,
                            k_scale=cache.k_scale_t, v_scale=cache.v_scale_t)
        if device == "cuda":
            torch.cuda.synchronize()
        assert_close_to_reference(out, ref, q_dtype)


def check_prefill(device, kv_dtype, q_dtype, contexts, num_heads, num_kv_heads, head_size, block_size, gen,
                  sliding_window=None):
    seq_lens = [c for c, _ in contexts]
    cache = Fp8Cache(seq_lens, num_kv_heads, head_size, block_size, kv_dtype, q_dtype, device, gen)
    T = sum(q for _, q in contexts)
    query = torch.randn(T, num_heads, head_size, generator=gen).to(q_dtype)
    scale = 1.0 / math.sqrt(head_size)
    ref = torch.zeros(T, num_heads, head_size, dtype=torch.float64)
    qsl = [0]
    for b, (n, q_len) in enumerate(contexts):
        s = qsl[-1]
        ref[s:s + q_len] = reference_attention(query[s:s + q_len], cache.deq_keys[b], cache.deq_values[b],
                                               torch.arange(n - q_len, n), scale, sliding_window)
        qsl.append(s + q_len)
    out = poisoned((T, num_heads, head_size), q_dtype, device)
    ops.paged_prefill_attention(out, query.to(device), cache.key_cache, cache.value_cache, cache.block_tables,
                                torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                torch.tensor(qsl, dtype=torch.int32, device=device), scale,
                                sliding_window=sliding_window, k_scale=cache.k_scale_t, v_scale=cache.v_scale_t)
    if device == "cuda":
        torch.cuda.synchronize()
    assert_close_to_reference(out, ref, q_dtype)


# ----------------------------------------------------------------------------- the writer


@pytest.mark.parametrize("device,kv_dtype,q_dtype", CASES)
def test_reshape_and_cache_matches_torch_codes_and_saturates(device, kv_dtype, q_dtype, gen):
    """Codes equal torch's (x / scale).clamp(+-max).to(fp8) bit for bit, including values far past the
    format's range (saturated, never NaN / inf), exact ties and subnormals; padding slots (-1) skip."""
    T, H, D, bs = 40, 2, 64, 16
    mx = FP8[kv_dtype]
    scale = 0.5
    x = torch.randn(T, H, D, generator=gen) * mx * scale * 0.3
    x[0, 0, :8] = torch.tensor([1e6, -1e6, mx * scale * 1.02, -mx * scale * 1.3, 3 * 2**-11, 2**-12, 0.0, -0.0])
    x[1, 0, :4] = torch.tensor([float("inf"), float("-inf"), mx * scale, 1e-30])
    x = x.to(q_dtype)
    v = (-x).contiguous()
    kc = torch.zeros(6, H, bs, D, dtype=torch.uint8, device=device).view(kv_dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(6 * bs, generator=gen)[:T]
    slots[5] = -1
    sc = torch.tensor([scale], device=device)
    ops.reshape_and_cache(x.to(device), v.to(device), kc, vc, slots.to(device), sc, sc)
    blk, row = slots // bs, slots % bs
    keep = slots >= 0
    got_k = kc.cpu().view(torch.uint8)[blk[keep], :, row[keep]]
    got_v = vc.cpu().view(torch.uint8)[blk[keep], :, row[keep]]
    assert torch.equal(got_k, reference_codes(x[keep], scale, kv_dtype))
    assert torch.equal(got_v, reference_codes(v[keep], scale, kv_dtype))
    deq = got_k.view(kv_dtype).float()
    assert torch.isfinite(deq).all() and deq.abs().max().item() == mx  # saturated, not inf / NaN
    # the padding token's slot was not written: every byte of its block row stays 0 unless owned
    assert int((kc.cpu().view(torch.uint8) != 0).sum()) <= int(keep.sum()) * H * D


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_cache_errors_name_the_value(device):
    """A float32 query on CUDA with an FP8 cache, a bad scale, a mismatched key dtype: ValueError."""
    kc = torch.zeros(2, 1, 16, 64, dtype=torch.float8_e4m3fn, device=device)
    bad_q = torch.float32 if device == "cuda" else torch.float16
    q = torch.zeros(1, 1, 64, dtype=bad_q, device=device)
    with pytest.raises(ValueError, match="query must be one of"):
        ops.paged_attention(torch.empty_like(q), q, kc, kc, torch.zeros(1, 2, dtype=torch.int32, device=device),
                            torch.ones(1, dtype=torch.int32, device=device), 0.125)
    k = torch.zeros(1, 1, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="k_scale must be a one-element float32"):
        ops.reshape_and_cache(k, k, kc, kc, torch.zeros(1, dtype=torch.int64, device=device),
                              torch.ones(2, device=device), None)
    if device == "cpu":
        with pytest.raises(ValueError, match="v_scale must be finite and > 0, got 0"):
            ops.reshape_and_cache(k, k, kc, kc, torch.zeros(1, dtype=torch.int64), None, torch.zeros(1))


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_and_swap_blocks_move_fp8_bytes(device, gen):
    """Copy-on-write and swaps move an FP8 block's bytes unchanged (one byte per element)."""
    codes = torch.randint(0, 256, (5, 2, 16, 32), dtype=torch.uint8, generator=gen)
    kc = codes.clone().to(device).view(torch.float8_e5m2)
    vc = codes.flip(0).contiguous().to(device).view(torch.float8_e5m2)
    ops.copy_blocks([kc], [vc], torch.tensor([[1, 3], [4, 0]], device=device))
    want_k, want_v = codes.clone(), codes.flip(0).contiguous()
    want_k[3], want_k[0] = codes[1], codes[4]
    want_v[3], want_v[0] = want_v[1].clone(), want_v[4].clone()
    assert torch.equal(kc.cpu().view(torch.uint8), want_k) and torch.equal(vc.cpu().view(torch.uint8), want_v)
    dst = torch.zeros(3, 2, 16, 32, dtype=torch.float8_e5m2)
    ops.swap_blocks(kc, dst, torch.tensor([[2, 1]]))
    assert torch.equal(dst.view(torch.uint8)[1], want_k[2])


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("device,kv_dtype,q_dtype", CASES)
@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_dequantized_reference(device, kv_dtype, q_dtype, head_size, block_size, gen):
    if device == "cuda" and head_size > 128:  # CUDA's FP8 kernels stop at 128 (attention.h)
        with pytest.raises(ValueError, match="FP8 KV caches support head sizes up to 128, got 256"):
            check_decode(device, kv_dtype, q_dtype, [17], 8, 2, head_size, block_size, gen)
        return
    check_decode(device, kv_dtype, q_dtype, [1, 17, 64, 150, 333], 8, 2, head_size, block_size, gen)


@pytest.mark.parametrize("device,kv_dtype,q_dtype", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 1), (12, 3), (32, 8)])
def test_decode_gqa_and_mqa(device, kv_dtype, q_dtype, num_heads, num_kv_heads, gen):
    check_decode(device, kv_dtype, q_dtype, [5, 90, 257], num_heads, num_kv_heads, 128, 16, gen)


@pytest.mark.parametrize("device,kv_dtype,q_dtype", CASES)
def test_decode_long_context_split_k(device, kv_dtype, q_dtype, gen):
    """Long contexts through flash-decoding partitions (auto and forced) and one pass."""
    check_decode(device, kv_dtype, q_dtype, [4100, 2500], 32, 8, 128, 16, gen, split_modes=(None, 0, 16))


@pytest.mark.parametrize("device,kv_dtype,q_dtype", CASES)
def test_decode_sliding_window_and_soft_cap(device, kv_dtype, q_dtype, gen):
    check_decode(device, kv_dtype, q_dtype, [3, 100, 300], 8, 2, 64, 16, gen, sliding_window=40, soft_cap=5.0)


# ----------------------------------------------------------------------------- prefill

MIXED = [(37, 37), (100, 23), (50, 1), (1, 1), (64, 64), (20, 0), (129, 1)]


@pytest.mark.parametrize("device,kv_dtype,q_dtype", CASES)
@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_mixed_batch_matches_dequantized_reference(device, kv_dtype, q_dtype, head_size, block_size, gen):
    if device == "cuda" and head_size > 128:
        with pytest.raises(ValueError, match="FP8 KV caches support head sizes up to 128, got 256"):
            check_prefill(device, kv_dtype, q_dtype, MIXED, 8, 2, head_size, block_size, gen)
        return
    check_prefill(device, kv_dtype, q_dtype, MIXED, 8, 2, head_size, block_size, gen)


@pytest.mark.parametrize("device,kv_dtype,q_dtype", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 1), (32, 8)])
def test_prefill_gqa_long_prompt_and_window(device, kv_dtype, q_dtype, num_heads, num_kv_heads, gen):
    check_prefill(device, kv_dtype, q_dtype, [(600, 600), (300, 150), (9, 1)], num_heads, num_kv_heads, 128, 16,
                  gen)
    check_prefill(device, kv_dtype, q_dtype, MIXED, num_heads, num_kv_heads, 64, 16, gen, sliding_window=33)


# ----------------------------------------------------------------------------- CUDA's fused writers


def _slots_and_caches(tokens, hkv, d, bs, kv_dtype, gen):
    num_blocks = tokens // bs + 3
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    slots[tokens // 2] = -1  # padding: nothing written
    kc = torch.full((num_blocks, hkv, bs, d), 0x7F, dtype=torch.uint8, device="cuda").view(kv_dtype)
    return slots, kc, kc.clone()


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", list(FP8), ids=lambda d: FP8_IDS[d])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("paired", [False, True], ids=["standard", "paired-rows"])
def test_rotary_embedding_and_cache_writes_fp8_codes(kv_dtype, q_dtype, paired, gen):
    """The fused rotary + cache kernel stores the codes of (the key rotated in the query's dtype) /
    k_scale and value / v_scale, bit-equal to torch's saturating conversion; padding writes nothing."""
    tokens, hq, hkv, d, bs = 37, 8, 2, 128, 16
    cos, sin = rope_tables(300, d // 2, q_dtype)
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen) * 3).to(q_dtype).cuda()
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    positions = torch.randint(0, 300, (tokens,), generator=gen).cuda()
    slots, kc, vc = _slots_and_caches(tokens, hkv, d, bs, kv_dtype, gen)
    k_scale, v_scale = torch.tensor([0.031], device="cuda"), torch.tensor([0.017], device="cuda")
    order = ops.rotary_paired_order(d).cuda() if paired else None
    qi = q[..., order] if paired else q
    ki = k[..., order] if paired else k
    query_out = torch.empty(tokens, hq, d, dtype=q_dtype, device="cuda")
    ops.rotary_embedding_and_cache(positions, qi, ki, v, cos, sin, query_out, kc, vc, slots.cuda(), paired_rows=paired,
                                   k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    k_rot = rope_torch(k, positions, cos, sin).cpu()
    keep = slots >= 0
    blk, row = slots[keep] // bs, slots[keep] % bs
    assert torch.equal(kc.cpu().view(torch.uint8)[blk, :, row], reference_codes(k_rot[keep], 0.031, kv_dtype))
    assert torch.equal(vc.cpu().view(torch.uint8)[blk, :, row], reference_codes(v.cpu()[keep], 0.017, kv_dtype))
    assert int((kc.cpu().view(torch.uint8) != 0x7F).sum()) <= int(keep.sum()) * hkv * d  # nothing else written
    assert torch.equal(query_out, rope_torch(q, positions, cos, sin))


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", list(FP8), ids=lambda d: FP8_IDS[d])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("paired", [False, True], ids=["counters", "paired-rows"])
def test_gemv_rope_epilogue_writes_the_same_fp8_codes(kv_dtype, m, paired, gen):
    """The qkv GEMV's rope epilogue into FP8 caches equals gemv then rotary_embedding_and_cache into
    FP8 caches, byte for byte (the same roundings, then the same conversion)."""
    hq, hkv, d, bs, hidden = 8, 2, 128, 16, 256
    dtype = torch.bfloat16
    n = (hq + 2 * hkv) * d
    x = torch.randn(m, hidden, generator=gen).to(dtype).cuda()
    w = (torch.randn(n, hidden, generator=gen) * 0.1).to(dtype).cuda()
    cos, sin = rope_tables(64, d // 2, dtype)
    positions = torch.randint(0, 64, (m,), generator=gen).cuda()
    slots, kc, vc = _slots_and_caches(m, hkv, d, bs, kv_dtype, gen)
    slots = slots.cuda()
    ref_kc, ref_vc = kc.clone(), vc.clone()
    k_scale, v_scale = torch.tensor([0.05], device="cuda"), torch.tensor([0.02], device="cuda")
    if paired:
        rows = torch.arange(n)
        order = ops.rotary_paired_order(d)
        for h in range(hq + hkv):
            rows[h * d:(h + 1) * d] = h * d + order
        w_run = w[rows.cuda()].contiguous()
    else:
        w_run = w
    y = ops.gemv(x, w)
    q, k, v = (t.reshape(m, -1, d) for t in y.split([hq * d, hkv * d, hkv * d], dim=-1))
    ref_qo = torch.empty(m, hq, d, dtype=dtype, device="cuda")
    ops.rotary_embedding_and_cache(positions, q, k, v, cos, sin, ref_qo, ref_kc, ref_vc, slots, k_scale=k_scale,
                                   v_scale=v_scale)
    qo = torch.empty_like(ref_qo)
    counters = None if paired else torch.zeros(hq + 2 * hkv, dtype=torch.int32, device="cuda")
    ops.gemv(x, w_run, rope=ops.GemvRope(hq, hkv, positions, cos, sin, qo, kc, vc, slots, counters, paired,
                                         k_scale=k_scale, v_scale=v_scale))
    torch.cuda.synchronize()
    assert torch.equal(qo, ref_qo)
    assert torch.equal(kc.view(torch.uint8), ref_kc.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), ref_vc.view(torch.uint8))
