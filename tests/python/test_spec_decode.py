"""Speculative decoding end to end (issue 25): LLM(speculative_config={"method": "ngram", ...})
against the same engine without it — greedy output identical on the bundled model (fp32, k = 2
and 4, input-grounded prompts, so that drafts are accepted and rejected: the metrics say both);
stop strings, stop ids, max_tokens and min_tokens cutting inside accepted runs; logprobs (the
target's); penalties and logit_bias applied per verified position; seeded sampling identical with
speculation on and off (the sampler's seeded draws are counter-based: pagedllm.sample.sampler);
prefix caching, chunked prefill, preemption and n > 1 together, with no block leaked; and, on a
tiny-vocabulary model, the distribution of sampled outputs with speculation equals the one
without (chi-square homogeneity over thousands of unseeded draws)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bundled_llm import bundled_llm, chat_ids
from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode import SpeculativeConfig

ROOT = Path(__file__).resolve().parents[2]
NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4, "disable_by_batch_size": 0}


def grounded_prompts(llm, n=4):
    doc = json.loads((ROOT / "bench" / "data" / "input_grounded_prompts.json").read_text())
    return [chat_ids(llm, p["prompt"]) for p in doc["prompts"][:n]]


def spec_llm(k, **kw):
    return LLM(dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=2048,
               speculative_config={**NGRAM, "num_speculative_tokens": k}, **kw)


def spec_metrics(llm) -> dict:
    return {m.name.split(":")[-1]: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()
            if "spec_decode" in m.name}


def assert_same(a, b, logprobs=False):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.token_ids == cy.token_ids, (cx.text, cy.text)
            assert (cx.text, cx.finish_reason, cx.stop_reason) == (cy.text, cy.finish_reason, cy.stop_reason)
            if logprobs:
                assert len(cx.logprobs) == len(cy.logprobs) == len(cx.token_ids)
                for dx, dy in zip(cx.logprobs, cy.logprobs):
                    assert list(dx) == list(dy)
                    np.testing.assert_allclose([v.logprob for v in dx.values()], [v.logprob for v in dy.values()],
                                               atol=2e-4)


@pytest.fixture(scope="module")
def engines():
    plain = bundled_llm()
    spec = {k: spec_llm(k) for k in (2, 4)}
    yield plain, spec
    for llm in spec.values():
        llm.shutdown()


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_output_identical_with_ngram_speculation(engines, k):
    plain, spec = engines
    llm = spec[k]
    prompts = grounded_prompts(plain) + [chat_ids(plain, "Name three colours.")]
    params = SamplingParams(temperature=0.0, max_tokens=96)
    before = spec_metrics(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert_same(got, plain.generate(prompts, params, use_tqdm=False))
    m = spec_metrics(llm)
    drafted = m["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = m["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, (accepted, drafted)  # drafts were accepted, and some rejected
    assert len(m["spec_decode_num_accepted_tokens_per_pos"]) == k
    # several tokens per step: fewer sequence-steps than tokens
    tokens = sum(len(o.outputs[0].token_ids) for o in got)
    assert m["spec_decode_num_drafts"] - before["spec_decode_num_drafts"] < tokens


def test_stops_lengths_logprobs_and_penalties_inside_accepted_runs(engines):
    plain, spec = engines
    llm = spec[4]
    prompt = grounded_prompts(plain, 1)[0]
    ref = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=80), use_tqdm=False)[0].outputs[0]
    text, toks = ref.text, ref.token_ids
    assert len(text) > 200
    cases = [
        SamplingParams(temperature=0.0, max_tokens=80, stop=[text[100:110]]),  # a stop string mid-run
        SamplingParams(temperature=0.0, max_tokens=80, stop=[text[150:156]], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=80, stop_token_ids=[toks[41]]),
        SamplingParams(temperature=0.0, max_tokens=13),
        SamplingParams(temperature=0.0, max_tokens=17, min_tokens=9, ignore_eos=False),
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.4,
                       presence_penalty=0.2),
        SamplingParams(temperature=0.0, max_tokens=40, logit_bias={toks[5]: -5.0, toks[9]: 3.0}),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=40, seed=1234, n=2),
        SamplingParams(temperature=1.0, min_p=0.05, max_tokens=40, seed=7, repetition_penalty=1.1, logprobs=2),
    ]
    for params in cases:
        want = plain.generate([prompt], params, use_tqdm=False)
        got = llm.generate([prompt], params, use_tqdm=False)
        assert_same(got, want, logprobs=params.logprobs is not None)
        if params.stop or params.stop_token_ids:  # they cut the output short
            assert want[0].outputs[0].finish_reason == "stop" and len(want[0].outputs[0].token_ids) < 60
    assert spec_metrics(llm)["spec_decode_num_accepted_tokens"] > 0


def test_prefix_caching_chunked_prefill_preemption_and_n_with_speculation():
    plain = bundled_llm()
    prompts = grounded_prompts(plain, 6)
    params = [SamplingParams(temperature=0.0, max_tokens=64), SamplingParams(temperature=0.7, max_tokens=64, seed=3, n=2)]
    # a pool too small for six ~330-token prompts at once: preemption; a budget of 64: chunked prefill
    llm = spec_llm(3, num_gpu_blocks_override=48, max_num_batched_tokens=64, max_num_seqs=6)
    try:
        for p in params:
            for _ in range(2):  # the second pass hits the prefix cache
                got = llm.generate(prompts, p, use_tqdm=False)
                assert_same(got, plain.generate(prompts, p, use_tqdm=False))
        stats = llm.llm_engine.core.stats()
        assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0 and stats.prefix_cache_hits > 0
        assert stats.num_forks > 0 and stats.spec_decode_num_accepted_tokens > 0
        assert not llm.llm_engine.has_unfinished_requests()
        assert stats.num_free_blocks == stats.num_blocks and llm.llm_engine.core.num_kv_seqs() == 0
    finally:
        llm.shutdown()


def test_structured_output_requests_get_no_drafts_and_stay_valid(engines):
    from pagedllm.sampling_params import StructuredOutputsParams

    _, spec = engines
    llm = spec[4]
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    before = spec_metrics(llm)["spec_decode_num_drafts"]
    out = llm.generate([chat_ids(llm, "Give a person as JSON, then repeat it: {\"name\": \"Ann\", \"age\": 3}")],
                       SamplingParams(temperature=0.0, max_tokens=60,
                                      structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
    value = json.loads(out[0].outputs[0].text)
    assert set(value) == {"name", "age"}
    assert spec_metrics(llm)["spec_decode_num_drafts"] == before


# ----------------------------------------------------------------------------- distribution
V = 16


@pytest.fixture(scope="module")
def tiny_vocab_folder(tmp_path_factory):
    from pagedllm.model_executor.dummy import synthetic_tokenizer
    from tiny_models import build_tiny_model

    folder = tmp_path_factory.mktemp("tiny-vocab")
    build_tiny_model("llama", folder, seed=3, vocab_size=V)
    synthetic_tokenizer(V).save_pretrained(folder)
    return folder


def tiny_llm(folder, spec):
    return LLM(str(folder), dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=256, seed=0,
               speculative_config=spec)


def test_sampled_distribution_equals_the_target_and_seeds_match(tiny_vocab_folder):
    from scipy.stats import chi2_contingency

    prompt = {"prompt_token_ids": [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]}  # n-gram drafts from the start
    n = 3000
    runs = {}
    for name, spec in (("plain", None), ("spec", {"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                                                  "disable_by_batch_size": 0})):
        llm = tiny_llm(tiny_vocab_folder, spec)
        try:
            outs = llm.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
                                use_tqdm=False)
            seeded = llm.generate([prompt] * 200, [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True,
                                                                  seed=s) for s in range(200)], use_tqdm=False)
            runs[name] = (np.array([o.outputs[0].token_ids for o in outs]),
                          [o.outputs[0].token_ids for o in seeded], spec_metrics(llm))
        finally:
            llm.shutdown()
    plain, spec = runs["plain"][0], runs["spec"][0]
    m = runs["spec"][2]
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    for j in range(4):  # each position's token, and the (position 1, position 2) pair
        table = np.array([np.bincount(plain[:, j], minlength=V), np.bincount(spec[:, j], minlength=V)])
        table = table[:, table.sum(axis=0) > 0]
        assert chi2_contingency(table).pvalue > 1e-4, (j, table)
    pairs = [np.bincount(x[:, 1] * V + x[:, 2], minlength=V * V) for x in (plain, spec)]
    table = np.array(pairs)[:, (pairs[0] + pairs[1]) >= 10]
    assert chi2_contingency(table).pvalue > 1e-4
    # seeded requests: the same tokens with speculation on and off
    assert runs["spec"][1] == runs["plain"][1]


# ----------------------------------------------------------------------------- draft models
def perturbed_copy(src: Path, dst: Path, scale: float, seed: int = 0) -> Path:
    """A copy of the model folder `src` whose weights got Gaussian noise (scale x each tensor's std)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if t.is_floating_point() and t.numel() > 1:
                t += torch.randn(t.shape, generator=g, dtype=t.dtype) * (scale * float(t.float().std()))
        save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random Llama (1024 ids, synthetic tokenizer) and a perturbed copy of it as its draft."""
    from tiny_models import build_tiny_engine_folder

    root = tmp_path_factory.mktemp("draft-pair")
    target = build_tiny_engine_folder("llama", root / "target", seed=7)
    return target, perturbed_copy(target, root / "draft", 0.35)


def test_bundled_model_drafting_for_itself_accepts_everything(engines):
    plain, _ = engines
    llm = LLM(dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=2048,
              speculative_config={"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "num_speculative_tokens": 3,
                                  "disable_by_batch_size": 0})
    try:
        prompts = grounded_prompts(plain, 2) + [chat_ids(plain, "Name three colours.")]
        params = SamplingParams(temperature=0.0, max_tokens=40)
        assert_same(llm.generate(prompts, params, use_tqdm=False), plain.generate(prompts, params, use_tqdm=False))
        m = spec_metrics(llm)
        assert m["spec_decode_num_draft_tokens"] > 0
        # the same model proposes what the target samples (up to rounding between the two paths)
        assert m["spec_decode_num_accepted_tokens"] >= 0.95 * m["spec_decode_num_draft_tokens"]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft_kw", [{}, {"dtype": "bfloat16"}, {"dtype": "bfloat16", "quantization": "int8"}])
def test_perturbed_draft_model_output_identical_with_rejections(tiny_pair, draft_kw):
    target, draft = tiny_pair
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(3, 1000, size=int(n)).tolist()} for n in (5, 17, 33, 64, 9, 21)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=40, max_tokens=40, ignore_eos=True, seed=5, n=2),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.2, logprobs=2,
                             stop_token_ids=[17])]
    outs = {}
    for name, spec in (("plain", None), ("draft", {"model": str(draft), "num_speculative_tokens": 3,
                                                    "disable_by_batch_size": 0, **draft_kw})):
        # a small pool (preemption) and budget (chunked prefill); prompts repeat: prefix caching
        llm = LLM(str(target), dtype="float32", num_gpu_blocks_override=24, max_num_batched_tokens=32,
                  max_model_len=256, speculative_config=spec)
        try:
            outs[name] = [llm.generate(prompts + prompts[:2], p, use_tqdm=False) for p in params]
            if spec:
                m = spec_metrics(llm)
                assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
                stats = llm.llm_engine.core.stats()
                assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0 and stats.prefix_cache_hits > 0
                assert stats.num_free_blocks == stats.num_blocks
        finally:
            llm.shutdown()
    for got, want, p in zip(outs["draft"], outs["plain"], params):
        assert_same(got, want, logprobs=p.logprobs is not None)


def test_draft_model_sampled_distribution_equals_the_target(tiny_vocab_folder, tmp_path):
    from scipy.stats import chi2_contingency

    draft = perturbed_copy(tiny_vocab_folder, tmp_path / "draft", 0.5)
    prompt = {"prompt_token_ids": [3, 4, 5, 6, 7, 8]}
    runs = {}
    for name, spec in (("plain", None), ("draft", {"model": str(draft), "num_speculative_tokens": 2,
                                                    "disable_by_batch_size": 0})):
        llm = tiny_llm(tiny_vocab_folder, spec)
        try:
            outs = llm.generate([prompt] * 2000, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
                                use_tqdm=False)
            runs[name] = (np.array([o.outputs[0].token_ids for o in outs]), spec_metrics(llm))
        finally:
            llm.shutdown()
    m = runs["draft"][1]
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    for j in range(3):
        table = np.array([np.bincount(runs[k][0][:, j], minlength=V) for k in ("plain", "draft")])
        table = table[:, table.sum(axis=0) > 0]
        assert chi2_contingency(table).pvalue > 1e-4, (j, table)


def test_bad_draft_models_are_named(tiny_pair, tiny_vocab_folder):
    target, _ = tiny_pair
    with pytest.raises(ValueError, match="vocab_size 16 differs"):
        LLM(str(target), dtype="float32", speculative_config={"model": str(tiny_vocab_folder),
                                                               "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="async_scheduling=True"):
        LLM(str(target), dtype="float32", async_scheduling=True,
            speculative_config={"model": str(target), "num_speculative_tokens": 2})


# ----------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("value, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle' is not supported"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ({"method": "ngram", "model": "/x", "num_speculative_tokens": 2}, "takes no model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}, "draft model"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"\[1, 64\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 2.5}, "synthetic_acceptance_length"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "unsupported key"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_config_is_a_value_error_naming_it(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_user(value)


def test_speculative_config_defaults_and_json():
    c = SpeculativeConfig.from_user('{"method": "ngram", "num_speculative_tokens": 3}', "cpu")
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.accept_all) == (5, 5, False)  # vLLM's defaults
    c = SpeculativeConfig.from_user({"num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                     "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max, c.accept_all) == ("ngram", 3, 3, True)
    assert SpeculativeConfig.from_user(None) is None and SpeculativeConfig.from_user({}) is None


def test_speculation_under_async_scheduling():
    """Pipelined steps above disable_by_batch_size, speculating steps below it: the same tokens."""
    plain = bundled_llm()
    prompts = grounded_prompts(plain, 4)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    llm = LLM(dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=2048, async_scheduling=True,
              speculative_config={**NGRAM, "num_speculative_tokens": 3, "disable_by_batch_size": 3})
    try:
        assert llm.llm_engine.async_scheduling
        # staggered lengths: 4, then 3, 2, 1 sequences run (pipelined, then speculating)
        per = [SamplingParams(temperature=0.0, max_tokens=24 + 8 * i) for i in range(4)]
        assert_same(llm.generate(prompts, per, use_tqdm=False), plain.generate(prompts, per, use_tqdm=False))
        assert_same(llm.generate(prompts[:1], params, use_tqdm=False), plain.generate(prompts[:1], params, use_tqdm=False))
        assert spec_metrics(llm)["spec_decode_num_accepted_tokens"] > 0
        stats = llm.llm_engine.core.stats()
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        llm.shutdown()


def test_metrics_export_the_per_position_vector():
    from prometheus_client import generate_latest

    from pagedllm.entrypoints.openai.metrics import make_registry
    from pagedllm.metrics import Counter, Vector

    text = generate_latest(make_registry(lambda: [
        Counter("pagedllm:spec_decode_num_drafts", {"model_name": "m"}, 5),
        Vector("pagedllm:spec_decode_num_accepted_tokens_per_pos", {"model_name": "m"}, [4, 2, 1])])).decode()
    assert 'pagedllm:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    for pos, v in enumerate([4, 2, 1]):
        assert f'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{pos}"}} {v}.0' in text


@pytest.mark.cuda
def test_cuda_greedy_and_seeded_output_identical_with_speculation(tmp_path):
    """On the GPU (decode steps and verification steps in CUDA graphs, async scheduling on: steps
    that speculate are not pipelined), and with enforce_eager: the same tokens."""
    from tiny_models import build_tiny_engine_folder

    folder = build_tiny_engine_folder("llama", tmp_path / "m", seed=5)
    rng = np.random.default_rng(0)
    prompts = []
    for i in range(6):
        motif = rng.integers(3, 1000, size=int(rng.integers(3, 9))).tolist()
        prompts.append({"prompt_token_ids": (motif * 12)[: 20 + 7 * i]})
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=48, ignore_eos=True, seed=11)]
    outs = {}
    spec = {**NGRAM, "num_speculative_tokens": 4, "disable_by_batch_size": 8}
    draft = {"model": str(perturbed_copy(folder, tmp_path / "draft", 0.3)), "num_speculative_tokens": 3,
             "disable_by_batch_size": 8}
    for name, kw in (("plain", {}), ("spec", dict(speculative_config=spec)),
                     ("spec_eager", dict(speculative_config=spec, enforce_eager=True)),
                     ("draft", dict(speculative_config=draft))):
        llm = LLM(str(folder), dtype="float32", device="cuda", kv_cache_memory_bytes=256 << 20, max_model_len=512,
                  **kw)
        try:
            outs[name] = [[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in params]
            outs[name].append([o.outputs[0].token_ids for o in llm.generate(prompts[:1], params[0], use_tqdm=False)])
            if kw:
                assert spec_metrics(llm)["spec_decode_num_accepted_tokens"] > 0
                verify = llm.llm_engine.runner.verify_graphs
                assert (verify is None) == ("enforce_eager" in kw)
                if verify is not None:
                    assert verify.num_replays > 0 and verify.sizes == [1, 2, 4, 7]
                    assert verify.q == 1 + kw["speculative_config"]["num_speculative_tokens"]
                if name == "draft":  # its decode passes in the draft's own graphs
                    assert llm.llm_engine.proposer.runner.num_graph_replays > 0
        finally:
            llm.shutdown()
    assert outs["spec"] == outs["plain"] and outs["spec_eager"] == outs["plain"] and outs["draft"] == outs["plain"]


def test_serve_takes_speculative_config_json():
    import argparse

    from pagedllm.entrypoints.openai.api_server import add_server_args
    from pagedllm.entrypoints.openai.cli_args import engine_args_from

    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args(["--speculative-config", text])
    engine_args = engine_args_from(args)
    assert engine_args.speculative_config == text
    c = SpeculativeConfig.from_user(engine_args.speculative_config)
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 3, 3)
