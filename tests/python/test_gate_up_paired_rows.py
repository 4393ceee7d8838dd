"""The paired gate/up order of a fused gate_up projection (layer_ops.h's gate_up_paired_row,
ops.gate_up_paired_order): every 16-row tile holds 8 gate rows and their 8 up rows, so the GEMV
writes SiLU(gate) * up from its own rows (ops.gemv(silu_paired_rows=True): no silu_and_mul kernel).

- the order itself (everywhere): a permutation with gate row j and up row j 8 rows apart in one
  16-row tile; bad sizes refused;
- the GEMV's SiLU-and-mul epilogue on the permuted weight against gemv on the original weight +
  silu_and_mul, bit for bit, and against a float64 reference; every tile config, a cluster K
  split, the RMSNorm prologue, bias; inside a CUDA graph with and without PDL;
  silu_and_mul(paired_rows=True) on the permuted product equal to silu_and_mul on the original;
- argument errors (odd sizes, a wrong out, refused combinations, the CPU);
- the Llama model after pair_gate_up_rows(): prefill and decode logits bit for bit those of the
  model before, with and without paired rotary rows and at GEMV fusion level 1; the weights back
  to the original after unpairing; load_weights on a paired model keeps the order (CPU, pairing
  enabled by hand).
"""

from __future__ import annotations

import pytest
import torch

import pagedllm.ops as ops
from pagedllm import _C

from graph_capture import capture_graph
from test_gemv import DTYPES, _bits, _rope_case, dtype_id, needs_cuda, rand
from test_rope_paired_rows import _tiny_llama
from tiny_models import PagedHarness


@pytest.mark.parametrize("inter", [8, 16, 24, 1024, 14336])
def test_paired_order_puts_gate_and_up_in_one_lane(inter):
    order = ops.gate_up_paired_order(inter)
    assert sorted(order.tolist()) == list(range(2 * inter))  # a permutation
    row = {int(src): r for r, src in enumerate(order.tolist())}
    for j in range(0, inter, max(1, inter // 64)):
        assert row[j] == 16 * (j // 8) + j % 8 and row[j] % 16 < 8  # gate j: row g of its tile
        assert row[inter + j] == row[j] + 8  # up j: row g + 8 of the same tile
        assert _C.gate_up_paired_row(row[j], inter) == j


@pytest.mark.parametrize("inter", [0, -8, 4, 12, 100])
def test_paired_order_refuses_bad_sizes(inter):
    with pytest.raises(ValueError, match=f"multiple of 8, got {inter}"):
        ops.gate_up_paired_order(inter)
    with pytest.raises(ValueError, match="intermediate must be a positive multiple of 8"):
        _C.gate_up_paired_row(0, inter)
    with pytest.raises(ValueError, match=r"row must be in \[0, 32\), got 32"):
        _C.gate_up_paired_row(32, 16)


def test_silu_and_mul_paired_rows_is_cuda_only():
    with pytest.raises(ValueError, match="paired_rows .* is CUDA only; input is on cpu"):
        ops.silu_and_mul(torch.empty(2, 16), torch.empty(2, 32), paired_rows=True)


def _silu_mul_float64(gate_up, inter):
    g, u = gate_up.double().split([inter, inter], dim=-1)
    return g / (1 + torch.exp(-g)) * u


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("shape", [(2048, 512, False), (1024, 4096, True), (24, 200, True)],
                         ids=lambda s: f"i{s[0]}-k{s[1]}" + ("-bias" if s[2] else ""))
@pytest.mark.parametrize("cfg", [{}, {"variant": 2}, {"variant": 3, "warps": 4}, {"splits": 2}],
                         ids=["auto", "rows32", "v3w4", "split2"])
@pytest.mark.parametrize("norm", [False, True], ids=["x", "rmsnorm"])
def test_silu_epilogue_equals_gemv_then_silu_and_mul(gen, dtype, m, shape, cfg, norm):
    inter, k, bias = shape
    x = rand((m, k), dtype, gen)
    w = rand((2 * inter, k), dtype, gen, scale=k**-0.5)
    b = rand((2 * inter,), dtype, gen) if bias else None
    pro = {"norm_weight": rand((k,), dtype, gen), "eps": 1e-5} if norm else {}
    ref_gate_up = ops.gemv(x, w, b, config=cfg, **pro)
    ref = ops.silu_and_mul(torch.empty((m, inter), dtype=dtype, device="cuda"), ref_gate_up)

    order = ops.gate_up_paired_order(inter).cuda()
    wp, bp = w.index_select(0, order), None if b is None else b.index_select(0, order)
    out = torch.full((m, inter), float("nan"), dtype=dtype, device="cuda")
    y = ops.gemv(x, wp, bp, out=out, config=cfg, silu_paired_rows=True, **pro)
    torch.cuda.synchronize()
    assert y is out
    assert torch.equal(_bits(out), _bits(ref))
    # within the dtype's rounding of float64 SiLU(gate) * up of the kernel's own (rounded) product
    expect = _silu_mul_float64(ref_gate_up, inter)
    eps = 2**-8 if dtype == torch.bfloat16 else 2**-11  # SiLU and the product: one rounding each
    assert torch.allclose(out.double(), expect, rtol=2 * eps, atol=1e-6)

    # the paired product (gemv here; F.linear in a model's larger steps, tested with the model below)
    # through silu_and_mul(paired_rows), which reads that order
    act = ops.silu_and_mul(torch.empty_like(out), ops.gemv(x, wp, bp, config=cfg, **pro), paired_rows=True)
    torch.cuda.synchronize()
    assert torch.equal(_bits(act), _bits(ref))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32] + DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(3, 1024), (2, 24), (1, 8)], ids=lambda s: f"t{s[0]}-i{s[1]}")
