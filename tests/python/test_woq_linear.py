"""The CPU weight-only quantized (WOQ) projection (pagedllm.ops.woq_linear, cpp/include/pagedllm/
cpu_woq_linear.h) and the exact forms that feed it (model_executor/quantization: woq.py, gguf.py,
int4.py), on fresh random inputs.

- woq_linear against a float64 product with the dequantized weight (scale * code + min, exact in
  float64): 4- and 8-bit codes, with and without min, groups of 2 .. 128 inputs, per channel, odd
  group counts, row counts around the 8-row tile, bias, float32 / bfloat16 x and out, strided x
  and out, 1 and 2 threads — within the float32 summation bound; bfloat16 out is the float32 result
  rounded once. Argument errors name the bad value.
- QuantizedWeight: validation, with_form / common_form change the form and not one value,
  load_layer cuts a rank's slices (column, q/k/v, row parallel; 2 ranks) exactly as the 16/32-bit
  loader cuts the dequantized weight, WoqLinearMethod on a layer.
- decode_gguf: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K bit for bit equal to the gguf package's dequantizer,
  on random blocks and on blocks gguf.quants.quantize makes; unpermute_rows undoes llama.cpp's
  converter permutation of q / k rows.
- quantize_int4: codes in [0, 15], 0 exact, at most half a step from the weight, group fallback.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import ops
from pagedllm.model_executor.quantization.gguf import SUPPORTED_GGUF_TYPES, decode_gguf, unpermute_rows
from pagedllm.model_executor.quantization.int4 import GROUP_SIZE, quantize_int4
from pagedllm.model_executor.quantization.woq import QuantizedWeight, WoqLinearMethod, common_form, load_layer

U = 2.0**-24  # float32 unit roundoff


# ---------------------------------------------------------------- helpers
def random_qweight(gen, n: int, k: int, bits: int, group: int, with_min: bool) -> QuantizedWeight:
    if bits == 8:
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.randn(n, k // group, generator=gen) * 0.05
    scale[0, 0] = 0.0  # a zero scale: that group of the row is its min
    mn = torch.randn(n, k // group, generator=gen) * 0.2 if with_min else None
    return QuantizedWeight(codes, bits, group, scale, mn, "test")


def reference(x: torch.Tensor, qw: QuantizedWeight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 x @ w^T + bias with w = scale * code + min in float64, float64 magnitude bound
    |x| @ (|scale * code| + |min|)^T + |bias| of the terms the kernel sums in float32)."""
    n, k = qw.shape
    c = qw.codes.double().view(n, -1, qw.group_size)
    sc = (c * qw.scale.double()[..., None]).view(n, k)
    w = sc if qw.min is None else sc + qw.min.double().repeat_interleave(qw.group_size, dim=1)
    mag_w = sc.abs() if qw.min is None else sc.abs() + qw.min.double().abs().repeat_interleave(qw.group_size, dim=1)
    xd = x.double()
    y, mag = xd @ w.T, xd.abs() @ mag_w.T
    if bias is not None:
        y, mag = y + bias.double(), mag + bias.double().abs()
    return y, mag


def float32_bound(k: int) -> float:
    """Relative bound of the float32 sums: k products summed per group, groups scaled and summed,
    min terms (their x sums), bias: fewer than k + 4 roundings on any path."""
    return (k + 4) * U


def pack(qw: QuantizedWeight):
    return (ops.woq_pack_weight(qw.codes, qw.bits), qw.scale.t().contiguous(),
            None if qw.min is None else qw.min.t().contiguous())


@pytest.fixture
def threads():
    """Restores the CPU kernels' thread count after the test."""
    before = ops.get_num_threads()
    yield
    ops.set_num_threads(before)


# ---------------------------------------------------------------- woq_linear
# (K, group): 96 / 32 is 3 groups, 160 / 160 per channel, 45 / 15 an odd group (8-bit only)
SHAPES = [(32, 2), (64, 16), (96, 32), (256, 128), (160, 160), (45, 15)]


