"""The whole engine on CUDA (marker `cuda`; deselected where no GPU is present).

Random-weight Llama models are built on the GPU with Hugging Face transformers, saved, and served
by pagedllm on the same GPU; HF is the reference:
- teacher-forced: HF's greedy sequence scored by both (pagedllm through prompt_logprobs: the
  prefill path), and pagedllm's greedy sequence (decode steps, CUDA graphs) scored by HF;
  per-position logprobs agree within 0.05 in bf16;
- greedy tokens identical to HF's in fp32;
- CUDA graphs against eager (same tokens and logprobs; replays > 0 only with graphs);
- prefix caching and preemption give the same tokens as a plain run;
- async scheduling (the CUDA default: placeholders filled on the device, one graph per step) gives
  the tokens of synchronous scheduling, with graphs and eager, early stops and seeded sampling;
- load_format="dummy" on a config-only folder, KV pool sized by profiling or kv_cache_memory_bytes.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 2048
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=VOCAB,
              max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, initializer_range=0.05)


def _llm(folder, dtype, **kw):
    from pagedllm import LLM

    kw.setdefault("max_num_seqs", 32)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("kv_cache_memory_bytes", 64 << 20)
    return LLM(str(folder), dtype=dtype, device="cuda", seed=0, **kw)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(folder, HF model in fp32 on the GPU): random weights drawn on the GPU, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.model_executor.dummy import synthetic_tokenizer

    folder = tmp_path_factory.mktemp("gpu_llama")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"}))
    model.eval()
    model.save_pretrained(folder)
    synthetic_tokenizer(VOCAB).save_pretrained(folder)
    return folder, model


def _prompts(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 17, 33, 64, 9, 40, 23, 50][:n]
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lens]


@torch.inference_mode()
def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def _hf_logprobs(model, seq):
    """float32 [len(seq) - 1]: log p(seq[i + 1] | seq[:i + 1])."""
    ids = torch.tensor([seq], device="cuda")
    lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return lp[:-1].gather(1, ids[0, 1:, None])[:, 0].cpu()


def _greedy(n, **kw):
    from pagedllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _metric(llm, name):
    return {m.name: m for m in llm.get_metrics()}[name].value


def test_bf16_teacher_forced_logprobs_match_hf(hf_model):
    folder, model = hf_model
    hf16 = copy.deepcopy(model).to(torch.bfloat16)
    llm = _llm(folder, "bfloat16")
    prompts = _prompts()
    # (a) HF's greedy continuation scored by pagedllm's prefill (prompt_logprobs).
    seqs = [p + _hf_greedy(hf16, p, 12) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], _greedy(1, prompt_logprobs=0), use_tqdm=False)
    worst = 0.0
    for seq, out in zip(seqs, outs):
        ours = torch.tensor([out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(seq) if i > 0])
        worst = max(worst, float((ours - _hf_logprobs(hf16, seq)).abs().max()))
    assert worst < 0.05, f"prefill logprobs differ from HF by {worst}"
    # (b) pagedllm's greedy decode (CUDA graphs) scored by HF.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(16, logprobs=0), use_tqdm=False)
    worst = 0.0
    for p, out in zip(prompts, outs):
        o = out.outputs[0]
        ours = torch.tensor([lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)])
        theirs = _hf_logprobs(hf16, p + list(o.token_ids))[len(p) - 1:]
        worst = max(worst, float((ours - theirs).abs().max()))
    assert worst < 0.05, f"decode logprobs differ from HF by {worst}"
    assert _metric(llm, "pagedllm:cuda_graph_replays") > 0
    llm.shutdown()


def test_fp32_greedy_tokens_equal_hf(hf_model):
    folder, model = hf_model
    llm = _llm(folder, "float32")
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(24), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == _hf_greedy(model, p, 24)
    assert _metric(llm, "pagedllm:cuda_graph_replays") > 0
    llm.shutdown()


def test_cuda_graphs_match_eager(hf_model):
    folder, _ = hf_model
    prompts = _prompts(8, seed=2)
    results = {}
    for eager in (True, False):
        llm = _llm(folder, "float32", enforce_eager=eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(20, logprobs=2), use_tqdm=False)
        results[eager] = ([list(o.outputs[0].token_ids) for o in outs],
                          [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                           for o in outs],
                          _metric(llm, "pagedllm:cuda_graph_replays"))
        llm.shutdown()
    assert results[True][2] == 0
    assert results[False][2] > 0
    assert results[True][0] == results[False][0]
    diff = max(abs(a - b) for x, y in zip(results[True][1], results[False][1]) for a, b in zip(x, y))
    assert diff < 1e-4


def test_segmented_graphs_match_eager(tmp_path):
    """A 9-layer model without async scheduling: decode graphs are captured as three segments
    (layers [0,1), [1,4), [4,9)); sizes <= PER_SIZE_HANDOVER_MAX keep their hand-over states,
    larger ones copy them through shared buffers. Both kinds, with padding rows, give the eager
    run's greedy tokens and logprobs (fp32)."""
    from pagedllm.model_executor.dummy import synthetic_tokenizer
    from pagedllm.worker.cuda_graph import PER_SIZE_HANDOVER_MAX, segment_bounds

    cfg = dict(CONFIG, num_hidden_layers=9)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    synthetic_tokenizer(VOCAB).save_pretrained(tmp_path)
    assert segment_bounds(9) == [0, 1, 4, 9] and segment_bounds(7) == [0, 7]
    assert segment_bounds(9, segmented=False) == [0, 9]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 40, (PER_SIZE_HANDOVER_MAX + 6,), generator=g)]
    runs = {}
    for eager in (True, False):
        llm = _llm(tmp_path, "float32", enforce_eager=eager, load_format="dummy",
                   max_num_seqs=PER_SIZE_HANDOVER_MAX + 16, kv_cache_memory_bytes=256 << 20, async_scheduling=False)
        if not eager:
            graphs = llm.llm_engine.runner.graphs
            assert len(graphs._graphs[1]) == 3 and len(graphs._graphs[graphs.max_size]) == 3
            assert graphs._handover is not None and graphs.max_size > PER_SIZE_HANDOVER_MAX
        few = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], _greedy(12, logprobs=1), use_tqdm=False)
        many = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(4, logprobs=1), use_tqdm=False)
        runs[eager] = [([list(c.token_ids) for c in o.outputs],
                        [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                       for o in few + many]
        runs[(eager, "replays")] = _metric(llm, "pagedllm:cuda_graph_replays")
        llm.shutdown()
    assert runs[(True, "replays")] == 0 and runs[(False, "replays")] > 0
    assert [t for t, _ in runs[True]] == [t for t, _ in runs[False]]
    diff = max(abs(a - b) for (_, x), (_, y) in zip(runs[True], runs[False]) for a, b in zip(x, y))
    assert diff < 1e-4


def test_async_scheduling_matches_sync(hf_model):
    """fp32, graphs and eager: async scheduling (placeholder ids filled on the device from the
    previous step's sampled ids) gives the tokens and logprobs of synchronous scheduling — greedy
    rows that stop early on stop ids (wasted placeholder rows), seeded sampling with n = 2, batch
    sizes between the captured ones."""
    from pagedllm import SamplingParams

    folder, _ = hf_model
    prompts = _prompts(8, seed=9)
    stops = list(range(7, VOCAB, 9))  # ~1 token in 9 ends a greedy row early
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=stops, logprobs=1) if i % 2 == 0
              else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=24, ignore_eos=True, n=2)
              for i in range(8)]
    runs = {}
    for eager in (False, True):
        for async_sched in (False, True):
            llm = _llm(folder, "float32", enforce_eager=eager, async_scheduling=async_sched)
            engine = llm.llm_engine
            assert engine.async_scheduling is async_sched
            if not eager:
                assert engine.runner.graphs.placeholders is async_sched
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            runs[(eager, async_sched)] = (
                [[list(c.token_ids) for c in o.outputs] for o in outs],
                [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                 for o in outs[::2]])
            assert engine.core.stats().kv_usage == 0.0 and engine.core.num_outputs_held == 0
            if not eager:
                assert _metric(llm, "pagedllm:cuda_graph_replays") > 0
            llm.shutdown()
    ref_tokens, ref_lp = runs[(False, False)]
    assert any(len(t[0]) < 40 for t in ref_tokens[::2])  # some greedy rows stopped early
    for key, (tokens, lps) in runs.items():
        assert tokens == ref_tokens, key
        assert max(abs(a - b) for x, y in zip(lps, ref_lp) for a, b in zip(x, y)) < 1e-4, key