@pytest.mark.parametrize("misaligned", [False, True], ids=["vec", "scalar"])
def test_silu_and_mul_paired_rows_reads_the_paired_order(gen, dtype, shape, misaligned):
    t, inter = shape
    gate_up = rand((t, 2 * inter), dtype, gen, offset=1 if misaligned else 0)  # offset: the scalar path
    ref = ops.silu_and_mul(torch.empty((t, inter), dtype=dtype, device="cuda"), gate_up)
    paired = gate_up.index_select(1, ops.gate_up_paired_order(inter).cuda())
    if misaligned:
        paired = rand((t, 2 * inter), dtype, gen, offset=1).copy_(paired)
    out = ops.silu_and_mul(torch.empty((t, inter), dtype=dtype, device="cuda"), paired, paired_rows=True)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("pdl", [True, False])
def test_silu_epilogue_in_a_cuda_graph(gen, pdl):
    """Captured once behind an rms_norm kernel (as in a decoder layer) and followed by the down
    GEMV, replayed over new inputs written in place: each replay equals the unfused ops."""
    dtype, m, inter, k = torch.bfloat16, 2, 1024, 512
    w = rand((2 * inter, k), dtype, gen, scale=k**-0.5)
    wd = rand((k, inter), dtype, gen, scale=inter**-0.5)
    wp = w.index_select(0, ops.gate_up_paired_order(inter).cuda())
    h = rand((m, k), dtype, gen)
    norm_w = rand((k,), dtype, gen)
    xn = torch.empty_like(h)

    def body():
        ops.rms_norm(xn, h, norm_w, 1e-5)
        return ops.gemv(ops.gemv(xn, wp, silu_paired_rows=True), wd)

    graph, out = capture_graph(body, pdl)
    for _ in range(2):
        h.copy_(rand((m, k), dtype, gen))
        graph.replay()
        torch.cuda.synchronize()
        act = ops.silu_and_mul(torch.empty((m, inter), dtype=dtype, device="cuda"),
                               ops.gemv(ops.rms_norm(torch.empty_like(h), h, norm_w, 1e-5), w))
        ref = ops.gemv(act, wd)
        torch.cuda.synchronize()
        assert torch.equal(_bits(out), _bits(ref))


@pytest.mark.cuda
@needs_cuda
def test_silu_epilogue_argument_errors(gen):
    dtype = torch.bfloat16
    x = rand((2, 64), dtype, gen)
    with pytest.raises(ValueError, match="silu_paired_rows .* needs out_features % 16 == 0"):
        ops.gemv(x, rand((40, 64), dtype, gen), silu_paired_rows=True)
    w = rand((64, 64), dtype, gen)
    with pytest.raises(ValueError, match="out_features / 2 with silu_paired_rows"):
        ops.gemv(x, w, out=torch.empty((2, 64), dtype=dtype, device="cuda"), silu_paired_rows=True)
    with pytest.raises(ValueError, match="cannot be combined with a float32 out"):
        ops.gemv(x, w, out=torch.empty((2, 32), dtype=torch.float32, device="cuda"), silu_paired_rows=True)
    r = torch.zeros((2, 32), dtype=dtype, device="cuda")
    with pytest.raises(ValueError, match="cannot be combined with a residual"):
        ops.gemv(x, w, out=r, residual=r, silu_paired_rows=True)
    with pytest.raises(ValueError, match="cannot be combined with the silu_and_mul prologue"):
        ops.gemv(rand((2, 128), dtype, gen), w, silu_and_mul=True, silu_paired_rows=True)
    xr, wr, _, cos, sin, positions, slots, (kc, vc), qo = _rope_case(gen, dtype, 2, 4, 2, 64, 32, False)
    with pytest.raises(ValueError, match="cannot be combined with the rope epilogue"):
        ops.gemv(xr, wr, silu_paired_rows=True,
                 rope=ops.GemvRope(4, 2, positions, cos, sin, qo, kc, vc, slots, paired_rows=True))
    with pytest.raises(ValueError, match=r"paired_rows \(gate_up_paired_row order\) needs intermediate_size % 8"):
        ops.silu_and_mul(torch.empty((2, 12), dtype=dtype, device="cuda"), rand((2, 24), dtype, gen),
                         paired_rows=True)


