"""Beam search in the native engine (LLM.beam_search, SamplingParams(use_beam_search=True)).

- Hugging Face parity: generate(num_beams=W, do_sample=False, num_return_sequences=W,
  length_penalty, early_stopping=False) in fp32 returns the same W hypotheses, token for token, in
  the same order, with sequences_scores within 1e-4: the bundled SmolLM2 (8 prompts, W = 2, 4
  and 8, 32 tokens) and a random tiny model of every architecture (and on CUDA: marker cuda).
- Block accounting (from the engine's KV stats after every step): a group holds at most
  ceil(prompt / block_size) + W x (ceil(generated / block_size) + 1) blocks; after the request,
  after an abort mid-search, every block is free (or cached) and no sequence holds KV.
- The group under pressure: preemption of whole groups (a pool too small for all of them),
  chunked prefill of the prompt and of the replays, prefix caching on and off, plain requests in
  the same batch: every hypothesis identical to the request run alone.
- Bad input: ValueError naming the field; the engine keeps serving.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from llm_reference import bundled_folder, bundled_prompt_ids  # noqa: E402
from tiny_models import TINY_CONFIGS, build_tiny_engine_folder  # noqa: E402

MAX_TOKENS = 32


@pytest.fixture(autouse=True, scope="module")
def _threads():
    from pagedllm import ops

    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    ops.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def hf_beams(model, prompt, width, max_new_tokens, eos, length_penalty=1.0):
    """HF beam search on one prompt: [(generated tokens cut after the first EOS, score)] best first."""
    from transformers import GenerationConfig

    gc = GenerationConfig(num_beams=width, do_sample=False, max_new_tokens=max_new_tokens,
                          num_return_sequences=width, eos_token_id=list(eos), pad_token_id=eos[0],
                          length_penalty=length_penalty, early_stopping=False, return_dict_in_generate=True,
                          output_scores=True)
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        r = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    out = []
    for i in range(width):
        seq = r.sequences[i, len(prompt):].tolist()
        cut = next((j + 1 for j, t in enumerate(seq) if t in eos), len(seq))
        out.append((seq[:cut], float(r.sequences_scores[i])))
    return out


def check_same(mine, reference, prompt):
    """BeamSearchOutput vs hf_beams' list: same hypotheses in order, scores within 1e-4."""
    assert len(mine.sequences) == len(reference)
    for seq, (tokens, score) in zip(mine.sequences, reference):
        assert seq.tokens[: len(prompt)] == list(prompt)
        assert seq.tokens[len(prompt):] == tokens
        assert abs(seq.score - score) < 1e-4, (seq.score, score)


@pytest.fixture(scope="module")
def bundled():
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM

    llm = LLM(dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=2048)
    hf = AutoModelForCausalLM.from_pretrained(str(bundled_folder()), dtype=torch.float32).eval()
    yield llm, hf
    llm.shutdown()


@pytest.mark.parametrize("width,length_penalty", [(2, 1.0), (4, 0.6), (8, 1.0)])
def test_bundled_model_matches_hugging_face(bundled, width, length_penalty):
    from pagedllm import BeamSearchParams

    llm, hf = bundled
    eos = llm.llm_engine.eos_token_ids
    prompts = [list(p) for p in bundled_prompt_ids()[:8]]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=length_penalty))
    stopped = 0
    for prompt, out in zip(prompts, outs):
        check_same(out, hf_beams(hf, prompt, width, MAX_TOKENS, eos, length_penalty), prompt)
        for seq in out.sequences:
            generated = seq.tokens[len(prompt):]
            assert seq.finish_reason == ("stop" if generated[-1] in eos else "length")
            assert seq.score == pytest.approx(seq.cum_logprob / len(generated) ** length_penalty)
            stopped += seq.finish_reason == "stop"
            # text: prompt and output decoded, the EOS token's text left out
            shown = seq.tokens[:-1] if seq.finish_reason == "stop" else seq.tokens
            assert seq.text == llm.get_tokenizer().decode(shown, skip_special_tokens=True)
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
    assert stopped > 0  # some hypotheses ended with EOS, some by length: both paths are compared


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_tiny_models_match_hugging_face(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, BeamSearchParams

    folder = build_tiny_engine_folder(arch, tmp_path / arch, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    try:
        rng = random.Random(7)
        prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in (5, 12, 17)]
        eos = llm.llm_engine.eos_token_ids
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=16))
        for prompt, out in zip(prompts, outs):
            check_same(out, hf_beams(hf, prompt, 3, 16, eos), prompt)
    finally:
        llm.shutdown()