@pytest.mark.parametrize("k,group", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("with_min", [False, True], ids=["nomin", "min"])
@pytest.mark.parametrize("bits", [4, 8], ids=["b4", "b8"])
def test_woq_linear_matches_float64_reference(gen, threads, bits, with_min, k, group):
    if bits == 4 and group % 2:
        k, group = 2 * k, 2 * group  # 4-bit codes pair inputs (odd groups: test_argument_errors): 90 / 30
    for n in (16, 48):
        qw = random_qweight(gen, n, k, bits, group, with_min)
        packed, scale_t, min_t = pack(qw)
        for m in (1, 7, 8, 9, 33):
            x_wide = torch.randn(m, k + 9, generator=gen) * 2
            for x_dtype in (torch.float32, torch.bfloat16):
                x = x_wide.to(x_dtype)[:, 4:4 + k]  # a view with a row stride of k + 9
                assert x.stride(0) == k + 9
                if m > 2:
                    x[1] = 0
                for bias in (None, torch.randn(n, generator=gen)):
                    y, mag = reference(x, qw, bias)  # x as the kernel reads it (bf16 exact in float64)
                    outs = {}
                    for t in (1, 2):
                        ops.set_num_threads(t)
                        outs[t] = ops.woq_linear(x, packed, bits, scale_t, min_t, bias, out_dtype=torch.float32)
                    out32 = outs[1]
                    assert out32.dtype == torch.float32 and out32.shape == (m, n)
                    # each output is summed by one thread (blocks of 16 columns): the count changes no bit
                    assert torch.equal(outs[2], out32)
                    err = ((out32.double() - y).abs() / (mag + 1e-30)).max().item()
                    assert err <= float32_bound(k), (m, n, x_dtype, bias is None, err)
                    # the same sums rounded once to bfloat16 (x's dtype is the default out dtype)
                    out16 = ops.woq_linear(x, packed, bits, scale_t, min_t, bias, out_dtype=torch.bfloat16)
                    assert torch.equal(out16.view(torch.int16), out32.to(torch.bfloat16).view(torch.int16))
                    default = ops.woq_linear(x, packed, bits, scale_t, min_t, bias)
                    assert default.dtype == x_dtype
                    # a given out with a row stride (a column slice of a larger tensor), others untouched
                    big = torch.full((m, n + 40), -7.0)
                    got = ops.woq_linear(x, packed, bits, scale_t, min_t, bias, out=big[:, 24:24 + n])
                    assert got.data_ptr() == big[:, 24:].data_ptr()
                    assert torch.equal(big[:, 24:24 + n], out32)
                    assert (big[:, :24] == -7).all() and (big[:, 24 + n:] == -7).all()
                    # the contiguous x gives the same bits as the strided view
                    assert torch.equal(ops.woq_linear(x.contiguous(), packed, bits, scale_t, min_t, bias,
                                                      out_dtype=torch.float32), out32)


def test_woq_linear_rows_do_not_depend_on_the_batch(gen):
    """A row's result is the same whether it is computed alone or in a tile of 8 with others."""
    qw = random_qweight(gen, 32, 64, 4, 32, True)
    packed, scale_t, min_t = pack(qw)
    x = torch.randn(19, 64, generator=gen)
    whole = ops.woq_linear(x, packed, 4, scale_t, min_t)
    for r in (0, 7, 8, 18):
        assert torch.equal(ops.woq_linear(x[r:r + 1], packed, 4, scale_t, min_t), whole[r:r + 1])


def test_woq_linear_m0_is_a_noop(gen):
    qw = random_qweight(gen, 16, 32, 8, 16, True)
    packed, scale_t, min_t = pack(qw)
    out = ops.woq_linear(torch.zeros(0, 32), packed, 8, scale_t, min_t, torch.ones(16))
    assert out.shape == (0, 16)
    given = torch.empty(0, 16, dtype=torch.bfloat16)
    assert ops.woq_linear(torch.zeros(0, 32, dtype=torch.bfloat16), packed, 8, scale_t, out=given) is given


def test_packed_layout(gen):
    codes8 = torch.randint(-128, 128, (32, 6), generator=gen, dtype=torch.int8)
    p8 = ops.woq_pack_weight(codes8, 8)
    assert p8.shape == (2, 6, 16) and p8.dtype == torch.int8
    for b in range(2):
        assert torch.equal(p8[b], codes8[16 * b:16 * b + 16].T)
    codes4 = torch.randint(0, 16, (16, 8), generator=gen, dtype=torch.uint8)
    p4 = ops.woq_pack_weight(codes4, 4)
    assert p4.shape == (1, 4, 16) and p4.dtype == torch.uint8
    assert torch.equal(p4[0], (codes4[:, 0::2] | (codes4[:, 1::2] << 4)).T)


def test_argument_errors_name_the_value(gen):
    codes8 = torch.randint(-128, 128, (32, 64), generator=gen, dtype=torch.int8)
    codes4 = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 3"):
        ops.woq_pack_weight(codes8, 3)
    with pytest.raises(ValueError, match=r"N a multiple of 16, got \[20, 64\]"):
        ops.woq_pack_weight(codes8[:20], 8)
    with pytest.raises(ValueError, match=r"K even, got \[32, 63\]"):
        ops.woq_pack_weight(codes4[:, :63].contiguous(), 4)
    bad = codes4.clone()
    bad[3, 5] = 16
    with pytest.raises(ValueError, match=r"in \[0, 15\], got 16 in row 3"):
        ops.woq_pack_weight(bad, 4)
    with pytest.raises(ValueError, match="codes must be uint8, got int8"):
        ops.woq_pack_weight(codes8, 4)
    p8, p4 = ops.woq_pack_weight(codes8, 8), ops.woq_pack_weight(codes4, 4)
    x, scale = torch.randn(3, 64, generator=gen), torch.ones(2, 32)
    with pytest.raises(ValueError, match=r"scale dimension 1 \(out_features, must match packed\) must be 32, got 16"):
        ops.woq_linear(x, p8, 8, torch.ones(2, 16))
    with pytest.raises(ValueError, match="scale has 3 groups, which does not divide in_features=64"):
        ops.woq_linear(x, p8, 8, torch.ones(3, 32))
    with pytest.raises(ValueError, match=r"min must be \[2, 32\] like scale, got \[2, 16\]"):
        ops.woq_linear(x, p8, 8, scale, torch.ones(2, 16))
    with pytest.raises(ValueError, match=r"min must be \[2, 32\] like scale, got \[4, 32\]"):
        ops.woq_linear(x, p8, 8, scale, torch.ones(4, 32))
    with pytest.raises(ValueError, match="4-bit weights need an even group size, got 1"):
        ops.woq_linear(x, p4, 4, torch.ones(64, 32))
    with pytest.raises(ValueError, match="x must be bfloat16 or float32, got float16"):
        ops.woq_linear(x.half(), p8, 8, scale, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"x dimension 1 \(in_features, must match packed\) must be 64, got 40"):
        ops.woq_linear(torch.randn(3, 40), p8, 8, scale)
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 3"):
        ops.woq_linear(x, p8, 3, scale)
    with pytest.raises(ValueError, match="packed must be uint8, got int8"):
        ops.woq_linear(x, p8, 4, scale)
    with pytest.raises(ValueError, match=r"bias must be a contiguous float32 \[32\] cpu tensor, got \[31\]"):
        ops.woq_linear(x, p8, 8, scale, None, torch.ones(31))
    with pytest.raises(ValueError, match="out must be bfloat16 or float32, got float16"):
        ops.woq_linear(x, p8, 8, scale, out=torch.empty(3, 32, dtype=torch.float16))
    buf = torch.zeros(3, 96)
    with pytest.raises(ValueError, match="out must not overlap x"):
        ops.woq_linear(buf[:, :64], p8, 8, scale, out=buf[:, 32:64])


# ---------------------------------------------------------------- QuantizedWeight and its forms
def test_quantized_weight_validation_names_the_value():
    c8, c4 = torch.zeros(16, 32, dtype=torch.int8), torch.zeros(16, 32, dtype=torch.uint8)
    s = torch.ones(16, 2)
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 3"):
        QuantizedWeight(c8, 3, 16, s)
    with pytest.raises(ValueError, match="4-bit codes must be torch.uint8, got torch.int8"):
        QuantizedWeight(c8, 4, 16, s)
    with pytest.raises(ValueError, match="group_size=5 does not divide in_features=32"):
        QuantizedWeight(c8, 8, 5, torch.ones(16, 6))
    with pytest.raises(ValueError, match=r"scale must be float32 \(16, 2\), got torch.float32 \(16, 4\)"):
        QuantizedWeight(c4, 4, 16, torch.ones(16, 4))
    with pytest.raises(ValueError, match=r"min must be float32 \(16, 2\), got torch.float64"):
        QuantizedWeight(c4, 4, 16, s, torch.ones(16, 2, dtype=torch.float64))
    qw8 = QuantizedWeight(c8, 8, 16, s)
    with pytest.raises(ValueError, match="cannot narrow 8-bit codes to 4 bits"):
        qw8.with_form(4, 16, False)
    with pytest.raises(ValueError, match="group 12 does not divide group 16"):
        qw8.with_form(8, 12, False)


def test_with_form_and_common_form_change_no_value(gen):
    a = random_qweight(gen, 32, 96, 4, 32, True)    # Q4_1-like
    b = random_qweight(gen, 16, 96, 8, 16, False)   # Q6_K-like
    for qw in (a, b):
        for form in ((8, 16, True), (8, qw.group_size, False), (qw.bits, 2, True)):
            other = qw.with_form(*form)
            want = (form[0], form[1], form[2] or qw.min is not None)
            assert (other.bits, other.group_size, other.min is not None) == want
            assert torch.equal(other.dequantize(), qw.dequantize())
            assert torch.equal(other.dequantize(torch.float64), qw.dequantize(torch.float64))
    fa, fb = common_form([a, b])
    for f in (fa, fb):  # 8-bit codes (one part has them), the smaller group, a min (one part has it)
        assert (f.bits, f.group_size, f.codes.dtype) == (8, 16, torch.int8)
        assert f.min is not None and f.scale.shape == f.min.shape == (f.shape[0], 6)
    assert torch.equal(fb.min, torch.zeros_like(fb.min))
    assert torch.equal(fa.dequantize(), a.dequantize()) and torch.equal(fb.dequantize(), b.dequantize())
    # 4-bit parts whose common group is even stay 4-bit; an odd common group needs 8-bit codes
    c, d = random_qweight(gen, 16, 96, 4, 32, False), random_qweight(gen, 16, 96, 4, 48, True)
    assert [(f.bits, f.group_size) for f in common_form([c, d])] == [(4, 16), (4, 16)]
    e, f = random_qweight(gen, 16, 18, 4, 6, False), random_qweight(gen, 16, 18, 4, 9, False)
    forms = common_form([e, f])
    assert [(g.bits, g.group_size) for g in forms] == [(8, 3), (8, 3)]
    assert all(torch.equal(g.dequantize(), h.dequantize()) for g, h in zip(forms, (e, f)))


def _rank_layers(make, world: int = 2):
    """make(tp_group) for each rank of a `world`-rank group (test_tensor_parallel's ThreadGroup:
    loading needs only the rank and the size, no collective)."""
    from test_tensor_parallel import ThreadGroup

    shared = ThreadGroup.Shared(world)
    return [make(ThreadGroup(r, world, "cpu", shared)) for r in range(world)]


def _dequantized_layer(layer, parts: dict):
    """The layer's float32 weight as the 16/32-bit loader fills it from the dequantized parts."""
    for shard, qw in parts.items():
        layer.weight_loader(layer.weight, qw.dequantize(), shard)
    return layer.weight.detach().clone()


@pytest.mark.parametrize("kind", ["column", "merged", "qkv", "qkv-replicated-kv", "row"])
def test_load_layer_cuts_what_the_16_bit_loader_cuts(gen, kind):
    from pagedllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                       QKVParallelLinear, RowParallelLinear)

    cpu, f32 = torch.device("cpu"), torch.float32
    hidden = 128
    if kind == "column":
        make = lambda g: ColumnParallelLinear(hidden, 64, False, f32, cpu, g)  # noqa: E731
        parts = {None: random_qweight(gen, 64, hidden, 4, 32, True)}
    elif kind == "merged":
        make = lambda g: MergedColumnParallelLinear(hidden, [64, 64], False, f32, cpu, g)  # noqa: E731
        parts = {0: random_qweight(gen, 64, hidden, 4, 32, True), 1: random_qweight(gen, 64, hidden, 8, 16, False)}
    elif kind.startswith("qkv"):
        kv = 1 if kind == "qkv-replicated-kv" else 2  # one KV head: each rank holds it whole
        make = lambda g: QKVParallelLinear(hidden, 16, 4, kv, False, f32, cpu, g)  # noqa: E731
        parts = {"q": random_qweight(gen, 64, hidden, 4, 32, True),   # Q4_1
                 "k": random_qweight(gen, 16 * kv, hidden, 4, 32, True),
                 "v": random_qweight(gen, 16 * kv, hidden, 8, 16, False)}  # Q6_K, as in a Q4_K_M file
    else:
        make = lambda g: RowParallelLinear(hidden, 32, False, f32, cpu, g)  # noqa: E731
        parts = {None: random_qweight(gen, 32, hidden, 4, 32, True)}
    for quant_layer, plain_layer in zip(_rank_layers(make), _rank_layers(make)):
        qw = load_layer(quant_layer, parts, "test")
        want = _dequantized_layer(plain_layer, parts)
        assert qw.shape == want.shape == (quant_layer.output_size_per_partition, quant_layer.input_size_per_partition)
        assert torch.equal(qw.dequantize(), want)
        assert qw.source == "test"


