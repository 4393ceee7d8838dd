"""Fault: prompt-length validation missing or off by one at max_model_len (public case C19: SGLang
#3910, #9599, llama.cpp PR #16486, vLLM #765). Offline rule (vLLM's LLM): a prompt of L or L+1
tokens raises ValueError naming max_model_len and the count, queues nothing, and the engine keeps
serving; L-1 tokens with max_tokens=1 gives exactly 1 token ("length"); an omitted max_tokens, or
one beyond the room left (vLLM's offline API truncates rather than rejects), generates until
prompt + output = L, finishing "length". The HTTP rules (400 before any SSE event for every
prompt_len + max_tokens > L) are tested in test_server_errors.py::test_context_length_limits."""

from __future__ import annotations

import pytest

from bundled_llm import greedy, random_llm


def _prompt(n: int) -> dict:
    return {"prompt_token_ids": [100 + (7 * k) % 5000 for k in range(n)]}


def _idle(llm) -> bool:
    m = {x.name: x for x in llm.get_metrics()}
    return not llm.llm_engine.has_unfinished_requests() and m["pagedllm:kv_cache_usage_perc"].value == 0.0


@pytest.fixture(scope="module")
def llm():
    return random_llm()


@pytest.mark.parametrize("extra", [0, 1])
def test_prompt_of_max_model_len_or_more_raises(llm, extra):
    L = llm.llm_engine.max_model_len
    ref = llm.generate(_prompt(5), greedy(3, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=f"max_model_len is {L}") as info:
        llm.generate(_prompt(L + extra), greedy(1), use_tqdm=False)
    assert str(L + extra) in str(info.value)
    assert _idle(llm)
    assert llm.generate(_prompt(5), greedy(3, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids == ref


@pytest.mark.parametrize("max_tokens,expected", [(1, 1), (2, 1), (None, 1)])
def test_one_below_the_limit(llm, max_tokens, expected):
    from pagedllm import SamplingParams

    L = llm.llm_engine.max_model_len
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate(_prompt(L - 1), params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == expected and out.finish_reason == "length"
    assert _idle(llm)


def test_half_prompt_with_max_tokens_of_the_whole_context(llm):
    L = llm.llm_engine.max_model_len
    out = llm.generate(_prompt(L // 2), greedy(L, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == L - L // 2 and out.finish_reason == "length"
    assert _idle(llm)
