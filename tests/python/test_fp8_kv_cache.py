"""kv_cache_dtype="fp8" end to end on the CPU: the bundled SmolLM2-135M in float32 with an FP8 KV
cache against the same model with its float32 cache, the pool's size, prefix caching, chunked
prefill and preemption with FP8, the scales (checkpoint, calculate_kv_scales) and the errors.

Accuracy (16 prompts x 64 greedy tokens, teacher-forced on the float32 cache's sequences: every
position scored by both engines given the same tokens before it): the FP8 cache's greedy token
equals the float32 one at >= 90% of the positions and the chosen tokens' logprobs move by a
small mean amount; the test prints both figures.
"""

from __future__ import annotations

import pytest
import torch

from test_gguf_quantization import PROMPTS

torch.set_num_threads(2)

MAX_TOKENS = 64


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    from pagedllm import ops

    before = ops.get_num_threads()
    ops.set_cpu_threads(2)
    yield
    ops.set_num_threads(before)


def make_llm(model=None, **kw):
    from pagedllm import LLM

    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory_bytes", 64 << 20)
    kw.setdefault("max_model_len", 512)
    return LLM(model, **kw)


def greedy(max_tokens=MAX_TOKENS, **kw):
    from pagedllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def metric(llm, name):
    return next(m.value for m in llm.get_metrics() if m.name == "pagedllm:" + name)


