"""pagedllm.ops.amx_linear (the CPU projections in bfloat16 with Intel AMX) against a float64
reference on fresh random inputs, its fused variants (amx_linear_silu_mul, amx_linear_argmax)
against the two unfused ops bit for bit and against float64, and their argument errors."""

from __future__ import annotations


import pytest
import torch

import pagedllm.ops as ops

pytestmark = pytest.mark.skipif(not ops.amx_linear_supported(),
                                reason="this CPU/OS has no AMX-BF16 (the model falls back to oneDNN)")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def check_close(out: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    # one bfloat16 rounding of the result (2^-8 relative) plus float32 accumulation over k terms
    tol = ref.abs() * 2.0**-8 + 1e-5 * k ** 0.5
    err = (out.double() - ref).abs()
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert (err <= tol).all(), f"max error {err.max().item():.3g} at {divmod(int(err.argmax()), ref.shape[1])}"


@pytest.mark.parametrize("m", [1, 5, 16, 17, 31, 32, 33, 64, 100, 257, 300])
@pytest.mark.parametrize("k,n", [(32, 32), (576, 960), (96, 64), (1536, 576)])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_amx_linear_matches_float64(m, k, n, bias_dtype, gen):
    x = torch.randn(m, k, generator=gen).bfloat16()
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype)
    packed = ops.amx_pack_linear_weight(weight)
    assert tuple(packed.shape) == (n // 32, k // 32, 2, 16, 32)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert ops.amx_linear(x, packed, bias, out=out) is out
    check_close(out, reference(x, weight, bias), k)


@pytest.mark.parametrize("m,n,offset", [(1, 64, 0), (17, 960, 0), (64, 2048, 0), (33, 96, 1), (5, 64, 16)])
def test_amx_linear_float32_out_is_the_bfloat16_result_widened(m, n, offset, gen):
    """out float32 (the LM head's logits) holds exactly .float() of the bfloat16 out, whether its
    rows are 64-byte aligned (streaming stores) or not (offset floats into a larger buffer)."""
    k = 192
    x = torch.randn(m, k, generator=gen).bfloat16()
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    bias = torch.randn(n, generator=gen)
    packed = ops.amx_pack_linear_weight(weight)
    ref = ops.amx_linear(x, packed, bias)
    buf = torch.full((m * n + offset,), float("nan"))
    out = buf[offset:].view(m, n)
    assert ops.amx_linear(x, packed, bias, out=out) is out
    assert torch.equal(out, ref.float())
    check_close(ref, reference(x, weight, bias), k)


def test_amx_linear_strided_rows_and_f_linear(gen):
    """x and out with a row stride larger than their width; the result within one rounding of
    torch.nn.functional.linear in bfloat16 (which rounds the same float32 sums)."""
    m, k, n = 40, 128, 96
    wide_x = torch.randn(m, k + 40, generator=gen).bfloat16()
    x = wide_x[:, 8:8 + k]
    weight = (torch.randn(n, k, generator=gen) / 8).bfloat16()
    wide_out = torch.full((m, n + 64), float("nan"), dtype=torch.bfloat16)
    out = wide_out[:, 32:32 + n]
    ops.amx_linear(x, ops.amx_pack_linear_weight(weight), out=out)
    check_close(out, reference(x, weight, None), k)
    assert torch.isnan(wide_out[:, :32].float()).all() and torch.isnan(wide_out[:, 32 + n:].float()).all()
    torch_out = torch.nn.functional.linear(x, weight)
    assert ((out.float() - torch_out.float()).abs() <= torch_out.float().abs() * 2.0**-7 + 1e-3).all()


def test_amx_linear_empty_batch(gen):
    weight = torch.randn(64, 64, generator=gen).bfloat16()
    out = ops.amx_linear(torch.empty(0, 64, dtype=torch.bfloat16), ops.amx_pack_linear_weight(weight))
    assert out.shape == (0, 64)


@pytest.mark.parametrize("shape", [(48, 64), (64, 40), (0, 64)])
def test_pack_rejects_shapes_not_multiple_of_32(shape):
    with pytest.raises(ValueError, match=r"multiples of 32"):
        ops.amx_pack_linear_weight(torch.zeros(shape, dtype=torch.bfloat16))


def test_amx_linear_argument_errors(gen):
    weight = torch.randn(64, 96, generator=gen).bfloat16()
    packed = ops.amx_pack_linear_weight(weight)
    x = torch.randn(3, 96, generator=gen).bfloat16()
    with pytest.raises(ValueError, match=r"amx_pack_linear_weight: weight .*float32"):
        ops.amx_pack_linear_weight(weight.float())
    with pytest.raises(ValueError, match=r"amx_linear: x .*float32"):
        ops.amx_linear(x.float(), packed)
    with pytest.raises(ValueError, match=r"amx_linear: out must be bfloat16 or float32, got float16"):
        ops.amx_linear(x, packed, out=torch.empty(3, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"amx_linear: x .*dimension 1.*64.*96|amx_linear: x .*in_features"):
        ops.amx_linear(torch.randn(3, 64).bfloat16(), packed)
    with pytest.raises(ValueError, match=r"amx_linear: out .*num_tokens"):
        ops.amx_linear(x, packed, out=torch.empty(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"amx_linear: bias must be .*\[64\]"):
        ops.amx_linear(x, packed, torch.zeros(63))
    with pytest.raises(ValueError, match=r"amx_linear: x must have a contiguous last dimension"):
        ops.amx_linear(torch.randn(96, 3).bfloat16().T, packed)
    with pytest.raises(ValueError, match=r"amx_linear: out must not overlap x"):
        square = ops.amx_pack_linear_weight(torch.randn(96, 96, generator=gen).bfloat16())
        ops.amx_linear(x, square, out=x)
    with pytest.raises(ValueError, match=r"amx_linear: x must be a 2-D tensor"):
        ops.amx_linear(torch.randn(96).bfloat16(), packed)
    with pytest.raises(ValueError, match=r"amx_linear: packed must be a 5-D tensor"):
        ops.amx_linear(x, weight)
    with pytest.raises(ValueError, match=r"amx_linear: packed must have shape .*N, K > 0"):
        ops.amx_linear(x, torch.empty(0, 3, 2, 16, 32, dtype=torch.bfloat16), out=torch.empty(3, 0, dtype=torch.bfloat16))


@pytest.mark.parametrize("m", [1, 5, 17, 33, 64, 100, 257])
@pytest.mark.parametrize("k,inter", [(64, 32), (576, 1536), (96, 96)])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_amx_linear_silu_mul_is_linear_then_silu_and_mul(m, k, inter, bias_dtype, gen):
    """The fused gate_up + SiLU-and-mul gives the bits of amx_linear followed by silu_and_mul (HF's
    LlamaMLP in bfloat16: silu of the rounded gate, rounded, times the rounded up), and is within
    those roundings of float64."""
    x = (torch.randn(m, k, generator=gen) * 2).bfloat16()
    weight = (torch.randn(2 * inter, k, generator=gen) / k ** 0.5).bfloat16()
    bias = None if bias_dtype is None else torch.randn(2 * inter, generator=gen).to(bias_dtype)
    packed = ops.amx_pack_linear_weight(weight)
    out = torch.full((m, inter), float("nan"), dtype=torch.bfloat16)
    assert ops.amx_linear_silu_mul(x, packed, bias, out=out) is out
    unfused = ops.silu_and_mul(torch.empty(m, inter, dtype=torch.bfloat16), ops.amx_linear(x, packed, bias))
    assert torch.equal(out, unfused)
    gate_up = reference(x, weight, bias)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    ref = torch.nn.functional.silu(gate) * up
    # three bfloat16 roundings of ~2^-8 each (gate, up, silu) and the output's own
    tol = (gate.abs() + 1) * (up.abs() + 1) * 2.0**-6 + 1e-5 * k ** 0.5
    err = (out.double() - ref).abs()
    assert (err <= tol).all(), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("n,vocab", [(64, 0), (960, 950), (2048, 2048), (96, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_argmax_is_linear_then_argmax_rows(m, n, vocab, with_bias, gen):
    """The fused LM head + greedy argmax picks the ids argmax_rows picks on amx_linear's float32
    logits (columns beyond vocab ignored), and each id's float64 logit is within one bfloat16
    rounding of the row's float64 maximum."""
    k = 192
    x = torch.randn(m, k, generator=gen).bfloat16()
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    bias = torch.randn(n, generator=gen) if with_bias else None
    packed = ops.amx_pack_linear_weight(weight)
    out = torch.full((m,), -1, dtype=torch.int64)
    assert ops.amx_linear_argmax(x, packed, vocab, bias, out=out) is out
    logits = ops.amx_linear(x, packed, bias, out=torch.empty(m, n))
    assert torch.equal(out, ops.argmax_rows(logits, vocab))
    ref = reference(x, weight, bias)[:, : vocab or n]
    picked = ref.gather(1, out[:, None])[:, 0]
    assert (picked >= ref.max(dim=1).values - ref.abs().max(dim=1).values * 2.0**-7 - 1e-6).all()
    assert ((out >= 0) & (out < (vocab or n))).all()


def test_amx_linear_argmax_ties_infinities_and_nan(gen):
    """Ties go to the smallest column (duplicated weight rows give equal logits in three pair-blocks
    far apart, usually claimed by different threads); a row with nothing above -inf gives its first
    -inf column; a row of NaN only gives 0; columns beyond vocab never count — as argmax_rows."""
    m, k, n = 40, 64, 4096
    x = torch.randn(m, k, generator=gen).bfloat16()
    weight = (torch.randn(n, k, generator=gen) / 8).bfloat16()
    weight[700] = weight[1234] = weight[n - 5] = weight[3000] * 8  # three equal columns, often the largest
    packed = ops.amx_pack_linear_weight(weight)
    ids = ops.amx_linear_argmax(x, packed)
    assert torch.equal(ids, ops.argmax_rows(ops.amx_linear(x, packed, out=torch.empty(m, n))))
    assert (ids == 700).any()  # the tie happened (P(no row) ~ 1e-7) ...
    assert not ((ids == 1234) | (ids == n - 5)).any()  # ... and always went to the first twin
    bias = torch.full((n,), float("nan"))
    bias[17:] = float("-inf")
    assert torch.equal(ops.amx_linear_argmax(x, packed, 0, bias), torch.full((m,), 17))
    assert torch.equal(ops.amx_linear_argmax(x, packed, 0, torch.full((n,), float("nan"))), torch.zeros(m, dtype=torch.int64))
    # columns beyond vocab never count, even where they are the only finite values
    bias[2000:] = 1e4
    for vocab in (2000, 500):
        logits = ops.amx_linear(x, packed, bias, out=torch.empty(m, n))
        assert torch.equal(ops.amx_linear_argmax(x, packed, vocab, bias), torch.full((m,), 17))
        assert torch.equal(ops.argmax_rows(logits, vocab), torch.full((m,), 17))


def test_fused_amx_linear_argument_errors(gen):
    packed_odd = ops.amx_pack_linear_weight(torch.randn(96, 64, generator=gen).bfloat16())
    packed = ops.amx_pack_linear_weight(torch.randn(128, 64, generator=gen).bfloat16())
    x = torch.randn(3, 64, generator=gen).bfloat16()
    with pytest.raises(ValueError, match=r"amx_linear_silu_mul: packed must hold the gate and up .*even number"):
        ops.amx_linear_silu_mul(x, packed_odd)
    with pytest.raises(ValueError, match=r"amx_linear_silu_mul: out .*intermediate_size"):
        ops.amx_linear_silu_mul(x, packed, out=torch.empty(3, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"amx_linear_silu_mul: out .*float32"):
        ops.amx_linear_silu_mul(x, packed, out=torch.empty(3, 64))
    with pytest.raises(ValueError, match=r"amx_linear_silu_mul: bias must be .*\[128\]"):
        ops.amx_linear_silu_mul(x, packed, torch.zeros(64))
    with pytest.raises(ValueError, match=r"amx_linear_argmax: vocab = 129 must be in \[1, 128\]"):
        ops.amx_linear_argmax(x, packed, 129)
    with pytest.raises(ValueError, match=r"amx_linear_argmax: out .*int32"):
        ops.amx_linear_argmax(x, packed, out=torch.empty(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"amx_linear_argmax: out .*num_tokens"):
        ops.amx_linear_argmax(x, packed, out=torch.empty(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"amx_linear_argmax: x .*float32"):
        ops.amx_linear_argmax(x.float(), packed)
