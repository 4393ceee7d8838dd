"""Fault: a zero-length token sequence reaches the model runner and kills the engine (public case
C18: vLLM #7283, PR #7746). Offline: LLM.generate("") and every other empty form raise ValueError
naming the empty prompt, queue nothing, and the engine keeps serving with no KV block held. The
HTTP variants (prompt "", [""], [], [[]], messages [], content "") are in test_server_errors.py."""

from __future__ import annotations

import pytest

from bundled_llm import greedy, random_llm


def _idle(llm) -> bool:
    m = {x.name: x for x in llm.get_metrics()}
    return (not llm.llm_engine.has_unfinished_requests() and m["pagedllm:kv_cache_usage_perc"].value == 0.0
            and m["pagedllm:num_requests_waiting"].value == 0)


@pytest.mark.parametrize("prompt", ["", {"prompt": ""}, {"prompt_token_ids": []}, ["hello", ""]])
def test_empty_prompt_raises_and_engine_keeps_serving(prompt):
    llm = random_llm()
    tok = llm.get_tokenizer()
    assert tok.encode("") == []  # this tokenizer adds no BOS: "" really is 0 tokens
    ref = llm.generate("hello", greedy(4, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt, greedy(20), use_tqdm=False)
    assert _idle(llm)
    assert llm.generate("hello", greedy(4, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids == ref


def test_empty_chat_raises():
    llm = random_llm()
    with pytest.raises(ValueError):
        llm.chat([], greedy(4), use_tqdm=False)
    assert _idle(llm)
    # an empty user message is a real prompt: the template wraps it (prompt_tokens >= 1)
    out = llm.chat([{"role": "user", "content": ""}], greedy(2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) >= 1 and len(out.outputs[0].token_ids) == 2