@pytest.fixture(scope="module")
def accuracy():
    """Teacher-forced comparison of the FP8 cache (e4m3) with the float32 cache on the float32
    cache's greedy sequences: (positions where FP8's top token is the sequence's, positions,
    mean and max |delta logprob| of the sequence's tokens)."""
    from pagedllm import SamplingParams

    llms = {kv: make_llm(kv_cache_dtype=kv, kv_cache_memory_bytes=128 << 20) for kv in ("auto", "fp8")}
    try:
        base = llms["auto"].generate(PROMPTS, greedy(), use_tqdm=False)
        seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in base]
        starts = [len(o.prompt_token_ids) for o in base]
        forced = {kv: llm.generate([{"prompt_token_ids": s} for s in seqs],
                                   SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
                  for kv, llm in llms.items()}
        free = ids(llms["fp8"].generate(PROMPTS, greedy(), use_tqdm=False))
    finally:
        for llm in llms.values():
            llm.shutdown()
    agree = n = 0
    deltas = []
    for a, b, s, p in zip(forced["auto"], forced["fp8"], seqs, starts):
        for i in range(p, len(s)):
            assert a.prompt_logprobs[i][s[i]].rank == 1  # the float32 cache's own greedy choice
            agree += b.prompt_logprobs[i][s[i]].rank == 1
            deltas.append(abs(a.prompt_logprobs[i][s[i]].logprob - b.prompt_logprobs[i][s[i]].logprob))
            n += 1
    same_free = sum(x == y for f, o in zip(free, base) for x, y in zip(f, o.outputs[0].token_ids))
    return agree, n, sum(deltas) / n, max(deltas), same_free


@pytest.mark.slow
def test_fp8_cache_tracks_the_float32_cache(accuracy):
    agree, n, mean_delta, max_delta, same_free = accuracy
    print(f"bundled SmolLM2-135M fp32, fp8 (e4m3, scales 1.0) vs fp32 KV, 16 prompts x {MAX_TOKENS} tokens: "
          f"teacher-forced greedy tokens identical {agree}/{n} ({agree / n:.3f}), mean |dlogprob| {mean_delta:.4f} "
          f"(max {max_delta:.3f}); free-running identical positions {same_free}/{n}")
    assert n == 16 * MAX_TOKENS
    assert agree >= 0.9 * n
    # measured 0.0515 (max 1.1) on these prompts: the 3-bit mantissa's rounding (<= 6.25% of each
    # element) is all that differs (the kernels read the codes exactly and sum in float32)
    assert mean_delta <= 0.06


def test_fp8_pool_holds_more_blocks_in_the_same_bytes():
    """Same kv_cache_memory_bytes: 4x the blocks of a float32 cache, 2x those of a bfloat16 one."""
    counts = {}
    for dtype, kv in (("float32", "auto"), ("float32", "fp8"), ("bfloat16", "auto"), ("bfloat16", "fp8_e5m2")):
        llm = make_llm(dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=32 << 20)
        runner = llm.llm_engine.runner
        counts[dtype, kv] = runner.num_blocks
        cache = runner.kv_caches[0][0]
        assert cache.dtype == {"auto": getattr(torch, dtype), "fp8": torch.float8_e4m3fn,
                               "fp8_e5m2": torch.float8_e5m2}[kv]
        assert runner.num_blocks * runner.bytes_per_block <= 32 << 20
        llm.shutdown()
    # num_blocks = budget // bytes per block: the FP8 pools are the 4x / 2x up to that rounding
    assert 4 * counts["float32", "auto"] <= counts["float32", "fp8"] < 4 * (counts["float32", "auto"] + 1)
    assert 2 * counts["bfloat16", "auto"] <= counts["bfloat16", "fp8_e5m2"] < 2 * (counts["bfloat16", "auto"] + 1)


def first_mismatch_is_a_near_tie(run, reference, gap: float) -> None:
    """Each sequence of `run` equals `reference`'s, or first differs where the reference's two best
    tokens were within `gap` nats (the FP8 cache's rounding, fed different float32 roundings of the
    same K/V, may flip a near tie; a wrong block or slot would diverge anywhere)."""
    for a, b in zip(run, reference):
        a_ids, b_ids = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        t = next((i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y), None)
        if t is None:
            continue
        best = sorted((lp.logprob for lp in b.outputs[0].logprobs[t].values()), reverse=True)
        assert best[0] - best[1] <= gap, (b.prompt, t, best[:2])


def test_fp8_prefix_caching_chunked_prefill_and_preemption_give_the_same_tokens():
    """With an FP8 cache, greedy tokens do not depend on prefix caching (a second pass hits the
    cache), a small prefill budget (chunks) or preemption, up to a near tie: the K/V of a token is
    computed in batches of other shapes in each case (a prefill of the whole prompt, of its uncached
    part, of a chunk; preemption recomputes decoded tokens in a prefill), and where the CPU's float32
    GEMM sums depend on the batch's shape (AMX hosts; measured on one: a 0.044-nat tie flipped in the
    second, cache-hitting pass, while a float32 cache gave identical tokens) an FP8 code can differ.
    A wrong block or slot would diverge anywhere, not only at a near tie."""
    prefix = ("You are a helpful assistant who answers in full sentences and checks every fact twice before "
              "writing it down. Here is the next request:")  # a shared prefix of several blocks
    prompts = [prefix + " " + p for p in PROMPTS[:8]]
    runs = {}
    for name, kw in {"plain": dict(enable_prefix_caching=False),
                     "prefix": dict(enable_prefix_caching=True),
                     "chunks": dict(enable_prefix_caching=False, max_num_batched_tokens=16),
                     "preempt": dict(enable_prefix_caching=False, num_gpu_blocks_override=10)}.items():
        llm = make_llm(kv_cache_dtype="fp8", **kw)
        first = llm.generate(prompts, greedy(32, logprobs=2), use_tqdm=False)
        if name == "prefix":
            first_mismatch_is_a_near_tie(llm.generate(prompts, greedy(32, logprobs=2), use_tqdm=False), first,
                                         gap=0.25)
            assert metric(llm, "prefix_cache_hits") > 0
        if name == "chunks":
            assert metric(llm, "num_chunked_prefills") > 0
        if name == "preempt":
            assert metric(llm, "num_preemptions") > 0
        assert metric(llm, "kv_cache_usage_perc") == 0.0  # every block back
        runs[name] = first
        llm.shutdown()
    # measured (preemption): 7 of 8 identical, one first differs at a 0.10-nat tie (float32 cache: all 8)
    for name in ("prefix", "chunks", "preempt"):
        first_mismatch_is_a_near_tie(runs[name], runs["plain"], gap=0.25)


def test_checkpoint_scales_and_calculate_kv_scales(tmp_path):
    """A checkpoint's self_attn.k_scale / v_scale (and the older kv_scale) become the layers'
    scales; calculate_kv_scales sets them from the first batch (max|k| / 200, max|v| / 100: the
    largest codes in the cache are then about 200 and 100), once."""
    from safetensors.torch import load_file, save_file

    from tiny_models import build_tiny_engine_folder

    build_tiny_engine_folder("llama", tmp_path, num_hidden_layers=3)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.05)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor([0.02])
    weights["model.layers.2.self_attn.kv_scale"] = torch.tensor([0.01, 0.03])  # per head: the largest
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 2 * i))} for i in range(4)]

    llm = make_llm(str(tmp_path), kv_cache_dtype="fp8")
    attn = [layer.attn for layer in llm.llm_engine.runner.model.layers]
    assert [float(a.k_scale) for a in attn] == pytest.approx([0.05, 1.0, 0.03])
    assert [float(a.v_scale) for a in attn] == pytest.approx([0.02, 1.0, 0.03])
    llm.shutdown()
    llm = make_llm(str(tmp_path), kv_cache_dtype="auto")
    assert all(layer.attn.k_scale is None for layer in llm.llm_engine.runner.model.layers)
    llm.shutdown()

    llm = make_llm(str(tmp_path), kv_cache_dtype="fp8", calculate_kv_scales=True)
    runner = llm.llm_engine.runner
    attn = [layer.attn for layer in runner.model.layers]
    assert all(a.calculate_kv_scales for a in attn)  # armed after start-up, not set by its dummy runs
    first = ids(llm.generate(prompts, greedy(1), use_tqdm=False))  # one step: the prefill of all four
    scales = [(float(a.k_scale), float(a.v_scale)) for a in attn]
    assert not any(a.calculate_kv_scales for a in attn)
    for (key_cache, value_cache), (k, v) in zip(runner.kv_caches, scales):
        assert (k, v) != (1.0, 1.0)
        assert key_cache.float().abs().max().item() in (192.0, 208.0)  # e4m3's neighbours of 200
        assert value_cache.float().abs().max().item() in (96.0, 104.0)  # and of 100
    assert ids(llm.generate(prompts, greedy(1), use_tqdm=False)) == first
    assert [(float(a.k_scale), float(a.v_scale)) for a in attn] == scales  # only the first batch sets them
    llm.shutdown()


def test_bad_kv_cache_dtype_and_combinations_are_errors():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' is not supported: use one of \['auto', 'fp8'"):
        make_llm(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="calculate_kv_scales=True needs an FP8 KV cache"):
        make_llm(calculate_kv_scales=True)
    from pagedllm.model_executor.quantization.kv_cache import resolve_kv_cache_dtype

    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' on cuda needs the model in 'bfloat16' or "
                                         r"'float16', got dtype='float32'"):
        resolve_kv_cache_dtype("fp8", torch.float32, "cuda")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' on cuda supports head_dim up to 128, the model has 256"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, "cuda", head_dim=256)
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, "cpu", head_dim=256) is torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "cpu") is torch.bfloat16