def test_graph_batch_padding_and_sampling_on_gpu(hf_model):
    """Batch sizes between the captured ones (padding rows), n > 1 (repeated logits rows) and seeded
    random sampling: graph and eager runs agree token for token."""
    from pagedllm import SamplingParams

    folder, _ = hf_model
    prompts = _prompts(5, seed=3)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=10, ignore_eos=True, n=1 + i % 2)
              for i in range(5)]
    runs = []
    for eager in (True, False):
        llm = _llm(folder, "float32", enforce_eager=eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([[list(c.token_ids) for c in o.outputs] for o in outs])
        llm.shutdown()
    assert runs[0] == runs[1]
    assert all(len(c) == 10 for o in runs[1] for c in o)


def test_prefix_caching_identical(hf_model):
    folder, _ = hf_model
    shared = _prompts(1, seed=4)[0] * 4  # 20 tokens: one full block of 16 shared
    g = torch.Generator().manual_seed(5)
    prompts = [shared + torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in (3, 7, 12, 30)]
    runs = {}
    for caching in (False, True):
        llm = _llm(folder, "float32", enable_prefix_caching=caching)
        llm.generate([{"prompt_token_ids": prompts[0]}], _greedy(4), use_tqdm=False)  # fills the cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(16), use_tqdm=False)
        runs[caching] = ([list(o.outputs[0].token_ids) for o in outs], _metric(llm, "pagedllm:prefix_cache_hits"))
        llm.shutdown()
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] > 0 and runs[False][1] == 0


