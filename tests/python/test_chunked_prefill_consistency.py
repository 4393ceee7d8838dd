"""Fault: chunked prefill drops, repeats or mis-positions tokens at chunk boundaries (public case
C04: tinygrad PR #15182, nano-vllm PR #218). A prompt longer than the per-step token budget must
give the same greedy tokens whatever the budget (16, 32, 37 — not a multiple of the block size —
or no chunking), usage must count the tokenizer's tokens, and short requests that are already
decoding while a long prompt is chunked beside them must match their solo runs (fp32, exact).
Each run asserts from get_metrics() that a prompt really was cut into chunks."""

from __future__ import annotations

import pytest

from bundled_llm import _pin_threads, bundled_llm, chat_ids, greedy

QUESTION = "Please skip this line. " * 10 + "What is the capital of Italy? Answer in one word."
SHORT = ["Say hi.", "What is 2+2?", "Name a colour."]


def _make(budget):
    from pagedllm import LLM

    _pin_threads()
    if budget is None:  # chunking off: the whole prompt in one step
        return LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=1024,
                   enable_chunked_prefill=False, enable_prefix_caching=False)
    return LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=1024,
               max_num_batched_tokens=budget, enable_prefix_caching=False)


def _metric(llm, name):
    return next(m.value for m in llm.get_metrics() if m.name == "pagedllm:" + name)


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of the question with no chunking (the shared bundled engine, budget 8192)."""
    llm = bundled_llm()
    prompt = chat_ids(llm, QUESTION)
    out = llm.generate(prompt, greedy(16), use_tqdm=False)[0]
    return prompt, out


def test_unchunked_reference_is_sane(reference):
    prompt, out = reference
    llm = bundled_llm()
    tok = llm.get_tokenizer()
    assert len(prompt["prompt_token_ids"]) > 74  # longer than twice the largest budget tried
    assert out.prompt_token_ids == prompt["prompt_token_ids"]
    text = out.outputs[0].text
    assert "rome" in text.lower() or "ital" in text.lower(), text  # it read the question, not only the filler
    assert "skip" not in text.lower()
    # usage counts the tokenizer's tokens for a text prompt too
    plain = llm.generate(QUESTION, greedy(1), use_tqdm=False)[0]
    assert len(plain.prompt_token_ids) == len(tok.encode(QUESTION))


@pytest.mark.parametrize("budget", [16, 32, 37, None])
def test_same_tokens_for_every_budget(reference, budget):
    prompt, ref = reference
    llm = _make(budget)
    try:
        out = llm.generate(prompt, greedy(16), use_tqdm=False)[0]
        chunked = _metric(llm, "num_chunked_prefills")
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids, budget
    assert out.outputs[0].text == ref.outputs[0].text
    assert len(out.prompt_token_ids) == len(prompt["prompt_token_ids"])
    if budget is None:
        assert chunked == 0
    else:
        assert chunked > 0  # the path ran: the prompt was cut into chunks


def test_long_chunked_prompt_beside_decoding_requests(reference):
    """3 short requests start decoding; then the long prompt arrives and is prefilled in chunks of
    a 16-token budget while they keep decoding in the same steps."""
    prompt, ref = reference
    llm = _make(16)
    try:
        solo_llm = bundled_llm()
        shorts = [chat_ids(solo_llm, s) for s in SHORT]
        solo = [solo_llm.generate(p, greedy(24, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
                for p in shorts]
        engine = llm.llm_engine
        ids = [engine.new_request_id() for _ in range(4)]
        for rid, p in zip(ids, shorts):
            engine.add_request(rid, None, p["prompt_token_ids"], greedy(24, ignore_eos=True))
        finished: dict = {}
        started: set = set()
        while len(started) < 3:  # step until all three produced a token (each prompt < 16 tokens)
            for o in engine.step():
                if o.outputs[0].token_ids:
                    started.add(o.request_id)
        engine.add_request(ids[3], None, prompt["prompt_token_ids"], greedy(16))
        mixed_steps = 0  # steps where short requests decoded while the long prompt was still prefilling
        long_started = False
        while len(finished) < 4:
            outs = engine.step()
            rids = {o.request_id for o in outs}
            if not long_started and rids & set(ids[:3]):
                mixed_steps += 1
            for o in outs:
                if o.request_id == ids[3] and o.outputs[0].token_ids:
                    long_started = True
                if o.finished:
                    finished[o.request_id] = o
        chunked = _metric(llm, "num_chunked_prefills")
    finally:
        llm.shutdown()
    assert chunked > 0
    assert mixed_steps > 0  # short requests decoded while the long prompt was in flight
    for rid, want in zip(ids[:3], solo):
        assert finished[rid].outputs[0].token_ids == want
    assert finished[ids[3]].outputs[0].token_ids == ref.outputs[0].token_ids
