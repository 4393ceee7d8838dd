"""Public case C17: near-zero temperature, top_k=1 and a tiny top_p give the greedy tokens, with
finite logprobs and non-empty text (vLLM PR #2937, #5404)."""

import math

from bundled_llm import bundled_llm, greedy


def test_near_greedy_settings_equal_greedy():
    from pagedllm import SamplingParams

    llm = bundled_llm()
    prompt = "The capital of France is"

    def run(**kw):
        p = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=1, **kw)
        return llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]

    ref = run(temperature=0.0)
    assert len(ref.token_ids) == 32 and ref.text.strip()
    variants = [
        dict(temperature=1e-4, seed=1), dict(temperature=1e-6, seed=1), dict(temperature=1.0, top_k=1),
        dict(temperature=0.0, top_p=0.1, top_k=50), dict(temperature=0.7, top_p=1e-9),
    ]
    for kw in variants:
        out = run(**kw)
        assert out.token_ids == ref.token_ids, kw
        assert len(out.token_ids) == 32 and out.text == ref.text
        for entry in out.logprobs:
            assert all(math.isfinite(lp.logprob) for lp in entry.values())
        assert math.isfinite(out.cumulative_logprob)
