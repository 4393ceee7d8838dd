"""Public case C13: a request's seed gives the same tokens alone, beside 8 other requests with
random parameters, and in the middle of a 3-prompt generate (vLLM #21310, #3333)."""

import random

from bundled_llm import bundled_llm, chat_ids


def test_seed_reproducible_whatever_the_batch():
    from pagedllm import SamplingParams

    llm = bundled_llm()
    prompt = chat_ids(llm, "Name three fruits and one vegetable.")
    params = SamplingParams(temperature=0.7, seed=123, max_tokens=48)
    alone1 = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    alone2 = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone1 == alone2
    rng = random.Random(7)
    others = [chat_ids(llm, t) for t in ("Tell me a joke.", "What is 2+2?", "Describe the sea.", "Hi!",
                                          "Count to ten.", "Name a colour.", "Why?", "Write a haiku.")]
    other_params = [SamplingParams(temperature=rng.uniform(0.3, 1.5), top_p=rng.uniform(0.5, 1.0),
                                   top_k=rng.choice([0, 5, 50]), max_tokens=rng.randint(8, 64)) for _ in others]
    outs = llm.generate(others[:4] + [prompt] + others[4:], other_params[:4] + [params] + other_params[4:],
                        use_tqdm=False)
    assert outs[4].outputs[0].token_ids == alone1
    mid = llm.generate([others[0], prompt, others[1]], [other_params[0], params, other_params[1]], use_tqdm=False)
    assert mid[1].outputs[0].token_ids == alone1
    # it sampled (not greedy): another seed gives another answer
    other_seed = llm.generate(prompt, SamplingParams(temperature=0.7, seed=124, max_tokens=48), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone1
    m = {x.name: x for x in llm.get_metrics()}
    assert m  # metrics readable after the runs