# ------------------------------------------------------------------ engine-level behaviour
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_engine_folder("llama", tmp_path_factory.mktemp("beam") / "llama", seed=3)


def tiny_llm(folder, **kw):
    from pagedllm import LLM

    kw.setdefault("kv_cache_memory_bytes", 32 << 20)
    return LLM(str(folder), dtype="float32", max_model_len=256, **kw)


def beam_params(width, max_tokens=24, **kw):
    from pagedllm import SamplingParams

    return SamplingParams(n=width, use_beam_search=True, temperature=0.0, max_tokens=max_tokens, **kw)


def run_engine(engine, requests, check_blocks=None, abort_after=None):
    """Add [(request_id, prompt, params)], step to the end; returns {request_id: RequestOutput}.
    check_blocks(engine) runs after every step; abort_after = (request_id, steps)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, None, prompt, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if check_blocks is not None:
            check_blocks(engine)
        if abort_after is not None and steps == abort_after[1] and engine.has_request(abort_after[0]):
            engine.abort_request(abort_after[0])
        assert steps < 10_000
    return done


def test_block_accounting_and_nothing_leaked(tiny_folder):
    llm = tiny_llm(tiny_folder, enable_prefix_caching=False)
    engine = llm.llm_engine
    try:
        width, prompt = 4, list(range(10, 47))  # 37 tokens: 3 blocks, the last partly filled
        stats = engine.core.stats()
        bs, total = stats.block_size, stats.num_blocks
        seen = []

        def check(engine):
            s = engine.core.stats()
            held = total - s.num_free_blocks
            seq = engine.core.stats()  # (generated so far: the engine's generation-token count / width)
            generated = seq.num_generation_tokens // width
            bound = math.ceil(len(prompt) / bs) + width * (math.ceil(generated / bs) + 1)
            seen.append(held)
            assert held <= bound, (held, bound, generated)

        done = run_engine(engine, [("b", prompt, beam_params(width, max_tokens=40, ignore_eos=True))], check)
        out = done["b"]
        assert len(out.outputs) == width and all(len(c.token_ids) == 40 for c in out.outputs)
        # the beams share the prompt: far fewer blocks than W separate sequences would hold
        assert max(seen) < width * math.ceil((len(prompt) + 40) / bs)
        assert engine.core.num_kv_seqs() == 0 and engine.core.stats().num_free_blocks == total
        assert engine.core.stats().num_forks >= width - 1

        # abort in the middle of the search: nothing leaked, the engine keeps serving
        run_engine(engine, [("a", prompt, beam_params(width, max_tokens=40)), ("p", prompt, beam_params(1))],
                   abort_after=("a", 5))
        assert engine.core.num_kv_seqs() == 0 and engine.core.stats().num_free_blocks == total
        again = run_engine(engine, [("b2", prompt, beam_params(width, max_tokens=40, ignore_eos=True))])
        assert [c.token_ids for c in again["b2"].outputs] == [c.token_ids for c in out.outputs]
    finally:
        llm.shutdown()


def _requests():
    rng = random.Random(11)
    reqs = []
    for i in range(5):
        prompt = [rng.randrange(3, 1024) for _ in range(rng.randrange(6, 40))]
        reqs.append((f"beam{i}", prompt, beam_params(2 + i % 3, max_tokens=20 + 4 * i, ignore_eos=i % 2 == 0)))
    for i in range(3):  # plain requests beside the groups
        from pagedllm import SamplingParams

        prompt = [rng.randrange(3, 1024) for _ in range(20)]
        reqs.append((f"plain{i}", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)))
    return reqs


def _tokens(done):
    return {rid: [(list(c.token_ids), c.cumulative_logprob) for c in out.outputs] for rid, out in done.items()}


def assert_same(got, want):
    """Same requests, same hypotheses token for token, cumulative logprobs within 1e-4."""
    assert sorted(got) == sorted(want)
    for rid in want:
        assert [t for t, _ in got[rid]] == [t for t, _ in want[rid]], rid
        for (_, a), (_, b) in zip(got[rid], want[rid]):
            assert (a is None and b is None) or abs(a - b) < 1e-4, (rid, a, b)


@pytest.fixture(scope="module")
def alone(tiny_folder):
    """Each request of _requests() run by itself in a roomy engine."""
    llm = tiny_llm(tiny_folder)
    try:
        result = {}
        for req in _requests():
            result.update(_tokens(run_engine(llm.llm_engine, [req])))
        return result
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw", [
    dict(num_gpu_blocks_override=30),  # preemption of whole groups
    dict(num_gpu_blocks_override=30, enable_prefix_caching=False),
    dict(max_num_batched_tokens=16),  # chunked prompts (and replays)
    dict(num_gpu_blocks_override=30, max_num_batched_tokens=16, max_num_seqs=8),
], ids=["preempt", "preempt-no-prefix-cache", "chunked", "preempt-chunked-few-seqs"])
def test_same_hypotheses_under_pressure(tiny_folder, alone, kw):
    llm = tiny_llm(tiny_folder, **kw)
    engine = llm.llm_engine
    try:
        done = run_engine(engine, _requests())
        assert_same(_tokens(done), alone)
        stats = engine.core.stats()
        if "num_gpu_blocks_override" in kw and "max_num_seqs" not in kw:
            assert stats.num_preemptions > 0  # the pool really was too small for everything at once
        if "max_num_batched_tokens" in kw:
            assert stats.num_chunked_prefills > 0
        assert engine.core.num_kv_seqs() == 0 and stats.num_free_blocks == stats.num_blocks
    finally:
        llm.shutdown()


def test_prefix_cache_shared_across_groups(tiny_folder):
    llm = tiny_llm(tiny_folder)
    try:
        prompt = list(range(100, 180))
        first = run_engine(llm.llm_engine, [("x", prompt, beam_params(3))])
        hits_before = llm.llm_engine.core.stats().prefix_cache_hits
        second = run_engine(llm.llm_engine, [("y", prompt, beam_params(3))])
        assert llm.llm_engine.core.stats().prefix_cache_hits - hits_before >= 64  # the prompt's full blocks
        assert_same({"x": _tokens(second)["y"]}, _tokens(first))
    finally:
        llm.shutdown()


def test_bad_input_is_a_value_error_and_the_engine_keeps_serving(tiny_folder):
    from pagedllm import BeamSearchParams, SamplingParams

    llm = tiny_llm(tiny_folder, max_num_seqs=8)
    try:
        cases = [
            (lambda: BeamSearchParams(beam_width=0, max_tokens=8), "beam_width"),
            (lambda: BeamSearchParams(beam_width=2, max_tokens=8, temperature=0.7), "temperature"),
            (lambda: BeamSearchParams(beam_width=2, max_tokens=0), "max_tokens"),
            (lambda: llm.beam_search(["hi"], BeamSearchParams(beam_width=9, max_tokens=8)), "beam_width"),
            (lambda: SamplingParams(n=2, use_beam_search=True, temperature=0.0, stop=["x"]), "stop"),
            (lambda: SamplingParams(n=2, use_beam_search=True, temperature=0.0, logprobs=2), "logprobs"),
            (lambda: SamplingParams(n=2, use_beam_search=True, temperature=0.0, length_penalty=float("inf")),
             "length_penalty"),
            (lambda: llm.generate([{"prompt_token_ids": [5] * 300}], beam_params(2, max_tokens=8)), "max_model_len"),
        ]
        for make, field in cases:
            with pytest.raises(ValueError, match=field):
                make()
        engine = llm.llm_engine
        assert not engine.has_unfinished_requests() and engine.core.num_kv_seqs() == 0
        out = llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(beam_width=2, max_tokens=4))
        assert len(out[0].sequences) == 2
    finally:
        llm.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("eager,async_sched", [(False, True), (True, False)], ids=["graphs-async", "eager-sync"])
def test_cuda_matches_hugging_face(tmp_path, eager, async_sched):
    """fp32 on the GPU (CUDA graphs with async scheduling, where beams get no placeholders; eager
    synchronous): the hypotheses of HF's beam search on the same GPU, no block held after."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, BeamSearchParams

    folder = build_tiny_engine_folder("llama", tmp_path / "llama", seed=5)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to("cuda").eval()
    llm = LLM(str(folder), dtype="float32", device="cuda", kv_cache_memory_bytes=64 << 20, max_model_len=256,
              enforce_eager=eager, async_scheduling=async_sched)
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in (4, 19, 33, 50)]
        eos = llm.llm_engine.eos_token_ids
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=4, max_tokens=24))
        for prompt, out in zip(prompts, outs):
            ref = hf_beams(hf, prompt, 4, 24, eos)
            check_same(out, ref, prompt)
        engine = llm.llm_engine
        assert engine.core.num_kv_seqs() == 0 and engine.core.stats().kv_usage == 0.0
    finally:
        llm.shutdown()