def test_load_layer_splits_a_group_across_the_ranks_inputs_exactly(gen):
    """Groups of 32 over ranks of 48 inputs: re-expressed in groups of 16 (gcd), the same weights."""
    from pagedllm.model_executor.layers.linear import RowParallelLinear

    make = lambda g: RowParallelLinear(96, 32, False, torch.float32, torch.device("cpu"), g)  # noqa: E731
    qw = random_qweight(gen, 32, 96, 4, 32, True)
    full = qw.dequantize(torch.float64)
    for rank, layer in enumerate(_rank_layers(make)):  # 48 inputs per rank
        part = load_layer(layer, {None: qw}, "GGUF x")
        assert part.group_size == 16
        assert torch.equal(part.dequantize(torch.float64), full[:, 48 * rank:48 * (rank + 1)])
    layer = _rank_layers(make)[0]
    with pytest.raises(ValueError, match=r"GGUF x: .*shape \(32, 64\), expected \(32, 96\)"):
        load_layer(layer, {None: random_qweight(gen, 32, 64, 4, 16, True)}, "GGUF x")


@pytest.mark.parametrize("row_parallel_rank", [None, 0, 1])
def test_woq_linear_method_on_a_layer(gen, row_parallel_rank):
    """set_quant_method(WoqLinearMethod(qw)): the layer computes x @ w^T + bias (the bias only on
    a row-parallel rank 0), its 32-bit weight is dropped and weight_bytes counts the packed form."""
    from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    cpu = torch.device("cpu")
    if row_parallel_rank is None:
        layer = ColumnParallelLinear(64, 48, True, torch.float32, cpu)
    else:
        layer = _rank_layers(lambda g: RowParallelLinear(128, 48, True, torch.float32, cpu, g))[row_parallel_rank]
    layer.bias.data.copy_(torch.randn(48, generator=gen))
    qw = random_qweight(gen, 48, 64, 4, 32, True)
    layer.set_quant_method(WoqLinearMethod(qw))
    assert layer.weight is None
    bias_bytes = 48 * 4 if row_parallel_rank in (None, 0) else 0
    assert WoqLinearMethod.weight_bytes(layer) == 48 * 32 + 2 * 2 * 48 * 4 + bias_bytes  # codes, scale, min, bias
    x = torch.randn(5, 64, generator=gen)
    bias = layer.bias if row_parallel_rank in (None, 0) else None
    y, mag = reference(x, qw, bias)
    out = layer.quant_method.apply(layer, x)
    assert ((out.double() - y).abs() / (mag + 1e-30)).max().item() <= float32_bound(64)


