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


# ---------------------------------------------------------------------------- every HTTP path
# The same property on the server (random tiny model): a stop string inside a multi-character
# token and one spanning two tokens stop /v1/completions and /v1/chat/completions, streamed and
# not; a stream never shows a partial stop string (the joined deltas equal the cut text).
def _sse_deltas(server, path, body, chat):
    import json

    import httpx

    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        raw = b"".join(resp.iter_raw())
    events = [json.loads(ln[6:].decode("utf-8")) for ln in raw.split(b"\n")
              if ln.startswith(b"data: ") and ln != b"data: [DONE]"]
    choices = [c for e in events for c in e["choices"]]
    deltas = [(c["delta"].get("content") or "") if chat else c["text"] for c in choices]
    finish = [(c["finish_reason"], c.get("stop_reason")) for c in choices if c["finish_reason"]]
    return deltas, finish


@pytest.fixture(scope="module")
def server():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from server_utils import DEFAULT_ARGS, shared_server

    return shared_server("default", DEFAULT_ARGS)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("include", [False, True])
def test_http_stop_inside_token_and_across_tokens(server, path, include):
    import httpx
    from transformers import AutoTokenizer

    from server_utils import tiny_model_dir

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    chat = "chat" in path
    base = {"model": "tiny", "max_tokens": 48, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    base.update({"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT})

    def text_of(choice):
        return choice["message"]["content"] if chat else choice["text"]

    first = httpx.post(server.url + path, json=base, timeout=120).json()["choices"][0]
    full, ids = text_of(first), first["token_ids"]
    found = _stop_strings(tok, ids, full)
    assert found is not None, f"no generated token of >= 3 characters in {full!r}"
    inside, span, start, end = found
    assert start + 2 < end
    for stop in (inside, span):
        i = full.find(stop)
        want = full[: i + len(stop)] if include else full[:i]
        body = {**base, "stop": [stop], "include_stop_str_in_output": include}
        got = httpx.post(server.url + path, json=body, timeout=120).json()["choices"][0]
        assert text_of(got) == want, (stop, text_of(got), want)
        assert got["finish_reason"] == "stop" and got["stop_reason"] == stop
        assert len(got["token_ids"]) < len(ids)  # it really stopped early
        deltas, finish = _sse_deltas(server, path, body, chat)
        assert "".join(deltas) == want  # no partial stop string was sent and then retracted
        assert finish == [("stop", stop)]
