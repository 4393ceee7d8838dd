"""Public case C11: the output text equals the tokenizer's decode of the returned token ids (same
skip_special_tokens), apart from a stop token's own text; streamed text grows monotonically to
the same string (lmdeploy #992, vLLM #984, vLLM #3672)."""

import pytest

from bundled_llm import EOS, bundled_llm, chat_ids, greedy, random_llm, stream_texts


def _expected(tok, out, skip):
    ids = out.token_ids
    if out.finish_reason == "stop" and ids and (out.stop_reason is None or isinstance(out.stop_reason, int)):
        ids = ids[:-1]  # EOS / stop token: its own text is left out
    return tok.decode(ids, skip_special_tokens=skip)


def _check_stream(llm, prompt, params, final_text):
    texts = stream_texts(llm, prompt, params)
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a), (a, b)  # never retracts: no duplicated or changed characters
    assert texts[-1] == final_text
    assert all("\ufffd" not in t for t in texts[:-1]) or "\ufffd" in final_text


@pytest.mark.parametrize(
    "kind,text,max_tokens",
    [("raw", "def add(a, b):\n", 64), ("chat", "Write a Python function that adds two numbers.", 64),
     ("chat", "Repeat exactly: a    b  c\t\td", 48), ("chat", "Write two short sentences.", 48)],
)
def test_text_equals_decode_real_model(kind, text, max_tokens):
    llm = bundled_llm()
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": tok.encode(text)} if kind == "raw" else chat_ids(llm, text)
    out = llm.generate(prompt, greedy(max_tokens), use_tqdm=False)[0].outputs[0]
    assert out.token_ids
    assert out.text == _expected(tok, out, True)
    if "Python" in text:
        assert "    " in out.text  # runs of spaces (indentation) were generated
    _check_stream(llm, prompt, greedy(max_tokens), out.text)


@pytest.mark.parametrize("skip", [True, False])
def test_stop_token_id_text_left_out(skip):
    llm = bundled_llm()
    tok = llm.get_tokenizer()
    prompt = chat_ids(llm, "Say hello.")
    out = llm.generate(prompt, greedy(64, stop_token_ids=[EOS], skip_special_tokens=skip), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS  # the path ran: stopped on the token
    assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=skip)
    assert "<|im_end|>" not in out.text
    inc = llm.generate(
        prompt, greedy(64, stop_token_ids=[EOS], skip_special_tokens=skip, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert inc.text == tok.decode(inc.token_ids, skip_special_tokens=skip)
    assert inc.text.endswith("<|im_end|>") != skip


def test_random_model_byte_tokens(monkeypatch):
    """A random-weight model's tokens are often partial UTF-8 bytes: text still equals decode,
    and the streamed text never shows a broken character that the final text does not have.
    LLM.generate (FINAL_ONLY, no stop strings) decodes once at the finish (defer_text); the
    streamed run decodes step by step: both end at the same text."""
    import pagedllm.output_processor as op

    deferred = []

    class Spy(op.IncrementalDetokenizer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            deferred.append(self.defer_text)

    monkeypatch.setattr(op, "IncrementalDetokenizer", Spy)
    llm = random_llm()
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": tok.encode("Hello, world")}
    params = greedy(256, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert deferred == [True], deferred  # the offline path took the deferred decode
    assert len(out.token_ids) == 256
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    split = sum("\ufffd" in tok.decode([t]) for t in out.token_ids)
    assert split > 0, "no partial UTF-8 token generated: the split path never ran"
    _check_stream(llm, prompt, params, out.text)
    assert deferred == [True, False], deferred  # the streamed run decoded incrementally
