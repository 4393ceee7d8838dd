"""The CPU int8 projection (pagedllm.ops.int8_linear, W8A8 with activation scales per token and
per group of 64-256 inputs) against a float64 reference on fresh random inputs: the same quantization of x (round half
to even of x / s_x in float32), the exact integer sums per group, then the scales — within float32
rounding of the sum over groups.
Shapes with tails (one 16-column block in the last unit, row counts that are not multiples of 8,
K = 4), strided x rows, bias (float32 / bfloat16), float32 and bfloat16 x and out, zero rows, and
the argument errors. Also the weight quantization itself (per-channel round to nearest)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import ops


def reference(x: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 [M, N] of the module docstring's formula, float64 [M, N] bound of the float32
    rounding: the sum of the groups' magnitudes)."""
    M, K = x.shape
    group = ops.int8_activation_group(K)
    xf = x.float().view(M, K // group, group)
    s = xf.abs().amax(-1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))  # [M, G]
    q = torch.round(xf / s[:, :, None]).clamp(-127, 127).double()  # [M, G, group]
    c = codes.double().view(codes.shape[0], K // group, group)  # [N, G, group]
    per_group = torch.einsum("mgk,ngk->mng", q, c) * s.double()[:, None, :]  # exact ints times scales
    y = per_group.sum(-1) * w_scale.double()[None, :]
    mag = per_group.abs().sum(-1) * w_scale.double()[None, :]
    if bias is not None:
        y = y + bias.double()[None, :]
        mag = mag + bias.double().abs()[None, :]
    return y, mag


def rel_err(got: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The largest error relative to the magnitudes summed (float32 sums over groups)."""
    y, mag = ref
    return ((got.double() - y).abs() / (mag + 1e-30)).max().item()


@pytest.mark.parametrize("shape", [(1, 16, 4), (1, 64, 36), (7, 48, 128), (8, 32, 64), (13, 576, 576),
                                   (64, 1536, 576), (130, 80, 256), (5, 32, 1000), (3, 32, 320)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x32", "xbf16"])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16], ids=["nobias", "b32", "bbf16"])
def test_int8_linear_matches_float64_reference(gen, shape, x_dtype, bias_dtype):
    M, N, K = shape
    w = torch.randn(N, K, generator=gen, dtype=torch.float64).float()
    codes, w_scale = ops.int8_quantize_weight(w)
    packed, comp = ops.int8_pack_linear_weight(codes)
    x = (torch.randn(M, K + 7, generator=gen) * 3)[:, 3:3 + K].to(x_dtype)  # strided rows
    if M > 2:
        x[1] = 0  # a zero row: scale 1, codes 0
    bias = None if bias_dtype is None else torch.randn(N, generator=gen).to(bias_dtype)
    ref = reference(x, codes, w_scale, bias)
    out32 = ops.int8_linear(x, packed, comp, w_scale, bias, out_dtype=torch.float32)
    assert rel_err(out32, ref) < 1e-6  # float32 sums over groups of exact integer sums
    out16 = ops.int8_linear(x, packed, comp, w_scale, bias, out_dtype=torch.bfloat16)
    assert torch.equal(out16, out32.to(torch.bfloat16))  # one rounding of the same float32 values


@pytest.mark.parametrize("K", [68, 192, 576], ids=lambda k: f"k{k}")  # one group of 68 (scalar quantization), 192, 3 x 192
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x32", "xbf16"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["o32", "obf16"])
def test_portable_loop_gives_the_vnni_kernel_bits(gen, monkeypatch, K, x_dtype, out_dtype):
    """PAGEDLLM_INT8_PORTABLE=1 runs the portable loops (what a build without AVX-512 VNNI runs:
    scalar quantization of x, sums and epilogue): the same bits as the vector paths."""
    if not ops.int8_linear_vnni():
        pytest.skip("this build has no AVX-512 VNNI path to compare the portable loop with")
    codes, w_scale = ops.int8_quantize_weight(torch.randn(48, K, generator=gen))
    packed, comp = ops.int8_pack_linear_weight(codes)
    x = (torch.randn(11, K, generator=gen) * 4).to(x_dtype)
    x[3] = 0
    bias = torch.randn(48, generator=gen)
    fast = ops.int8_linear(x, packed, comp, w_scale, bias, out_dtype=out_dtype)
    monkeypatch.setenv("PAGEDLLM_INT8_PORTABLE", "1")
    slow = ops.int8_linear(x, packed, comp, w_scale, bias, out_dtype=out_dtype)
    assert torch.equal(fast, slow)
    if out_dtype == torch.float32:
        assert rel_err(slow, reference(x, codes, w_scale, bias)) < 1e-6


def test_weight_quantization_is_per_channel_round_to_nearest(gen):
    w = torch.randn(32, 20, generator=gen) * torch.linspace(0.1, 5, 32)[:, None]
    w[3] = 0
    codes, scale = ops.int8_quantize_weight(w)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale[3] == 1 and (codes[3] == 0).all()
    rows = [r for r in range(32) if r != 3]
    assert torch.allclose(scale[rows], w[rows].abs().amax(1) / 127)
    assert (codes[rows].abs().amax(1) == 127).all()  # each row's largest magnitude maps to 127
    err = (codes.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()  # round to nearest: at most half a step


def test_packed_layout_and_compensation(gen):
    codes = torch.randint(-127, 128, (32, 8), generator=gen, dtype=torch.int8)
    packed, comp = ops.int8_pack_linear_weight(codes)
    assert packed.shape == (2, 2, 16, 4)
    for nb in range(2):
        for g in range(2):
            assert torch.equal(packed[nb, g], codes[16 * nb:16 * nb + 16, 4 * g:4 * g + 4])
    assert torch.equal(comp, 128 * codes.int().sum(1)[None, :])  # K = 8: one activation group
    codes = torch.randint(-127, 128, (16, 192), generator=gen, dtype=torch.int8)
    _, comp = ops.int8_pack_linear_weight(codes)  # K = 192: one group of 192
    assert torch.equal(comp, 128 * codes.int().sum(1)[None, :])
    codes = torch.randint(-127, 128, (16, 320), generator=gen, dtype=torch.int8)
    _, comp = ops.int8_pack_linear_weight(codes)  # K = 320: five groups of 64
    assert ops.int8_activation_group(320) == 64
    assert torch.equal(comp, 128 * codes.int().view(16, 5, 64).sum(-1).T)


def test_argument_errors_name_the_value():
    codes = torch.zeros(32, 8, dtype=torch.int8)
    packed, comp = ops.int8_pack_linear_weight(codes)
    scale = torch.ones(32)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.int8_pack_linear_weight(torch.zeros(20, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="int8"):
        ops.int8_pack_linear_weight(torch.zeros(32, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="in_features, must match packed"):
        ops.int8_linear(torch.zeros(2, 12), packed, comp, scale)
    with pytest.raises(ValueError, match="x must be bfloat16 or float32"):
        ops.int8_linear(torch.zeros(2, 8, dtype=torch.float16), packed, comp, scale, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="w_scale"):
        ops.int8_linear(torch.zeros(2, 8), packed, comp, torch.ones(16))
    with pytest.raises(ValueError, match="bias"):
        ops.int8_linear(torch.zeros(2, 8), packed, comp, scale, torch.ones(31))
    assert ops.int8_linear(torch.zeros(0, 8), packed, comp, scale).shape == (0, 32)


@pytest.mark.parametrize("where", [0, 5, 100, 255], ids=lambda w: f"at{w}")
def test_nan_makes_its_row_nan_on_both_paths(gen, monkeypatch, where):
    """A NaN anywhere in an activation group makes every output of its row NaN (as a float product
    would), the other rows untouched, and the portable loop agrees bit for bit."""
    codes, w_scale = ops.int8_quantize_weight(torch.randn(32, 256, generator=gen))
    packed, comp = ops.int8_pack_linear_weight(codes)
    x = torch.randn(3, 256, generator=gen)
    x[1, where] = float("nan")
    outs = []
    for portable in ("0", "1"):
        monkeypatch.setenv("PAGEDLLM_INT8_PORTABLE", portable)
        outs.append(ops.int8_linear(x, packed, comp, w_scale, out_dtype=torch.bfloat16))
    for out in outs:
        assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    ref = reference(x[[0, 2]], codes, w_scale, None)
    assert rel_err(outs[0][[0, 2]].float(), ref) < 2.0**-8  # the finite rows: one bf16 rounding


def test_whole_row_groups_above_65536_inputs_are_refused():
    with pytest.raises(ValueError, match="in_features=65540 has no activation group"):
        ops.int8_pack_linear_weight(torch.zeros(16, 65540, dtype=torch.int8))
