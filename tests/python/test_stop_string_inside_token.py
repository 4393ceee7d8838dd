"""Public case C07: a stop string that ends inside a token, or spans two tokens, still stops the
sequence; the text is the no-stop text cut at the first occurrence (vLLM #3572, TGI #1039)."""

import pytest

from bundled_llm import bundled_llm, greedy

PROMPT = "The alphabet with no spaces: ABC"


def _stop_strings(tok, ids, full):
    """(inside, span): the first two characters of a generated token of >= 3 characters, and a
    string across the end of that token and the start of the next one."""
    for j in range(len(ids) - 1):
        text_j = tok.decode([ids[j]])
        if len(text_j.strip()) < 3:
            continue
        start = len(tok.decode(ids[:j]))
        end = len(tok.decode(ids[: j + 1]))
        if full[start:end] != text_j or end - start < 3:
            continue
        inside = full[start : start + 2]
        span = full[end - 1 : end + 1]
        return inside, span, start, end
    return None


@pytest.mark.parametrize("include", [False, True])
def test_stop_inside_token_and_across_tokens(include):
    llm = bundled_llm()
    tok = llm.get_tokenizer()
    base = llm.generate(PROMPT, greedy(32, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    full, ids = base.text, base.token_ids
    found = _stop_strings(tok, ids, full)
    assert found is not None, f"no generated token of >= 3 characters in {full!r}"
    inside, span, start, end = found
    assert start + 2 < end  # "inside" ends strictly inside the token
    for stop in (inside, span):
        out = llm.generate(
            PROMPT, greedy(32, ignore_eos=True, stop=[stop], include_stop_str_in_output=include), use_tqdm=False
        )[0].outputs[0]
        i = full.find(stop)
        want = full[: i + len(stop)] if include else full[:i]
        assert out.text == want, (stop, out.text, want)
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert len(out.token_ids) < len(ids)  # it really stopped early
        if include:
            assert out.text.endswith(stop)