# ---------------------------------------------------------------- GGUF blocks
def _np_rng(gen) -> np.random.Generator:
    return np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))


def _fp16_field(rng, n: int) -> np.ndarray:
    """n valid fp16 values as bytes [n, 2]: normal * 0.01, and zeros, subnormals, negatives."""
    v = (rng.standard_normal(n) * 0.01).astype(np.float16)
    specials = np.array([0.0, -0.0, 6e-8, 3e-6, -6e-8, -0.5, 65504.0 / 1024], dtype=np.float16)
    idx = rng.choice(n, size=min(n, len(specials)), replace=False)
    v[idx] = specials[: len(idx)]
    assert np.isfinite(v).all()
    return v.view(np.uint8).reshape(n, 2)


def random_blocks(rng, type_name: str, rows: int, blocks_per_row: int) -> np.ndarray:
    """uint8 [rows, blocks_per_row * bytes]: random quants with valid fp16 d (and dmin / m)."""
    n = rows * blocks_per_row
    f16 = lambda: _fp16_field(rng, n)  # noqa: E731
    rand = lambda nbytes: rng.integers(0, 256, (n, nbytes), dtype=np.uint8)  # noqa: E731
    layout = {
        "Q8_0": lambda: [f16(), rand(32)],
        "Q4_0": lambda: [f16(), rand(16)],
        "Q4_1": lambda: [f16(), f16(), rand(16)],
        "Q4_K": lambda: [f16(), f16(), rand(12), rand(128)],
        "Q6_K": lambda: [rand(128), rand(64), rand(16), f16()],
    }[type_name]()
    return np.concatenate(layout, axis=1).reshape(rows, -1)