def test_load_weights_keeps_the_paired_order(tmp_path):
    """Pairing is a weight permutation plus bookkeeping, checked on the CPU with it enabled by hand
    (the model pairs only where the GEMV runs): load_weights of a checkpoint leaves every layer
    paired with the checkpoint's gate_up rows (and biases) in the paired order, and unpairing gives
    the checkpoint's rows back."""
    from pagedllm.model_executor.loader import load_safetensors

    from tiny_models import build_tiny_model, load_pagedllm

    build_tiny_model("llama", tmp_path, seed=1, mlp_bias=True)
    model = load_pagedllm(tmp_path)
    assert not model.pair_gate_up_rows()  # CPU: no GEMV, no pairing
    original = [(layer.gate_up_proj.weight.clone(), layer.gate_up_proj.bias.clone()) for layer in model.layers]
    order = ops.gate_up_paired_order(model.config.intermediate_size)
    model.gemv_max_tokens = 8  # by hand: as on CUDA
    assert model.pair_gate_up_rows() and model.pair_gate_up_rows()  # idempotent
    for layer in model.layers:
        layer.gate_up_proj.weight.data.zero_()
        layer.gate_up_proj.bias.data.zero_()
    model.load_weights(load_safetensors(tmp_path))
    assert all(layer.gate_up_paired_rows for layer in model.layers)
    for layer, (w, b) in zip(model.layers, original):
        assert torch.equal(layer.gate_up_proj.weight, w.index_select(0, order))
        assert torch.equal(layer.gate_up_proj.bias, b.index_select(0, order))
    assert model._unpair_gate_up_rows()
    for layer, (w, b) in zip(model.layers, original):
        assert torch.equal(layer.gate_up_proj.weight, w) and torch.equal(layer.gate_up_proj.bias, b)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mode", ["default", "rope-unpaired", "fuse1"])
def test_model_paired_gate_up_rows_give_the_same_logits(tmp_path, gen, mode, monkeypatch):
    """Prefill (F.linear + silu_and_mul(paired_rows)) and decode steps (the GEMV's SiLU epilogue)
    after pair_gate_up_rows() against the model before: logits bit for bit; unpairing restores the
    weights exactly. Modes: as the runner (paired rotary rows too), with standard-order qkv rows,
    and at GEMV fusion level 1 (norm prologues, residual epilogues)."""
    if mode == "fuse1":
        monkeypatch.setenv("PAGEDLLM_GEMV_FUSE", "1")
    model = _tiny_llama(tmp_path, "cuda", int(torch.randint(0, 1000, (1,), generator=gen)), mlp_bias=True)
    if mode != "rope-unpaired":
        assert model.pair_rotary_rows()
    original = [(layer.gate_up_proj.weight.clone(), layer.gate_up_proj.bias.clone()) for layer in model.layers]
    lens = [30, 12, 19]
    ids = [torch.randint(0, model.config.vocab_size, (n + 3,), generator=gen) for n in lens]
    results = {}
    for paired in (False, True):
        if paired:
            assert model.pair_gate_up_rows() and all(layer.gate_up_paired_rows for layer in model.layers)
        harness = PagedHarness(model, len(lens), max(lens) + 3, block_size=16)
        steps = [[(s, 0, n) for s, n in enumerate(lens)]]
        steps += [[(s, n + i, n + i + 1) for s, n in enumerate(lens)][: 3 - i] for i in range(3)]
        results[paired] = torch.cat([harness.step([(s, ids[s][a:b].tolist()) for s, a, b in chunks]).cpu()
                                     for chunks in steps])
    assert torch.isfinite(results[False]).all()
    assert torch.equal(results[True], results[False])
    assert model._unpair_gate_up_rows() and not any(layer.gate_up_paired_rows for layer in model.layers)
    for layer, (w, b) in zip(model.layers, original):
        assert torch.equal(layer.gate_up_proj.weight, w) and torch.equal(layer.gate_up_proj.bias, b)
