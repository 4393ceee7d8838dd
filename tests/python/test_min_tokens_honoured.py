"""Public case C14: min_tokens counts output tokens only, masks the real EOS and stop_token_ids
(also with ignore_eos) and defers stop strings (vLLM #21987, TRT-LLM PRs #12166 / #12358)."""

from bundled_llm import EOS, bundled_llm, chat_ids, greedy


def test_stop_string_deferred_until_min_tokens():
    llm = bundled_llm()
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": tok.encode("path/")}
    free = llm.generate(prompt, greedy(24, stop=["\n"], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    out = llm.generate(
        prompt, greedy(24, min_tokens=24, stop=["\n"], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 24
    assert EOS not in out.token_ids
    if free.finish_reason == "stop":  # the path ran: without min_tokens a "\n" ended it early
        assert len(free.token_ids) < 24
        assert "\n" in out.text


def test_long_prompt_counts_only_outputs():
    llm = bundled_llm()
    paragraph = "The committee met on Tuesday to discuss the budget, the schedule and the new building. "
    text = paragraph * 40 + "Answer yes or no:"
    ids = llm.get_tokenizer().encode(text)
    assert len(ids) > 550
    out = llm.generate({"prompt_token_ids": ids}, greedy(32, min_tokens=32), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 32 and EOS not in out.token_ids


def test_eos_and_stop_ids_masked_then_allowed():
    llm = bundled_llm()
    prompt = chat_ids(llm, "Is the sky blue? Answer yes or no.")
    free = llm.generate(prompt, greedy(64), use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 16  # EOS comes early unmasked
    for ignore_eos in (False, True):
        out = llm.generate(prompt, greedy(64, min_tokens=16, stop_token_ids=[EOS], ignore_eos=ignore_eos),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) >= 16
        assert EOS not in out.token_ids[:16]
        if not ignore_eos:
            assert out.finish_reason == "stop" or len(out.token_ids) == 64