def test_preemption_identical(hf_model):
    folder, _ = hf_model
    prompts = _prompts(8, seed=6)
    runs = {}
    for blocks in (None, 24):  # 24 blocks of 16 tokens cannot hold 8 sequences of up to 100 tokens
        llm = _llm(folder, "float32", num_gpu_blocks_override=blocks)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(48), use_tqdm=False)
        runs[blocks] = ([list(o.outputs[0].token_ids) for o in outs], _metric(llm, "pagedllm:num_preemptions"))
        llm.shutdown()
    assert runs[24][0] == runs[None][0]
    assert runs[24][1] > 0


def test_dummy_weights_config_only_folder(tmp_path):
    cfg = dict(CONFIG, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=8, head_dim=128, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from pagedllm import LLM

    llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", max_model_len=128, max_num_seqs=16,
              gpu_memory_utilization=0.5)
    runner = llm.llm_engine.runner
    assert runner.device.type == "cuda"  # device="auto" picked CUDA
    assert all(p.is_cuda for p in runner.model.parameters())
    assert runner.kv_caches[0][0].is_cuda and runner.kv_caches[0][0].dtype == torch.bfloat16
    free, total = torch.cuda.mem_get_info()
    assert runner.num_blocks * runner.bytes_per_block > 0.2 * total  # sized from gpu_memory_utilization
    assert runner.num_blocks * runner.bytes_per_block < 0.5 * total
    assert {"load_weights", "profile_run", "allocate_kv_cache", "capture_cuda_graphs"} <= set(runner.phase_seconds)
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 3, _greedy(8), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 and max(o.outputs[0].token_ids) < 1000 for o in outs)
    assert outs[0].outputs[0].text.startswith("<")  # the synthetic tokenizer's "<id>" words
    llm.shutdown()
    llm = LLM(str(tmp_path), load_format="dummy", dtype="float16", max_model_len=128, kv_cache_memory_bytes=8 << 20,
              enforce_eager=True)
    runner = llm.llm_engine.runner
    assert runner.num_blocks == (8 << 20) // runner.bytes_per_block and runner.graphs is None
    outs = llm.generate([{"prompt_token_ids": [4, 5]}], _greedy(4), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4
    llm.shutdown()
