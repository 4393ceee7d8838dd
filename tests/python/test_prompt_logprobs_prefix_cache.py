"""Fault: prompt_logprobs with prefix caching — cached prompt positions have no freshly computed
logits, so the engine crashes or returns missing / stale logprobs for them (public case C05: vLLM
#3251, #8268, #13105, PR #42245). A prompt of 2 blocks + 1 token (33 tokens, block size 16) with
prompt_logprobs=1 sent cold and warm on a caching engine and once on an engine without caching
must give one entry per prompt token (the first None), each holding the prompt token with a finite
logprob <= 0, equal in all runs; two prompts sharing a 2-block prefix give the same values in
either order. As in vLLM v1, a request that asks for prompt_logprobs does not read the prefix
cache (its cached positions would have no logits); the tests check that cached blocks were
present and bypassed. The HTTP variant is test_server_api.py::test_c05_prompt_logprobs_cold_and_warm_cache."""

from __future__ import annotations

import math

import pytest

from bundled_llm import _pin_threads, greedy, random_llm

BLOCK = 16
PROMPT = [4000 + 13 * k for k in range(2 * BLOCK + 1)]
PREFIX = [700 + 31 * k for k in range(2 * BLOCK)]
TAIL_A = [9001, 9002, 9003, 9004, 9005]
TAIL_B = [12001, 12002, 12003]


@pytest.fixture(scope="module")
def cached():
    return random_llm()  # prefix caching on (the default), block size 16


@pytest.fixture(scope="module")
def uncached(cached):
    from pagedllm import LLM

    _pin_threads()
    llm = LLM(str(cached._test_folder), dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=1024,
              enable_prefix_caching=False)
    yield llm
    llm.shutdown()


def _hits(llm) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == "pagedllm:prefix_cache_hits")


def _score(llm, ids):
    out = llm.generate({"prompt_token_ids": list(ids)}, greedy(1, prompt_logprobs=1), use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids)
    assert plp[0] is None
    values = []
    for tid, entry in zip(ids[1:], plp[1:]):
        assert entry is not None and tid in entry, tid
        v = entry[tid].logprob
        assert math.isfinite(v) and v <= 0
        values.append(v)
    return values, out


def _close(a, b):
    assert len(a) == len(b)
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-3


def _plain(llm, ids):
    return llm.generate({"prompt_token_ids": list(ids)}, greedy(1), use_tqdm=False)[0]


def test_cold_warm_and_uncached_agree(cached, uncached):
    """The prompt's full blocks are in the prefix cache (a plain request just computed them); a
    prompt_logprobs request then bypasses them, as vLLM v1 does (kv_cache_manager: requests that
    need prompt logprobs skip the prefix cache), and its values equal the uncached engine's."""
    _plain(cached, PROMPT)
    h0 = _hits(cached)
    assert _plain(cached, PROMPT).num_cached_tokens == 2 * BLOCK or _hits(cached) - h0 == 2 * BLOCK
    h1 = _hits(cached)
    cold, _ = _score(cached, PROMPT)
    warm, _ = _score(cached, PROMPT)
    assert _hits(cached) == h1  # the cached blocks were there and were not read
    none, _ = _score(uncached, PROMPT)
    _close(cold, warm)
    _close(cold, none)
    assert cold == warm == none  # fp32, same kernels: exactly equal


def test_shared_prefix_in_both_orders(cached, uncached):
    a, b = PREFIX + TAIL_A, PREFIX + TAIL_B
    ref_a, _ = _score(uncached, a)
    ref_b, _ = _score(uncached, b)
    for first, second in ((a, b), (b, a)):
        _plain(cached, first)  # the shared 2-block prefix is cached
        got = {}
        for ids in (first, second):
            got[tuple(ids)], _ = _score(cached, ids)
        _close(got[tuple(a)], ref_a)
        _close(got[tuple(b)], ref_b)
    h0 = _hits(cached)
    _plain(cached, b)
    assert _hits(cached) - h0 >= 2 * BLOCK  # the prefix really was in the cache all along


def test_batched_with_shared_prefix(cached, uncached):
    """Both prompts in one generate call (the second may hit blocks the first just cached)."""
    a, b = PREFIX + TAIL_A, PREFIX + TAIL_B
    ref_a, _ = _score(uncached, a)
    ref_b, _ = _score(uncached, b)
    outs = cached.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}], greedy(1, prompt_logprobs=1),
                           use_tqdm=False)
    for ids, ref, out in ((a, ref_a, outs[0]), (b, ref_b, outs[1])):
        got = [e[t].logprob for t, e in zip(ids[1:], out.prompt_logprobs[1:])]
        _close(got, ref)
