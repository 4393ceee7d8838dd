"""The paired-rows order of a rotated head (layer_ops.h's rotary_paired_row, ops.rotary_paired_order):
a qkv weight whose query and key rows are permuted so that both features (j, j + D/2) of every
rotary pair land in one lane of the GEMV (rows r and r + 8 of a 16-row tile).

- the order itself (everywhere): a permutation of the head's features with every pair 8 rows apart
  in one 16-row tile; bad head sizes refused;
- the qkv GEMV's paired rope epilogue (GemvRope.paired_rows, no counters) on the permuted weight
  against gemv + rotary_embedding_and_cache on the original weight: query_out and both caches bit
  for bit (NaN-filled, untouched slots included), out equal to the reference's rows permuted; every
  tile config, a cluster K split, the RMSNorm prologue, bias; also rotary_embedding_and_cache(
  paired_rows=True) on the paired out; inside a CUDA graph with and without PDL;
- argument errors (partial rotary, missing counters without paired rows);
- the Llama model after pair_rotary_rows(): logits of prefill and decode steps bit for bit those of
  the model before (the standard rope epilogue and the separate rotary kernel), and the weights
  back to the original after unpairing; load_weights on a paired model keeps the paired order
  (CPU, pairing enabled by hand).
"""

from __future__ import annotations

import json

import pytest
import torch

import pagedllm.ops as ops
from pagedllm import _C

from test_gemv import DTYPES, _bits, _rope_case, _rope_reference, dtype_id, needs_cuda, rand
from graph_capture import capture_graph
from tiny_models import PagedHarness


def qk_rows(hq, hkv, d, n):
    """int64 [n]: out row -> weight row of a qkv projection whose q and k heads are paired."""
    from pagedllm.model_executor.models.llama import qk_head_rows

    return qk_head_rows(ops.rotary_paired_order(d), hq, hkv, n)


@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_paired_order_puts_each_rotary_pair_in_one_lane(d):
    half = d // 2
    order = ops.rotary_paired_order(d)
    assert sorted(order.tolist()) == list(range(d))  # a permutation
    row = {int(f): r for r, f in enumerate(order.tolist())}
    for j in range(half):
        assert row[j] == _C.rotary_paired_row(j, half) and row[j + half] == _C.rotary_paired_row(j + half, half)
        assert row[j] % 16 < 8 and row[j + half] == row[j] + 8  # rows g and g + 8 of one tile


