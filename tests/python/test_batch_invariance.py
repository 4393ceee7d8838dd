"""Fault: greedy output depends on batch composition — padding or masking leaks between batch
rows, per-row offsets are wrong, or kernels are not batch-invariant (public case C24: vLLM #3544,
llama.cpp #6583). Four instructions of about 5, 40, 120 and 300 tokens, greedy, 64 tokens, on the
bundled SmolLM2 in fp32 (exact equality): each alone, all four in one generate call, and all four
in reverse order. The HTTP variant (8 concurrent copies of one 40-token prompt) is
test_server_api.py::test_seeded_and_greedy_requests_identical_under_concurrency."""

from __future__ import annotations

import pytest

from bundled_llm import _pin_threads, greedy

SENTENCE = "The old lighthouse keeper walked along the harbour wall every evening and counted the boats. "


def _prompts(tok) -> list[dict]:
    texts = ["Translate to French: hello.",
             "Translate to French: " + SENTENCE * 2,
             "Translate to French: " + SENTENCE * 6,
             "Translate to French: " + SENTENCE * 16]
    prompts = [{"prompt_token_ids": tok.encode(t)} for t in texts]
    lens = [len(p["prompt_token_ids"]) for p in prompts]
    assert lens[0] <= 8 and 30 <= lens[1] <= 50 and 100 <= lens[2] <= 140 and 260 <= lens[3] <= 340, lens
    return prompts


@pytest.fixture(scope="module")
def llm():
    from pagedllm import LLM

    _pin_threads()
    # prefix caching off: the runs must not share cached KV blocks, only the batch differs
    engine = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=1024, enable_prefix_caching=False)
    yield engine
    engine.shutdown()


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_alone_batched_and_reversed_identical(llm):
    prompts = _prompts(llm.get_tokenizer())
    params = greedy(64, ignore_eos=True)
    alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    seqs_hist = next(m for m in llm.get_metrics() if m.name == "pagedllm:iteration_num_seqs")
    multi_before = seqs_hist.count - seqs_hist.buckets["1"]
    batched = _ids(llm.generate(prompts, params, use_tqdm=False))
    reversed_ = _ids(llm.generate(prompts[::-1], params, use_tqdm=False))[::-1]
    seqs_hist = next(m for m in llm.get_metrics() if m.name == "pagedllm:iteration_num_seqs")
    assert seqs_hist.count - seqs_hist.buckets["1"] > multi_before  # the path ran: steps held several rows
    assert all(len(a) == 64 for a in alone)
    for i, a in enumerate(alone):
        assert batched[i] == a, (i, _first_diff(batched[i], a))
        assert reversed_[i] == a, (i, _first_diff(reversed_[i], a))


def _first_diff(a, b):
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
