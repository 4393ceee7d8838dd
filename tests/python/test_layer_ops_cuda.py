"""The CUDA kernels of pagedllm/layer_ops.h (cuda/rms_norm.cu, activation.cu,
rotary_embedding.cu): rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding_and_cache, and
the CUDA model path that uses them (the CPU kernels: test_layer_ops.py).

Every kernel is checked against a float64 reference on fresh random inputs (the seed is printed),
for float32 / bfloat16 / float16, odd sizes and misaligned (scalar-path) views; where the kernel
reproduces PyTorch's rounding exactly (the residual add, RoPE), the result is also compared bit
for bit with the PyTorch expression in the same dtype, and the CUDA rotation with the CPU kernel's.
The model test runs a tiny Llama / Qwen2 / Qwen3 with the fused kernels and with the PyTorch path
on the same weights and inputs. CUDA cases carry the `cuda` marker; the device refusals run
everywhere.
"""

from __future__ import annotations

import json

import pytest
import torch

import pagedllm.ops as ops
from pagedllm import _C

from tiny_models import PagedHarness

torch.set_num_threads(2)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol) against the float64 reference: a couple of units in the last place of the dtype
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def dtype_id(dt):
    return str(dt).removeprefix("torch.")


def randn(shape, dtype, gen, scale=1.0, offset=0):
    """Random values on the GPU; offset > 0 returns a view starting `offset` elements into its
    buffer (not 16-byte aligned: the kernels' scalar path)."""
    n = 1
    for s in shape:
        n *= s
    buf = (torch.randn(n + offset, generator=gen, dtype=torch.float64) * scale).to(dtype).cuda()
    return buf[offset:].view(shape)


def close(actual, expected64, dtype, what):
    rtol, atol = TOL[dtype]
    err = (actual.double().cpu() - expected64.cpu()).abs()
    bound = atol + rtol * expected64.abs().cpu()
    bad = err > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} of {err.numel()} values off, worst {float(err.max()):.3g}"


def rms_ref(x64, w64, eps):
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64


# ---------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("tokens,hidden", [(1, 4096), (7, 37), (33, 256), (5, 1000), (3, 1), (2, 8192)])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.cuda
@needs_cuda
def test_rms_norm(gen, dtype, tokens, hidden, offset):
    x = randn((tokens, hidden), dtype, gen, 2.0, offset)
    w = randn((hidden,), dtype, gen, 0.3) + 1
    out = torch.full_like(x, float("nan"))
    x_before = x.clone()
    ops.rms_norm(out, x, w, 1e-5)
    torch.cuda.synchronize()
    close(out, rms_ref(x.double(), w.double(), 1e-5), dtype, "rms_norm")
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("tokens,hidden", [(1, 4096), (9, 37), (64, 896), (4, 1000)])
@pytest.mark.parametrize("offset", [0, 3], ids=["aligned", "misaligned"])
@pytest.mark.cuda
@needs_cuda
def test_fused_add_rms_norm(gen, dtype, tokens, hidden, offset):
    x = randn((tokens, hidden), dtype, gen, 1.0, offset)
    residual = randn((tokens, hidden), dtype, gen, 3.0, offset)
    w = randn((hidden,), dtype, gen, 0.3) + 1
    expected_residual = x + residual  # PyTorch's add in the dtype: the kernel rounds the same way
    ops.fused_add_rms_norm(x, residual, w, 1e-6)
    torch.cuda.synchronize()
    assert torch.equal(residual, expected_residual)
    close(x, rms_ref(expected_residual.double(), w.double(), 1e-6), dtype, "fused_add_rms_norm")


@pytest.mark.cuda
@needs_cuda
def test_empty_rows(gen):
    w = randn((64,), torch.bfloat16, gen) + 1
    empty = torch.empty((0, 64), dtype=torch.bfloat16, device="cuda")
    ops.rms_norm(empty, empty.clone(), w, 1e-5)
    ops.fused_add_rms_norm(empty, empty.clone(), w, 1e-5)


# ---------------------------------------------------------------- SiLU and mul
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("tokens,d", [(1, 14336), (5, 13), (64, 512), (3, 1000), (2, 1)])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.cuda
@needs_cuda
def test_silu_and_mul(gen, dtype, tokens, d, offset):
    x = randn((tokens, 2 * d), dtype, gen, 3.0, offset)
    out = torch.full((tokens, d), float("nan"), dtype=dtype, device="cuda")
    ops.silu_and_mul(out, x)
    torch.cuda.synchronize()
    g, u = x.double().chunk(2, dim=-1)
    close(out, g / (1 + torch.exp(-g)) * u, dtype, "silu_and_mul")


