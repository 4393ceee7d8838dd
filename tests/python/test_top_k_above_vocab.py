"""Public case C16: a top_k above the vocabulary acts exactly as top_k off; a greedy request in a
batch with a top_k request is token-identical to its solo run (sendnn-inference #542)."""

from bundled_llm import bundled_llm, greedy


def test_huge_top_k_is_off_and_mixed_batch():
    from pagedllm import SamplingParams

    llm = bundled_llm()
    vocab = len(llm.get_tokenizer())
    prompt = "1 2 3 4 5 "

    def run(top_k):
        p = SamplingParams(temperature=1.0, seed=3, max_tokens=32, top_k=top_k)
        return llm.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids

    off = run(-1)
    assert len(off) > 0
    for k in (0, 9_999_999, vocab, vocab + 1):
        assert run(k) == off, k
    assert run(5) != off or run(1) != off  # top_k really changes sampling when below the vocabulary
    solo = llm.generate(prompt, greedy(32), use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([prompt, prompt], [greedy(32), SamplingParams(temperature=1.0, top_k=5, max_tokens=32)],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == solo
