"""kv_cache_dtype="fp8" end to end on CUDA (marker `cuda`): the Llama-3-8B shape (random weights,
load_format="dummy") and a small random Llama in bfloat16, FP8 (e4m3) KV against bfloat16 KV,
teacher-forced: the bfloat16 cache's greedy sequences scored by both engines (prompt_logprobs,
the prefill kernel) and decoded by both (CUDA graphs, the decode kernel and the fused cache
writers). Prefix caching and preemption with FP8 KV against a plain FP8 run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 2048
SMALL = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512, intermediate_size=1024,
             num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=VOCAB,
             max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
             bos_token_id=None, eos_token_id=None, initializer_range=0.05)


def _llm(folder, **kw):
    from pagedllm import LLM

    kw.setdefault("max_num_seqs", 32)
    kw.setdefault("max_model_len", 512)
    kw.setdefault("kv_cache_memory_bytes", 256 << 20)
    return LLM(str(folder), dtype="bfloat16", device="cuda", seed=0, **kw)


def _greedy(n, **kw):
    from pagedllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _prompts(n=16, seed=1, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(8, 120, (n,), generator=g)]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.model_executor.dummy import synthetic_tokenizer

    folder = tmp_path_factory.mktemp("fp8_kv_llama")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in SMALL.items() if k != "architectures"}))
    model.save_pretrained(folder)
    synthetic_tokenizer(VOCAB).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama3_8b_shape(tmp_path_factory):
    """The Llama-3-8B shape (bench/throughput_gpu.py SHAPES) as a config-only folder (dummy weights)."""
    from pagedllm.model_executor.dummy import synthetic_tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from throughput_gpu import SHAPES

    folder = tmp_path_factory.mktemp("fp8_kv_llama3_8b")
    cfg = dict(SHAPES["llama3-8b"], vocab_size=VOCAB, bos_token_id=None, eos_token_id=None)
    (folder / "config.json").write_text(json.dumps(cfg))
    synthetic_tokenizer(VOCAB).save_pretrained(folder)
    return folder


def teacher_forced(folder, tokens=64, **kw):
    """The bfloat16 cache's greedy sequences scored and decoded with an FP8 cache: (positions where the
    FP8 run's top token is the sequence's (prefill scoring), positions, mean and max |delta logprob|
    of the sequence's tokens, positions where the FP8 run decodes the same greedy token)."""
    from pagedllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    base = _llm(folder, kv_cache_dtype="auto", **kw)
    ref = base.generate(prompts, _greedy(tokens, logprobs=1), use_tqdm=False)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in ref]
    starts = [len(o.prompt_token_ids) for o in ref]
    scored = {"auto": base.generate([{"prompt_token_ids": s} for s in seqs],
                                    SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)}
    base.shutdown()
    fp8 = _llm(folder, kv_cache_dtype="fp8", **kw)
    scored["fp8"] = fp8.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=1),
                                 use_tqdm=False)
    decoded = fp8.generate(prompts, _greedy(tokens), use_tqdm=False)
    replays = {m.name: m for m in fp8.get_metrics()}["pagedllm:cuda_graph_replays"].value
    fp8.shutdown()
    agree = n = 0
    deltas = []
    for a, b, s, p in zip(scored["auto"], scored["fp8"], seqs, starts):
        for i in range(p, len(s)):
            agree += b.prompt_logprobs[i][s[i]].rank == 1
            deltas.append(abs(a.prompt_logprobs[i][s[i]].logprob - b.prompt_logprobs[i][s[i]].logprob))
            n += 1
    same = sum(x == y for d, r in zip(decoded, ref) for x, y in zip(d.outputs[0].token_ids, r.outputs[0].token_ids))
    assert replays > 0  # the FP8 decode steps ran in CUDA graphs
    return agree, n, sum(deltas) / n, max(deltas), same


@pytest.mark.parametrize("which", ["small", "llama3-8b"])
def test_fp8_kv_tracks_bf16_kv_teacher_forced(which, request):
    folder = request.getfixturevalue("small_model" if which == "small" else "llama3_8b_shape")
    kw = {} if which == "small" else dict(load_format="dummy", kv_cache_memory_bytes=2 << 30)
    agree, n, mean_delta, max_delta, same = teacher_forced(folder, **kw)
    print(f"{which} bf16, fp8 (e4m3) vs bf16 KV, 16 prompts x 64 tokens, teacher-forced: greedy identical "
          f"{agree}/{n} ({agree / n:.3f}), mean |dlogprob| {mean_delta:.4f} (max {max_delta:.3f}); free-running "
          f"decode identical positions {same}/{n}")
    assert agree >= 0.9 * n
    assert mean_delta <= 0.05


def test_fp8_prefix_caching_and_preemption(small_model):
    prefix = _prompts(1, seed=7)[0] + _prompts(1, seed=8)[0]  # a shared prefix of several blocks
    prompts = [{"prompt_token_ids": prefix + p} for p in _prompts(8)]
    runs = {}
    for name, kw in {"plain": dict(enable_prefix_caching=False),
                     "prefix": dict(enable_prefix_caching=True),
                     "preempt": dict(enable_prefix_caching=False, num_gpu_blocks_override=24)}.items():
        llm = _llm(small_model, kv_cache_dtype="fp8", **kw)
        first = llm.generate(prompts, _greedy(32, logprobs=2), use_tqdm=False)
        metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        if name == "prefix":
            again = llm.generate(prompts, _greedy(32), use_tqdm=False)
            assert [a.outputs[0].token_ids for a in again] == [f.outputs[0].token_ids for f in first]
            assert metrics["pagedllm:prefix_cache_hits"] > 0 or \
                {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}["pagedllm:prefix_cache_hits"] > 0
        if name == "preempt":
            assert metrics["pagedllm:num_preemptions"] > 0
        runs[name] = first
        llm.shutdown()
    for name in ("prefix", "preempt"):  # identical, or first different at a near tie (fp8 rounding)
        for a, b in zip(runs[name], runs["plain"]):
            x, y = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
            t = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
            if t is not None:
                best = sorted((lp.logprob for lp in b.outputs[0].logprobs[t].values()), reverse=True)
                assert best[0] - best[1] <= 0.25, (name, t, best[:2])
