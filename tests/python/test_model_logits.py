"""pagedllm's model code against Hugging Face transformers, teacher-forced, on random tiny models of
every supported architecture: chunked prefill, decode and mixed prefill+decode batches over shuffled
paged blocks must give HF's logits (fp32) for every token."""

from __future__ import annotations

import pytest
import torch

from tiny_models import TINY_CONFIGS, PagedHarness, build_tiny_model, load_pagedllm

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def one_kernel_thread():
    from pagedllm import ops

    before = ops.get_num_threads()
    ops.set_num_threads(1)
    yield
    ops.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            cache[name] = (build_tiny_model(name, folder), folder)
        return cache[name]

    return get


def run_schedule(model, seqs, block_size=16):
    """Two sequences: chunked prefill (20 + 20 tokens) of seq 0 batched with seq 1's prefill and
    first decode rows, then decode steps with both, then seq 0 alone. Returns logits per seq."""
    h = PagedHarness(model, 2, 80, block_size=block_size)
    a, b = seqs
    outs = [[], []]
    o = h.step([(0, a[:20]), (1, b[:10])])
    outs[0].append(o[:20]); outs[1].append(o[20:])
    o = h.step([(0, a[20:40]), (1, b[10:11])])  # chunk with context + a decode row
    outs[0].append(o[:20]); outs[1].append(o[20:])
    for i in range(40, len(a)):
        j = i - 29
        if j < len(b):
            o = h.step([(1, [b[j]]), (0, [a[i]])])  # decode-only batch (paged_attention)
            outs[1].append(o[:1]); outs[0].append(o[1:])
        else:
            outs[0].append(h.step([(0, [a[i]])]))
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_teacher_forced_logits_match_hf(tiny, name):
    hf, folder = tiny(name)
    model = load_pagedllm(folder)
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (60, 25)]
    ours = run_schedule(model, seqs)
    assert ours[0].shape == (60, 1024) and ours[1].shape == (25, 1024)
    for s, seq in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, : ours[s].shape[0]].float()
        assert ours[s].dtype == torch.float32
        torch.testing.assert_close(ours[s], ref, atol=1e-4, rtol=1e-4)
        lp, ref_lp = ours[s].log_softmax(-1), ref.log_softmax(-1)
        assert (lp - ref_lp).abs().max().item() < 1e-4
        assert torch.equal(ours[s].argmax(-1), ref.argmax(-1)) or _only_near_ties(ours[s], ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_dim_32_matches_hf(tmp_path, dtype):
    """head_dim 32 (small Llama-family checkpoints use it; vLLM accepts them): the paged prefill and
    decode attention with 32-wide heads against transformers."""
    folder = tmp_path / "hd32"
    hf = build_tiny_model("llama", folder, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    model = load_pagedllm(folder, dtype)
    assert model.config.head_dim == 32
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (60, 25)]
    ours = run_schedule(model, seqs)
    for s, seq in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, : ours[s].shape[0]].float()
            ref_same_dtype = hf.to(dtype)(torch.tensor([seq])).logits[0, : ours[s].shape[0]].float()
            hf.to(torch.float32)
        if dtype == torch.float32:
            lp, ref_lp = ours[s].log_softmax(-1), ref.log_softmax(-1)
            assert (lp - ref_lp).abs().max().item() < 1e-4
        else:  # bfloat16: as close to the float32 logits as transformers' own bfloat16 run is
            err, hf_err = (ours[s].float() - ref).abs().max().item(), (ref_same_dtype - ref).abs().max().item()
            assert err <= 1.5 * hf_err, (err, hf_err)
            assert (ours[s].argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9


def _only_near_ties(ours, ref, margin=1e-3):
    top2 = ref.topk(2, dim=-1).values
    differ = ours.argmax(-1) != ref.argmax(-1)
    return bool(((top2[:, 0] - top2[:, 1])[differ] <= margin).all())


def test_sliding_window_is_applied(tiny):
    """The mistral config has a 40-token window; positions past it must differ from full attention."""
    from pagedllm.model_executor.config import ModelConfig

    _, folder = tiny("mistral")
    assert ModelConfig.from_pretrained(folder).sliding_windows == (40, 40)
    windowed = load_pagedllm(folder)
    full = load_pagedllm(folder)
    for layer in full.layers:
        layer.attn.sliding_window = None
    seq = torch.randint(3, 1024, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    h1, h2 = PagedHarness(windowed, 1, 64), PagedHarness(full, 1, 64)
    a, b = h1.step([(0, seq)]), h2.step([(0, seq)])
    torch.testing.assert_close(a[:40], b[:40])
    assert (a[40:] - b[40:]).abs().max().item() > 1e-3


def test_bf16_close_to_hf(tiny):
    hf, folder = tiny("qwen3")
    model = load_pagedllm(folder, torch.bfloat16)
    seq = torch.randint(3, 1024, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = PagedHarness(model, 1, 48).step([(0, seq)])
    hf_bf16 = hf.to(torch.bfloat16)
    try:
        with torch.no_grad():
            ref = hf_bf16(torch.tensor([seq])).logits[0].float()
    finally:
        hf.to(torch.float32)
    # bf16 has 8 mantissa bits: logits of magnitude ~5 agree to a few 1e-2
    assert (ours - ref).abs().max().item() < 0.15
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9


def test_sharded_checkpoint_loads_the_same(tiny, tmp_path):
    hf, folder = tiny("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="300KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a, b = load_pagedllm(folder), load_pagedllm(tmp_path)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


def test_missing_tensor_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = tiny("llama")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="layers.1.gate_up_proj"):
        load_pagedllm(tmp_path)


def test_packed_bf16_projections_give_identical_logits(tiny, monkeypatch):
    """oneDNN's packed layout (the fallback where AMX is missing) is bit-identical to F.linear."""
    from pagedllm.model_executor.layers.cpu_linear_methods import AmxLinearMethod, PackedLinearMethod, can_pack_linear

    monkeypatch.setattr(AmxLinearMethod, "applies", staticmethod(lambda weight: False))
    _, folder = tiny("qwen2")  # has q/k/v biases
    model = load_pagedllm(folder, torch.bfloat16)
    seq = torch.randint(3, 1024, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    plain = PagedHarness(model, 1, 32).step([(0, seq)])
    packed = model.pack_weights()
    assert packed == can_pack_linear(torch.bfloat16, torch.device("cpu"))
    assert isinstance(model.layers[0].qkv_proj.quant_method, PackedLinearMethod) == packed
    assert isinstance(model.lm_head.quant_method, PackedLinearMethod) == packed
    again = PagedHarness(model, 1, 32).step([(0, seq)])
    assert torch.equal(plain, again)
    assert not load_pagedllm(folder, torch.float32).pack_weights()  # fp32 stays on F.linear


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_amx_bf16_projections_close_to_f_linear_and_hf(tiny, arch):
    """The AMX projections (the CPU bf16 default where the CPU has AMX) sum in another order than
    oneDNN: a prefill and a one-token decode step agree with the unpacked model's logits within a
    few bfloat16 roundings, and are as close to HF as those; a step above MAX_TOKENS takes
    oneDNN's path and is bit-identical to F.linear."""
    from pagedllm import ops
    from pagedllm.model_executor.layers.cpu_linear_methods import AmxLinearMethod

    if not ops.amx_linear_supported():
        pytest.skip("no AMX-BF16 here: pack_weights uses oneDNN (test above)")
    hf, folder = tiny(arch)
    plain_model, model = load_pagedllm(folder, torch.bfloat16), load_pagedllm(folder, torch.bfloat16)
    assert model.pack_weights()
    assert isinstance(model.layers[0].qkv_proj.quant_method, AmxLinearMethod)
    assert isinstance(model.layers[1].down_proj.quant_method, AmxLinearMethod)
    assert isinstance(model.lm_head.quant_method, AmxLinearMethod)
    g = torch.Generator().manual_seed(11)
    seq = torch.randint(3, 1024, (37,), generator=g).tolist()
    next_token = int(torch.randint(3, 1024, (1,), generator=g))
    plain_h, amx_h = PagedHarness(plain_model, 1, 48), PagedHarness(model, 1, 48)
    plain, amx = plain_h.step([(0, seq)]), amx_h.step([(0, seq)])
    plain_dec, amx_dec = plain_h.step([(0, [next_token])]), amx_h.step([(0, [next_token])])  # M = 1

    def close(a: torch.Tensor, b: torch.Tensor) -> None:
        # a few bf16 roundings (2^-8 relative each) of logits that pass through 2 layers
        assert ((a - b).abs() <= b.abs() * 2.0**-5 + 0.05).all(), (a - b).abs().max().item()
        assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9

    close(amx, plain)
    close(amx_dec, plain_dec)
    hf_bf16 = hf.to(torch.bfloat16)
    try:
        with torch.no_grad():
            ref = hf_bf16(torch.tensor([seq + [next_token]])).logits[0].float()
    finally:
        hf.to(torch.float32)
    ours, unpacked = torch.cat([amx, amx_dec]), torch.cat([plain, plain_dec])
    # bf16 logits of magnitude ~5 agree with HF to a few 1e-2; AMX's error is of F.linear's size
    assert (ours - ref).abs().max().item() <= 1.5 * (unpacked - ref).abs().max().item() + 0.02
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9
    long_seq = torch.randint(3, 1024, (AmxLinearMethod.MAX_TOKENS + 22,), generator=g).tolist()
    assert torch.equal(PagedHarness(model, 1, len(long_seq)).step([(0, long_seq)]),
                       PagedHarness(plain_model, 1, len(long_seq)).step([(0, long_seq)]))