# ---------------------------------------------------------------- rotary embeddings
def rope_tables(max_pos, rot_half, dtype, base=10000.0):
    inv = 1.0 / base ** (torch.arange(rot_half, dtype=torch.float64) / rot_half)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return freqs.cos().to(dtype).cuda(), freqs.sin().to(dtype).cuda()


def rope_ref64(x, positions, cos, sin):
    """float64 rotation of x [T, H, D] (the dtype tables read as float64)."""
    r = cos.shape[1]
    c = cos.double()[positions][:, None, :]
    s = sin.double()[positions][:, None, :]
    x = x.double()
    out = x.clone()
    x1, x2 = x[..., :r], x[..., r:2 * r]
    out[..., :r] = x1 * c - x2 * s
    out[..., r:2 * r] = x2 * c + x1 * s
    return out


def rope_torch(x, positions, cos, sin):
    """PyTorch in the dtype, as the model's CPU path and HF: each product rounded, then the sum."""
    r = cos.shape[1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    out = x.clone()
    x1, x2 = x[..., :r], x[..., r:2 * r]
    out[..., :r] = torch.sub(x1 * c, x2 * s)
    out[..., r:2 * r] = torch.add(x2 * c, x1 * s)
    return out


ROPE_SHAPES = [  # tokens, Hq, Hkv, head_size, rotary_dim / 2
    (1, 32, 8, 128, 64),
    (19, 4, 2, 64, 32),
    (7, 14, 2, 64, 16),   # partial rotary: features 32..63 untouched
    (5, 3, 3, 6, 2),      # odd head count, tiny heads, partial
    (40, 8, 1, 80, 40),
]


def qkv_views(tokens, hq, hkv, d, dtype, gen):
    """q, k, v as strided views into one [T, (hq + 2 hkv) * d] tensor (the QKV projection)."""
    qkv = randn((tokens, (hq + 2 * hkv) * d), dtype, gen, 2.0)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return qkv, q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.cuda
@needs_cuda
def test_rotary_embedding_and_cache(gen, dtype, shape, block_size):
    tokens, hq, hkv, d, r = shape
    if d not in ops.SUPPORTED_HEAD_SIZES:
        d = 64  # the caches need a supported head size
        r = min(r, 32)
    if block_size not in ops.SUPPORTED_BLOCK_SIZES:
        pytest.skip(f"block size {block_size} not supported")
    max_pos = 500
    cos, sin = rope_tables(max_pos, r, dtype)
    qkv, q, k, v = qkv_views(tokens, hq, hkv, d, dtype, gen)
    qkv_before = qkv.clone()
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).cuda()
    num_blocks = tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[tokens // 2] = -1  # padding: nothing written
    key_cache = torch.full((num_blocks, hkv, block_size, d), float("nan"), dtype=dtype, device="cuda")
    value_cache = torch.full_like(key_cache, float("nan"))
    query_out = torch.full((tokens, hq, d), float("nan"), dtype=dtype, device="cuda")
    ops.rotary_embedding_and_cache(positions, q, k, v, cos, sin, query_out, key_cache, value_cache, slots.cuda())
    torch.cuda.synchronize()
    assert torch.equal(qkv, qkv_before)  # inputs only read
    assert torch.equal(query_out, rope_torch(q, positions, cos, sin))
    assert torch.equal(query_out[..., 2 * r:], q[..., 2 * r:])  # features beyond rotary_dim copied
    close(query_out, rope_ref64(q.cpu(), positions.cpu(), cos.cpu(), sin.cpu()), dtype, "query_out")
    k_rot = rope_torch(k, positions, cos, sin).cpu()
    kc, vc = key_cache.cpu(), value_cache.cpu()
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, row = divmod(s, block_size)
        written[b, row] = True
        assert torch.equal(kc[b, :, row], k_rot[t]), f"key of token {t} in slot {s}"
        assert torch.equal(vc[b, :, row], v[t].cpu()), f"value of token {t} in slot {s}"
    untouched = ~written
    assert kc.permute(0, 2, 1, 3)[untouched].isnan().all() and vc.permute(0, 2, 1, 3)[untouched].isnan().all()


@pytest.mark.cuda
@needs_cuda
def test_rotary_matches_model_tables_and_the_cpu_kernel(gen):
    """The model's own tables (llama3 scaling, bfloat16): the CUDA rotation equals the CPU
    kernel's (ops.rotary_embedding on the cos_sin_cache) bit for bit, and the model's PyTorch CUDA
    path (addcmul: one rounding fewer) to an ulp."""
    from pagedllm.model_executor.config import RopeConfig
    from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)
    rot = RotaryEmbedding(rope, 128, 1024, torch.bfloat16, torch.device("cuda"))
    _, q, k, v = qkv_views(11, 8, 2, 128, torch.bfloat16, gen)
    positions = torch.randint(0, 1024, (11,), generator=gen).cuda()
    kc = torch.zeros(2, 2, 16, 128, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    query = torch.empty(11, 8, 128, dtype=torch.bfloat16, device="cuda")
    ops.rotary_embedding_and_cache(positions, q, k, v, rot.cos, rot.sin, query, kc, vc, torch.arange(11).cuda())
    q_cpu, k_cpu = q.cpu().clone(), k.cpu().clone()
    ops.rotary_embedding(positions.cpu(), q_cpu, k_cpu, rot.cos_sin_cache.cpu())
    assert torch.equal(query.cpu(), q_cpu)
    assert torch.equal(kc[0].transpose(0, 1)[:11].cpu(), k_cpu)
    cos, sin = rot.cos_sin(positions)
    close(query, rot.apply(q, cos, sin).double(), torch.bfloat16, "vs RotaryEmbedding.apply")


# ---------------------------------------------------------------- argument errors
def test_each_rotary_op_refuses_the_device_it_lacks():
    q, k = torch.randn(2, 2, 64), torch.randn(2, 1, 64)
    kc = torch.zeros(4, 1, 16, 64)
    with pytest.raises(ValueError, match=r"rotary_embedding_and_cache: query is on cpu; this op has a CUDA kernel "
                                         r"only so far \(on the cpu use rotary_embedding, then reshape_and_cache\)"):
        ops.rotary_embedding_and_cache(torch.zeros(2, dtype=torch.int64), q, k, k.clone(), torch.ones(8, 32),
                                       torch.ones(8, 32), torch.empty_like(q), kc, kc.clone(),
                                       torch.zeros(2, dtype=torch.int64))
    # a CUDA view (never dereferenced: the device is refused first)
    fake = _C.TensorView(1 << 20, "float32", [2, 2, 64], [128, 64, 1], "cuda", 0)
    with pytest.raises(ValueError, match=r"rotary_embedding: query is on cuda:0; the in-place rotary embedding "
                                         r"has a CPU kernel only so far"):
        _C.rotary_embedding(fake, fake, fake, fake, 0)
    assert ops.layer_ops_supported("cuda", torch.float16) == bool(_C.layer_ops_built_with_cuda())


@pytest.mark.cuda
@needs_cuda
def test_bad_arguments_name_the_value():
    dev = "cuda"
    x = torch.randn(3, 8, device=dev)
    with pytest.raises(ValueError, match=r"weight dimension 0 \(hidden_size, must match input\) must be 8, got 7"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(7, device=dev), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be float32, got bfloat16"):
        ops.fused_add_rms_norm(x, x.clone(), torch.ones(8, device=dev, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0, got -1"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(8, device=dev), -1.0)
    with pytest.raises(ValueError, match=r"out and input overlap"):
        ops.rms_norm(x, x, torch.ones(8, device=dev), 1e-5)
    with pytest.raises(ValueError, match=r"input and residual overlap"):
        ops.fused_add_rms_norm(x, x, torch.ones(8, device=dev), 1e-5)
    with pytest.raises(ValueError, match=r"input's last dimension \(gate and up halves\) must be even"):
        ops.silu_and_mul(torch.empty(3, 3, device=dev), torch.randn(3, 7, device=dev))
    with pytest.raises(ValueError, match=r"out dimension 1 \(intermediate_size, half of input's last dimension\) must be 4, got 3"):
        ops.silu_and_mul(torch.empty(3, 3, device=dev), x)
    with pytest.raises(ValueError, match=r"input dtype int32 is not supported; supported dtypes on cuda: float32, bfloat16, float16"):
        ops.silu_and_mul(torch.empty(3, 4, device=dev, dtype=torch.int32), x.int())
    q, k = torch.randn(2, 4, 64, device=dev), torch.randn(2, 2, 64, device=dev)
    cos = torch.ones(10, 32, device=dev)
    pos = torch.zeros(2, dtype=torch.int64, device=dev)
    kc = torch.zeros(4, 2, 16, 64, device=dev)
    slots = torch.zeros(2, dtype=torch.int64, device=dev)

    def rope(positions=pos, query=q, key=k, cos_cache=cos, query_out=None, slot_mapping=slots):
        out = torch.empty(query.shape, dtype=query.dtype, device=dev) if query_out is None else query_out
        ops.rotary_embedding_and_cache(positions, query, key, key.clone(), cos_cache, cos_cache, out, kc, kc.clone(),
                                       slot_mapping)

    with pytest.raises(ValueError, match=r"positions must be int64, got int32"):
        rope(positions=pos.int())
    with pytest.raises(ValueError, match=r"rotary_dim 2 \* 40 .* at most head_size 64"):
        rope(cos_cache=torch.ones(10, 40, device=dev))
    with pytest.raises(ValueError, match=r"query must have contiguous features"):
        rope(query=q.transpose(1, 2))
    with pytest.raises(ValueError, match=r"key dimension 2 \(head_size, must match query\) must be 64, got 32"):
        rope(key=k[..., :32].contiguous())
    with pytest.raises(ValueError, match=r"query_out overlaps query"):
        rope(query_out=q)
    with pytest.raises(ValueError, match=r"slot_mapping dimension 0 \(num_tokens, must match query\) must be 2"):
        rope(slot_mapping=slots[:1])
    with pytest.raises(ValueError, match=r"rotary_embedding: query is on cuda:0; the in-place rotary embedding"):
        ops.rotary_embedding(pos, q, k, torch.ones(10, 64, device=dev))


# ---------------------------------------------------------------- the model path
MODEL_CONFIGS = {
    "llama3": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=768,
                   num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1000,
                   max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=320, intermediate_size=604,
                  num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1, vocab_size=777,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
}


@pytest.mark.parametrize("arch", list(MODEL_CONFIGS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)], ids=["float32", "bfloat16"])
@pytest.mark.cuda
@needs_cuda
def test_model_fused_path_matches_pytorch_path(tmp_path, gen, arch, dtype, tol):
    """Prefill of two sequences (chunked: 2 steps) then 3 decode steps, fused kernels vs PyTorch
    path, same weights: logits agree relative to their largest magnitude (float32: to rounding;
    bfloat16: a few ulps) and the argmax rows match in float32."""
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.dummy import init_dummy_weights
    from pagedllm.model_executor.models import LlamaForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIGS[arch]))
    cfg = ModelConfig.from_pretrained(tmp_path)
    dev = torch.device("cuda")
    model = LlamaForCausalLM(cfg, dtype, dev, max_positions=256)
    init_dummy_weights(model, seed=int(torch.randint(0, 1000, (1,), generator=gen)), std=0.08)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    assert model.fused

    def use_fused(flag):
        for module in model.modules():
            if hasattr(module, "fused"):
                module.fused = flag
    lens = [37, 21]
    ids = [torch.randint(0, cfg.vocab_size, (n + 3,), generator=gen) for n in lens]
    results = {}
    for fused in (True, False):
        use_fused(fused)
        harness = PagedHarness(model, len(lens), max(lens) + 3)  # fresh caches, same blocks
        steps = [[(0, 0, 20), (1, 0, 21)], [(0, 20, 37)]] + [[(0, n, n + 1), (1, m, m + 1)]
                                                            for n, m in zip(range(37, 40), range(21, 24))]
        logits = []
        for chunks in steps:
            logits.append(harness.step([(s, ids[s][a:b].tolist()) for s, a, b in chunks]))
        results[fused] = torch.cat(logits).cpu()
    scale = float(results[False].abs().max())
    diff = float((results[True] - results[False]).abs().max())
    assert scale > 0.1 and diff < tol * scale, f"{arch} {dtype}: fused and PyTorch logits differ by {diff} (max {scale})"
    if dtype == torch.float32:
        assert torch.equal(results[True].argmax(-1), results[False].argmax(-1))