VALUES = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q6_K": 256}


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_decode_gguf_equals_the_gguf_dequantizer_on_random_blocks(gen, type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = _np_rng(gen)
    for rows, blocks in ((1, 1), (5, 3), (16, 2)):
        data = random_blocks(rng, type_name, rows, blocks)
        k = blocks * VALUES[type_name]
        qw = decode_gguf(type_name, data, k)
        want = dequantize(data, GGMLQuantizationType[type_name])
        assert want.dtype == np.float32 and want.shape == (rows, k)
        got = qw.dequantize().numpy()
        assert np.array_equal(got, want), np.abs(got - want).max()
        assert qw.shape == (rows, k) and qw.source == type_name
        assert (qw.bits, qw.group_size, qw.min is not None) == {
            "Q8_0": (8, 32, False), "Q4_0": (4, 32, True), "Q4_1": (4, 32, True),
            "Q4_K": (4, 32, True), "Q6_K": (8, 16, False)}[type_name]
        if qw.bits == 4:
            assert int(qw.codes.max()) <= 15
        # the kernel computes with it: within float32 sums of the gguf dequantized weight
        if rows % 16 == 0:
            packed, scale_t, min_t = pack(qw)
            x = torch.randn(3, k, generator=gen)
            y, mag = reference(x, qw, None)
            out = ops.woq_linear(x, packed, qw.bits, scale_t, min_t)
            assert ((out.double() - y).abs() / (mag + 1e-30)).max().item() <= float32_bound(k)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_decode_gguf_equals_the_gguf_dequantizer_on_quantized_weights(gen, type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = (torch.randn(24, 128, generator=gen, dtype=torch.float64) * 0.05).float().numpy()
    w[2] = 0.0
    w[3] = np.abs(w[3])  # one-signed rows
    w[4] = -np.abs(w[4])
    data = quantize(w, GGMLQuantizationType[type_name])
    got = decode_gguf(type_name, data, 128).dequantize().numpy()
    assert np.array_equal(got, dequantize(data, GGMLQuantizationType[type_name]))
    assert np.abs(got - w).max() < 0.05  # and it is the weight (to the format's step)


def test_decode_gguf_errors():
    with pytest.raises(ValueError, match=r"GGUF type Q5_K is not computed natively: supported \['Q8_0', 'Q4_0', "
                                         r"'Q4_1', 'Q4_K', 'Q6_K'\]"):
        decode_gguf("Q5_K", np.zeros((2, 176), dtype=np.uint8), 256)
    assert SUPPORTED_GGUF_TYPES == ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
    with pytest.raises(ValueError, match="2 rows x 64 values: 70 bytes is not whole blocks of 32 values / 34 bytes"):
        decode_gguf("Q8_0", np.zeros((2, 35), dtype=np.uint8), 64)
    with pytest.raises(ValueError, match="not whole blocks of 256 values / 144 bytes"):
        decode_gguf("Q4_K", np.zeros((2, 144), dtype=np.uint8), 128)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (q with n_head, k with n_head_kv)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim", [(4, 16), (3, 64), (1, 32)])
def test_unpermute_rows_undoes_the_converters_permutation(gen, n_head, head_dim):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    q8 = GGMLQuantizationType.Q8_0
    hf = (torch.randn(n_head * head_dim, 64, generator=gen) * 0.1).numpy()
    permuted = _llama_cpp_permute(hf, n_head)
    assert not np.array_equal(permuted, hf)
    got = unpermute_rows(decode_gguf("Q8_0", quantize(permuted, q8), 64), n_head)
    want = decode_gguf("Q8_0", quantize(hf, q8), 64)
    assert torch.equal(got.dequantize(), want.dequantize())
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)


# ---------------------------------------------------------------- online int4
@pytest.mark.parametrize("k,group", [(256, 128), (384, 128), (192, 64), (96, 32), (80, 80)])
def test_quantize_int4_round_to_nearest_with_exact_zero(gen, k, group):
    w = torch.randn(32, k, generator=gen) * torch.linspace(0.01, 2, 32)[:, None]
    w[0] = 0                       # an all-zero row
    w[1] = w[1].abs()              # one-signed rows: the grid still holds 0
    w[2] = -w[2].abs()
    w[3, ::3] = 0                  # zeros among other values
    qw = quantize_int4(w)
    assert qw.group_size == group and qw.bits == 4 and qw.codes.dtype == torch.uint8 and qw.source == "int4"
    assert GROUP_SIZE == 128
    assert int(qw.codes.max()) <= 15
    deq = qw.dequantize()
    assert (deq[w == 0] == 0).all()  # 0 maps exactly to 0
    step = qw.scale.repeat_interleave(group, dim=1)
    assert ((deq - w).abs() <= step / 2 * (1 + 1e-5) + 1e-7 * w.abs()).all()  # half a step, float32 slack
    assert torch.equal(qw.scale[0], torch.ones(k // group)) and (deq[0] == 0).all()
    # the grid's ends: each group's max and min are reached within half a step (15 steps span them)
    g = w.view(32, -1, group)
    assert torch.allclose(qw.scale[4:], (g.amax(-1).clamp(min=0) - g.amin(-1).clamp(max=0))[4:] / 15)


# ---- W4A8 / W8A8 on AVX-512 VNNI (bfloat16 models) ---------------------------------------------

needs_vnni = pytest.mark.skipif(not ops.woq_vnni_available(), reason="this build has no AVX-512 VNNI")


def reference_a8(x: torch.Tensor, qw: QuantizedWeight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 of woq_vnni_linear's formula: x quantized per token and weight group to int8 (s =
    max |x_g| / 127, 1 for a zero group, round half to even), exact group dot products, times
    scale * s; plus min times the float sums of x; plus bias — and its magnitude bound)."""
    n, k = qw.shape
    m, g = x.shape[0], qw.group_size
    xf = x.float().view(m, k // g, g)
    s = xf.abs().amax(-1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(xf / s[..., None]).clamp(-127, 127).double()
    c = qw.codes.double().view(n, k // g, g)
    dots = torch.einsum("mgk,ngk->mng", q, c)
    terms = dots * (qw.scale.double()[None] * s.double()[:, None, :])
    mag = (torch.einsum("mgk,ngk->mng", q.abs(), c.abs()) * (qw.scale.double().abs()[None] * s.double()[:, None, :]))
    y, bound = terms.sum(-1), mag.sum(-1)
    if qw.min is not None:
        xs = xf.sum(-1).double()  # the kernel's float32 sums, in order: their own rounding is in the bound
        y = y + (qw.min.double()[None] * xs[:, None, :]).sum(-1)
        bound = bound + (qw.min.double().abs()[None] * xf.abs().sum(-1).double()[:, None, :]).sum(-1)
    if bias is not None:
        y, bound = y + bias.double(), bound + bias.double().abs()
    return y, bound


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,k,with_min", [(32, 96, True), (16, 64, False), (128, 256, True), (4, 40, True),
                                              (576, 576, False)])
@pytest.mark.parametrize("m", [1, 7, 9, 33])
def test_woq_vnni_linear_matches_a_float64_reference_of_its_formula(gen, bits, group, k, with_min, m):
    qw = random_qweight(gen, 48, k, bits, group, with_min)
    bias = torch.randn(48, generator=gen)
    packed = ops.woq_vnni_pack_weight(qw.codes, qw.bits)
    st, mt = qw.scale.t().contiguous(), None if qw.min is None else qw.min.t().contiguous()
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
        x[0, : min(group, k)] = 0  # a zero group: scale 1, codes 0
        for b in (None, bias):
            y = ops.woq_vnni_linear(x, packed, bits, st, mt, b, out_dtype=torch.float32)
            ref, bound = reference_a8(x, qw, b)
            assert ((y.double() - ref).abs() <= (k + 8) * U * bound + 1e-30).all(), (bits, group, m, dtype)
            y16 = ops.woq_vnni_linear(x, packed, bits, st, mt, b)
            assert y16.dtype == dtype
            assert torch.equal(y16, y.to(dtype))  # one rounding of the float32 result


@needs_vnni
def test_woq_vnni_linear_is_close_to_the_float_product_and_propagates_nan(gen):
    """The activation rounding is the only approximation: within ~1% of the float product here; a
    NaN in a group makes its row NaN."""
    qw = random_qweight(gen, 32, 128, 4, 32, True)
    x = torch.randn(5, 128, generator=gen)
    y = ops.woq_vnni_linear(x, ops.woq_vnni_pack_weight(qw.codes, 4), 4, qw.scale.t().contiguous(),
                            qw.min.t().contiguous())
    full = x.double() @ qw.dequantize(torch.float64).t()
    assert (y.double() - full).abs().max() < 0.02 * full.abs().max()
    x[2, 40] = float("nan")
    x[4, 3] = float("inf")  # an infinity: the row is NaN too (not a finite or wrongly signed value)
    y = ops.woq_vnni_linear(x, ops.woq_vnni_pack_weight(qw.codes, 4), 4, qw.scale.t().contiguous(),
                            qw.min.t().contiguous())
    assert torch.isnan(y[2]).all() and torch.isnan(y[4]).all() and not torch.isnan(y[[0, 1, 3]]).any()
    # the scalar quantizer (groups not a multiple of 16) agrees
    qw4 = random_qweight(gen, 32, 40, 8, 4, False)
    x4 = torch.randn(3, 40, generator=gen)
    x4[1, 7] = -float("inf")
    y4 = ops.woq_vnni_linear(x4, ops.woq_vnni_pack_weight(qw4.codes, 8), 8, qw4.scale.t().contiguous(), None)
    assert torch.isnan(y4[1]).all() and not torch.isnan(y4[[0, 2]]).any()


@needs_vnni
def test_woq_vnni_errors_name_the_bad_value(gen):
    qw = random_qweight(gen, 32, 64, 4, 32, False)
    packed = ops.woq_vnni_pack_weight(qw.codes, 4)
    with pytest.raises(ValueError, match=r"K a multiple of 4"):
        ops.woq_vnni_pack_weight(torch.zeros(16, 6, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match=r"4-bit codes must be in \[0, 15\], got 16"):
        ops.woq_vnni_pack_weight(torch.full((16, 8), 16, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match=r"groups of a multiple of 4 inputs"):
        ops.woq_vnni_linear(torch.randn(2, 64), packed, 4, torch.ones(32, 32), None)  # groups of 2
    with pytest.raises(ValueError, match=r"packed's last dimension must be 64 for 8 bits"):
        ops.woq_vnni_linear(torch.randn(2, 64), packed, 8, qw.scale.t().contiguous(), None)
    with pytest.raises(ValueError, match=r"x must be bfloat16 or float32, got int32"):
        ops.woq_vnni_linear(torch.zeros(2, 64, dtype=torch.int32), packed, 4, qw.scale.t().contiguous(), None)


def test_woq_linear_method_picks_the_vnni_kernel_for_bfloat16_only(gen, monkeypatch):
    from pagedllm.model_executor.layers.linear import ColumnParallelLinear

    for dtype, env in ((torch.float32, "1"), (torch.bfloat16, "1"), (torch.bfloat16, "0")):
        monkeypatch.setenv("PAGEDLLM_WOQ_VNNI", env)
        layer = ColumnParallelLinear(64, 32, False, dtype, torch.device("cpu"))
        method = WoqLinearMethod(random_qweight(gen, 32, 64, 4, 32, True))
        layer.set_quant_method(method)
        assert method.vnni == (dtype == torch.bfloat16 and env == "1" and ops.woq_vnni_available())
        qw = random_qweight(gen, 32, 64, 4, 32, True)
        layer = ColumnParallelLinear(64, 32, False, dtype, torch.device("cpu"))
        layer.set_quant_method(WoqLinearMethod(qw))
        x = torch.randn(3, 64, generator=gen).to(dtype)
        ref, bound = (reference_a8 if method.vnni else reference)(x, qw, None)
        tol = (64 + 8) * U * bound + (bound * 2.0**-8 if dtype == torch.bfloat16 else 0)  # + the bf16 output rounding
        assert ((layer(x).double() - ref).abs() <= tol).all()


def test_woq_method_for_picks_the_device_kernel_and_names_what_cuda_lacks(gen):
    """CPU layers: WoqLinearMethod; CUDA layers: tinygemm for 4-bit codes in groups of 32-256, a
    ValueError naming the form otherwise (checked on a stand-in whose weight says cuda: no GPU needed)."""
    from pagedllm.model_executor.layers.linear import ColumnParallelLinear
    from pagedllm.model_executor.quantization.woq_cuda import TinyGemmInt4LinearMethod, woq_method_for

    cpu_layer = ColumnParallelLinear(64, 32, False, torch.bfloat16, torch.device("cpu"))
    assert isinstance(woq_method_for(cpu_layer, random_qweight(gen, 32, 64, 8, 16, False), "x"), WoqLinearMethod)

    cuda_like = type("L", (), {"weight": type("W", (), {"device": torch.device("cuda")})()})()
    assert isinstance(woq_method_for(cuda_like, random_qweight(gen, 32, 64, 4, 32, True), "x"),
                      TinyGemmInt4LinearMethod)
    with pytest.raises(ValueError, match=r"GGUF y: 8-bit weights in groups of 16 \(\(32, 64\)\) run on the CPU only"):
        woq_method_for(cuda_like, random_qweight(gen, 32, 64, 8, 16, False), "GGUF y")