@pytest.mark.parametrize("d", [0, -16, 8, 24, 100])
def test_paired_order_refuses_bad_head_sizes(d):
    with pytest.raises(ValueError, match=f"multiple of 16, got {d}"):
        ops.rotary_paired_order(d)
    with pytest.raises(ValueError, match="rot_half must be a positive multiple of 8"):
        _C.rotary_paired_row(0, d // 2)
    with pytest.raises(ValueError, match=r"feature must be in \[0, 64\), got 64"):
        _C.rotary_paired_row(64, 32)


def test_load_weights_keeps_the_paired_order(tmp_path):
    """Pairing is a weight permutation plus bookkeeping, checked on the CPU with it enabled by hand
    (LlamaForCausalLM enables it on CUDA by giving the layers rope counters): load_weights of a
    checkpoint leaves every layer paired with the checkpoint's qkv rows (and biases) in the paired
    order, and unpairing gives the checkpoint's rows back."""
    from pagedllm.model_executor.loader import load_safetensors

    from tiny_models import build_tiny_model, load_pagedllm

    build_tiny_model("qwen2", tmp_path, seed=1)  # qkv biases
    model = load_pagedllm(tmp_path)
    cfg = model.config
    original = [(layer.qkv_proj.weight.clone(), layer.qkv_proj.bias.clone()) for layer in model.layers]
    rows = qk_rows(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, original[0][0].shape[0])
    for layer in model.layers:
        layer.rope_counters = torch.zeros(1, dtype=torch.int32)
    assert model.pair_rotary_rows()
    for layer in model.layers:
        layer.qkv_proj.weight.data.zero_()
        layer.qkv_proj.bias.data.zero_()
    model.load_weights(load_safetensors(tmp_path))
    assert all(layer.rope_paired_rows for layer in model.layers)
    for layer, (w, b) in zip(model.layers, original):
        assert torch.equal(layer.qkv_proj.weight, w.index_select(0, rows))
        assert torch.equal(layer.qkv_proj.bias, b.index_select(0, rows))
    assert model._unpair_rotary_rows()
    for layer, (w, b) in zip(model.layers, original):
        assert torch.equal(layer.qkv_proj.weight, w) and torch.equal(layer.qkv_proj.bias, b)


FULL_ROPE_SHAPES = [(32, 8, 128, 64, False), (14, 2, 64, 32, True), (4, 1, 256, 128, True)]  # Hq, Hkv, D, half, bias


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("shape", FULL_ROPE_SHAPES, ids=lambda s: f"hq{s[0]}-hkv{s[1]}-d{s[2]}")
@pytest.mark.parametrize("cfg", [{}, {"variant": 2}, {"variant": 3, "warps": 4}, {"splits": 2}],
                         ids=["auto", "rows32", "v3w4", "split2"])
@pytest.mark.parametrize("norm", [False, True], ids=["x", "rmsnorm"])
def test_paired_rope_epilogue_equals_standard_order(gen, dtype, m, shape, cfg, norm):
    hq, hkv, d, half, bias = shape
    x, w, b, cos, sin, positions, slots, (kc, vc), qo = _rope_case(gen, dtype, m, hq, hkv, d, half, bias)
    rows = qk_rows(hq, hkv, d, w.shape[0]).cuda()
    pro = {"norm_weight": rand((x.shape[1],), dtype, gen), "eps": 1e-5} if norm else {}
    ref_y = ops.gemv(x, w, b, config=cfg, **pro)
    ref_qo, ref_kc, ref_vc = _rope_reference(ref_y, m, hq, hkv, d, positions, cos, sin, qo, kc, vc, slots)

    wp, bp = w.index_select(0, rows), None if b is None else b.index_select(0, rows)
    y = ops.gemv(x, wp, bp, config=cfg, rope=ops.GemvRope(hq, hkv, positions, cos, sin, qo, kc, vc, slots,
                                                          paired_rows=True), **pro)
    torch.cuda.synchronize()
    assert torch.equal(_bits(y), _bits(ref_y.index_select(1, rows)))  # out: the paired order
    assert torch.equal(_bits(qo), _bits(ref_qo))
    assert torch.equal(_bits(kc), _bits(ref_kc)) and torch.equal(_bits(vc), _bits(ref_vc))

    # the rotary kernel reads the same paired out (larger steps: F.linear + rotary_embedding_and_cache)
    q, k, v = y.view(m, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    kc2, vc2, qo2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan")), torch.empty_like(qo)
    ops.rotary_embedding_and_cache(positions, q, k, v, cos, sin, qo2, kc2, vc2, slots, paired_rows=True)
    torch.cuda.synchronize()
    assert torch.equal(_bits(qo2), _bits(ref_qo))
    assert torch.equal(_bits(kc2), _bits(ref_kc)) and torch.equal(_bits(vc2), _bits(ref_vc))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("pdl", [True, False])
def test_paired_rope_epilogue_in_a_cuda_graph(gen, pdl):
    """Captured once behind an rms_norm kernel (as in a decoder layer), replayed over new inputs and
    positions written in place: each replay equals the standard order's unfused ops."""
    dtype, m, (hq, hkv, d, half, bias) = torch.bfloat16, 2, FULL_ROPE_SHAPES[1]
    x, w, b, cos, sin, positions, slots, (kc, vc), qo = _rope_case(gen, dtype, m, hq, hkv, d, half, bias)
    rows = qk_rows(hq, hkv, d, w.shape[0]).cuda()
    wp, bp = w.index_select(0, rows), b.index_select(0, rows)
    h = x.clone()
    rope = ops.GemvRope(hq, hkv, positions, cos, sin, qo, kc, vc, slots, paired_rows=True)
    norm_w = rand((x.shape[1],), dtype, gen)
    xn = torch.empty_like(h)

    def body():
        ops.rms_norm(xn, h, norm_w, 1e-5)
        return ops.gemv(xn, wp, bp, rope=rope)

    graph, _ = capture_graph(body, pdl)
    for _ in range(2):
        h.copy_(rand(tuple(h.shape), dtype, gen))
        positions.copy_(torch.randint(0, cos.shape[0], (m,), generator=gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        ref_y = ops.gemv(ops.rms_norm(torch.empty_like(h), h, norm_w, 1e-5), w, b)
        ref_qo, ref_kc, ref_vc = _rope_reference(ref_y, m, hq, hkv, d, positions, cos, sin, qo, kc, vc, slots)
        torch.cuda.synchronize()
        assert torch.equal(_bits(qo), _bits(ref_qo))
        assert torch.equal(_bits(kc), _bits(ref_kc)) and torch.equal(_bits(vc), _bits(ref_vc))


@pytest.mark.cuda
@needs_cuda
def test_paired_rows_argument_errors(gen):
    dtype = torch.bfloat16
    # partial rotary: D = 128 with rotary_dim 32
    x, w, b, cos, sin, positions, slots, (kc, vc), qo = _rope_case(gen, dtype, 2, 4, 2, 128, 16, False)
    with pytest.raises(ValueError, match="paired_rows needs full rotary .* got head_size 128 and rotary_dim 32"):
        ops.gemv(x, w, rope=ops.GemvRope(4, 2, positions, cos, sin, qo, kc, vc, slots, paired_rows=True))
    y = ops.gemv(x, w)
    q, k, v = y.view(2, 8, 128).split([4, 2, 2], dim=1)
    with pytest.raises(ValueError, match="paired_rows needs full rotary .* got head_size 128 and rotary_dim 32"):
        ops.rotary_embedding_and_cache(positions, q, k, v, cos, sin, qo, kc, vc, slots, paired_rows=True)
    with pytest.raises(ValueError, match="needs counters \\(or paired_rows"):
        ops.gemv(x, w, rope=ops.GemvRope(4, 2, positions, cos, sin, qo, kc, vc, slots))


def _tiny_llama(tmp_path, device, seed, **over):
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.dummy import init_dummy_weights
    from pagedllm.model_executor.models import LlamaForCausalLM

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512, intermediate_size=1024,
                  num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1000,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    config.update(over)
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_pretrained(tmp_path)
    model = LlamaForCausalLM(cfg, torch.bfloat16, torch.device(device), max_positions=256)
    init_dummy_weights(model, seed=seed, std=0.08)
    return model


def test_pair_rotary_rows_is_a_no_op_on_the_cpu(tmp_path):
    model = _tiny_llama(tmp_path, "cpu", 0)
    before = model.layers[0].qkv_proj.weight.clone()
    assert not model.pair_rotary_rows()
    assert not any(layer.rope_paired_rows for layer in model.layers)
    assert torch.equal(model.layers[0].qkv_proj.weight, before)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qkv-bias"])
def test_model_paired_rows_give_the_same_logits(tmp_path, gen, bias):
    """Prefill (F.linear + the paired rotary kernel) and decode steps (the paired epilogue) after
    pair_rotary_rows() against the standard order with the counters' epilogue and with the
    separate rotary kernel: logits bit for bit; unpairing restores the weights exactly."""
    model = _tiny_llama(tmp_path, "cuda", int(torch.randint(0, 1000, (1,), generator=gen)), attention_bias=bias)
    counters = model.layers[0].rope_counters
    assert counters is not None
    original = [(layer.qkv_proj.weight.clone(), None if layer.qkv_proj.bias is None else layer.qkv_proj.bias.clone())
                for layer in model.layers]
    lens = [30, 12, 19]
    ids = [torch.randint(0, model.config.vocab_size, (n + 3,), generator=gen) for n in lens]
    results = {}
    for mode in ("separate", "counters", "paired"):
        if mode == "paired":
            assert model.pair_rotary_rows() and all(layer.rope_paired_rows for layer in model.layers)
            assert model.pair_rotary_rows()  # idempotent
        for layer in model.layers:
            layer.rope_counters = None if mode == "separate" else counters
        harness = PagedHarness(model, len(lens), max(lens) + 3, block_size=16)
        steps = [[(s, 0, n) for s, n in enumerate(lens)]]
        steps += [[(s, n + i, n + i + 1) for s, n in enumerate(lens)][: 3 - i] for i in range(3)]
        results[mode] = torch.cat([harness.step([(s, ids[s][a:b].tolist()) for s, a, b in chunks]).cpu()
                                   for chunks in steps])
    assert torch.equal(results["counters"], results["separate"])
    assert torch.equal(results["paired"], results["separate"])
    assert model._unpair_rotary_rows() and not any(layer.rope_paired_rows for layer in model.layers)
    for layer, (w, b) in zip(model.layers, original):
        assert torch.equal(layer.qkv_proj.weight, w)
        assert b is None or torch.equal(layer.qkv_proj.bias, b)
