"""The OpenAI-compatible server through the official `openai` client: a real `pagedllm serve`
process on 127.0.0.1 with a random tiny model (server_utils). Completions, chat, streaming
(joined deltas == non-stream text, valid UTF-8 JSON events), n > 1, logprobs, echo with
max_tokens = 0 (case C06), token-id prompts, tokenize/detokenize, models, the seeded and greedy
determinism of concurrent requests (C13, C24 HTTP variants)."""

from __future__ import annotations

import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_utils import MAX_MODEL_LEN  # noqa: E402

MODEL = "tiny"
PROMPT = "The sky over the harbour was grey."


# fixtures server / client: conftest.py's (the shared default server)


def sse_events(server, path: str, body: dict) -> list[dict]:
    """POST with stream=true; every `data:` line must be valid UTF-8 JSON (or [DONE], last)."""
    events = []
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        raw = b"".join(resp.iter_raw())
    lines = [ln for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    for ln in lines[:-1]:
        events.append(json.loads(ln[6:].decode("utf-8", errors="strict")))
    return events


# ---------------------------------------------------------------------------- completions
def test_models_lists_served_names(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "tiny-alias"]


def test_completion_basic_and_usage(client, server):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.choices[0]
    tok_count = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert r.object == "text_completion" and r.model == MODEL
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == tok_count
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == tok_count + 12
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 12
    # the text is the detokenizer's: equal to decoding the returned ids
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == choice.text
    # alias name works too
    r2 = client.completions.create(model="tiny-alias", prompt=PROMPT, max_tokens=12, temperature=0.0,
                                   extra_body={"ignore_eos": True})
    assert r2.choices[0].text == choice.text


def test_completion_streaming_equals_non_streaming(client, server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    full = client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                     extra_body={"ignore_eos": True})
    events = sse_events(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == full.choices[0].text
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 40
    # through the openai client as well
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == full.choices[0].text


def test_random_model_stream_utf8_matches_non_stream(server):
    """C09 (d): a random model's output has partial UTF-8 byte tokens; no delta may carry a
    U+FFFD the final text lacks, and the joined deltas equal the non-streamed text."""
    body = {"model": MODEL, "prompt": "Repeat exactly: A 世ab 😀 café ďábel", "max_tokens": 300,
            "temperature": 1.0, "seed": 7, "ignore_eos": True}
    full = httpx.post(server.url + "/v1/completions", json={**body, "cache_salt": "full"},
                      timeout=120).json()["choices"][0]["text"]
    events = sse_events(server, "/v1/completions", {**body, "stream": True, "cache_salt": "stream"})
    deltas = [c["text"] for e in events for c in e["choices"]]
    assert "".join(deltas) == full
    assert "".join(deltas).count("\ufffd") == full.count("\ufffd")
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def test_multiple_prompts_and_n(client):
    r = client.completions.create(model=MODEL, prompt=["one two", "three four"], n=2, max_tokens=5,
                                  temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 20


def test_n_streaming_joins_per_index(client, server):
    body = {"model": MODEL, "prompt": PROMPT, "n": 3, "max_tokens": 16, "temperature": 1.0, "seed": 11,
            "ignore_eos": True}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    events = sse_events(server, "/v1/completions", {**body, "stream": True})
    joined = {}
    for e in events:
        for c in e["choices"]:
            joined[c["index"]] = joined.get(c["index"], "") + c["text"]
    assert joined == {c["index"]: c["text"] for c in full["choices"]}


def test_token_id_prompts(client):
    r = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=3, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 6


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert math.isfinite(value) and value <= 0
        assert 3 <= len(top) <= 4
        # greedy: the chosen token is the most likely one
        assert value == pytest.approx(max(top.values()), abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)


@pytest.mark.parametrize("with_logprobs", [True, False])
def test_echo_with_max_tokens_zero_scores_the_prompt(client, with_logprobs):
    """C06: echo=true, max_tokens=0 (with and without logprobs)."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, temperature=0.0,
                                  logprobs=1 if with_logprobs else None)
    c = r.choices[0]
    assert c.text == PROMPT
    assert c.finish_reason == "length" and r.usage.completion_tokens == 0
    if with_logprobs:
        lp = c.logprobs
        assert "".join(lp.tokens) == PROMPT
        assert lp.token_logprobs[0] is None
        assert all(math.isfinite(v) and v <= 0 for v in lp.token_logprobs[1:])
        assert len(lp.tokens) == r.usage.prompt_tokens
    else:
        assert c.logprobs is None


def test_echo_streaming_matches_non_stream(client, server):
    """C06 streaming variant: echo=true, max_tokens=5, logprobs=2, stream=true."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "echo": True, "logprobs": 2, "temperature": 0.0,
            "ignore_eos": True}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    events = sse_events(server, "/v1/completions", {**body, "stream": True})
    assert "".join(c["text"] for e in events for c in e["choices"]) == full["text"]
    assert full["text"].startswith(PROMPT)
    streamed_tokens = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert streamed_tokens == full["logprobs"]["tokens"]


def test_echo_scoring_leaves_the_server_healthy(server):
    """C06: after the prompt-scoring requests (echo with max_tokens = 0, with and without
    logprobs, also streamed) the server is healthy and a greedy reference is unchanged."""
    ref_body = {"model": MODEL, "prompt": [11, 22, 33], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
    ref = httpx.post(server.url + "/v1/completions", json=ref_body, timeout=60).json()["choices"][0]["token_ids"]
    for extra in ({"logprobs": 1}, {}, {"logprobs": 1, "stream": True}):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "temperature": 0.0, **extra}
        resp = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        if extra.get("stream"):
            events = [json.loads(ln[6:]) for ln in resp.text.splitlines()
                      if ln.startswith("data: ") and ln != "data: [DONE]"]
            assert "".join(c["text"] for e in events for c in e["choices"]) == PROMPT
            assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert server.healthy((ref_body, ref))


def test_stop_string_in_stream_is_held_back(client, server):
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "temperature": 0.0, "ignore_eos": True}
    text = httpx.post(server.url + "/v1/completions", json=base, timeout=60).json()["choices"][0]["text"]
    visible = text.strip()
    assert len(visible) >= 6, text
    mid = text.index(visible[len(visible) // 2:len(visible) // 2 + 3])
    stop = text[mid:mid + 3]
    expected = text[:text.index(stop)]
    full = httpx.post(server.url + "/v1/completions", json={**base, "stop": [stop]}, timeout=60).json()["choices"][0]
    assert full["text"] == expected and full["finish_reason"] == "stop" and full["stop_reason"] == stop
    events = sse_events(server, "/v1/completions", {**base, "stop": [stop], "stream": True})
    deltas = [c["text"] for e in events for c in e["choices"]]
    assert "".join(deltas) == expected
    assert all(stop not in "".join(deltas[:k + 1]) for k in range(len(deltas)))


# ---------------------------------------------------------------------------- chat
def test_chat_basic_and_prompt_tokens_match_tokenize(client, server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Who are you?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert c.finish_reason == "length" and r.usage.completion_tokens == 10
    tok = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    assert r.usage.prompt_tokens == tok["count"]
    # C23: ChatML template, no BOS added by tokenization; prompt ends with the assistant header
    text = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert tok["tokens"].count(1) == 3  # one <|im_start|> per message + the generation prompt


def test_chat_streaming_equals_non_streaming_with_usage(client):
    messages = [{"role": "user", "content": "Write one short sentence in Chinese about a cat."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0.0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 48 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_n_logprobs_and_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                       max_completion_tokens=7, temperature=0.0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 7
        for entry in content:
            assert math.isfinite(entry.logprob) and entry.logprob <= 0
            assert len(entry.top_logprobs) == 2
            if "\ufffd" not in entry.token:
                assert bytes(entry.bytes).decode("utf-8") == entry.token
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
    assert r.usage.completion_tokens == 14


def test_chat_content_parts_text(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}], max_tokens=2, temperature=0.0)
    assert r.choices[0].finish_reason in ("length", "stop")


# ---------------------------------------------------------------------------- determinism under load
def test_seeded_and_greedy_requests_identical_under_concurrency(server):
    """C13 / C24 HTTP variants: a seeded request gives the same ids alone and among 8 others;
    8 concurrent greedy copies of one prompt are identical."""
    url = server.url + "/v1/chat/completions"
    seeded = {"model": MODEL, "messages": [{"role": "user", "content": "Name three fruits and one vegetable."}],
              "temperature": 0.7, "seed": 123, "max_tokens": 48, "ignore_eos": True, "return_token_ids": True}
    alone = httpx.post(url, json=seeded, timeout=120).json()["choices"][0]["token_ids"]
    greedy = {"model": MODEL, "prompt": "translate to French: " + "the cat sat on the mat " * 5, "max_tokens": 32,
              "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    others = [{"model": MODEL, "prompt": f"noise {i}", "max_tokens": 40, "temperature": 1.0, "top_k": 5 + i,
               "ignore_eos": True} for i in range(8)]
    with ThreadPoolExecutor(18) as pool:
        futs = [pool.submit(httpx.post, server.url + "/v1/completions", json=o, timeout=120) for o in others]
        seeded_fut = pool.submit(httpx.post, url, json=seeded, timeout=120)
        greedy_futs = [pool.submit(httpx.post, server.url + "/v1/completions", json=greedy, timeout=120)
                       for _ in range(8)]
        assert all(f.result().status_code == 200 for f in futs)
        loaded = seeded_fut.result().json()["choices"][0]["token_ids"]
        copies = [f.result().json()["choices"][0]["token_ids"] for f in greedy_futs]
    assert loaded == alone
    assert all(c == copies[0] for c in copies) and len(copies[0]) == 32


# ---------------------------------------------------------------------------- misc endpoints
def test_tokenize_detokenize_roundtrip(server):
    tok = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == PROMPT
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]


def test_health_and_version(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert "version" in httpx.get(server.url + "/version").json()


# ---------------------------------------------------------------------------- public bug cases, HTTP variants
@pytest.mark.parametrize("content", [
    "Reply with exactly five emoji and nothing else: party popper, red heart, thumbs-up, rocket, the flag of Japan.",
    "Write one short sentence in Chinese about a cat, then one in Japanese, then the English word done.",
    "Repeat exactly: A 世ab 😀 café ďábel",
])
def test_c09_chat_stream_utf8(server, content):
    """C09 (a)-(c): every event is valid UTF-8 JSON (sse_events decodes strictly) and the joined
    deltas equal the non-streamed text; sampled so the random model emits varied byte tokens."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 64,
            "temperature": 1.0, "seed": 5, "ignore_eos": True}
    # distinct cache salts: both runs prefill the whole prompt (no prefix-cache hit), so sampling
    # sees bit-identical logits and the comparison is about streaming alone
    full = httpx.post(server.url + "/v1/chat/completions", json={**body, "cache_salt": "full"}, timeout=60).json()
    text = full["choices"][0]["message"]["content"]
    events = sse_events(server, "/v1/chat/completions", {**body, "stream": True, "cache_salt": "stream"})
    deltas = [c["delta"].get("content") or "" for e in events for c in e["choices"]]
    assert "".join(deltas) == text
    assert sum(d.count("\ufffd") for d in deltas) == text.count("\ufffd")


def test_c23_chat_prompt_tokens_equal_the_template(server, client):
    """C23: usage.prompt_tokens equals the tokenizer's apply_chat_template (generation prompt,
    tokenized) computed here, independently of the server."""
    from transformers import AutoTokenizer

    from server_utils import tiny_model_dir

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Who are you?"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0.0)
    assert r.usage.prompt_tokens == len(expected)
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert ids == list(expected)


def test_c05_prompt_logprobs_cold_and_warm_cache(server):
    """C05 HTTP variant: a 33-token prompt (2 blocks + 1) with prompt_logprobs=1, sent twice:
    one entry per prompt token, the first None, each holding the prompt token with a finite
    logprob <= 0, equal in the cold and the warm (prefix-cached) run."""
    prompt = [4000 + 13 * k for k in range(33)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1}
    runs = [httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["prompt_logprobs"]
            for _ in range(2)]
    for plp in runs:
        assert len(plp) == 33 and plp[0] is None
        for tid, entry in zip(prompt[1:], plp[1:]):
            lp = entry[str(tid)]["logprob"]
            assert math.isfinite(lp) and lp <= 0
    for a, b in zip(runs[0][1:], runs[1][1:]):
        for tid in a:
            assert a[tid]["logprob"] == pytest.approx(b[tid]["logprob"], abs=1e-3)


def test_c16_huge_top_k_and_mixed_batch(server):
    """C16: top_k above the vocabulary acts like disabled top_k; a greedy request batched with a
    top_k=5 request equals its solo run."""
    url = server.url + "/v1/completions"
    base = {"model": MODEL, "prompt": "1 2 3 4 5 ", "temperature": 1.0, "seed": 3, "max_tokens": 32,
            "ignore_eos": True, "return_token_ids": True}
    ids = {k: httpx.post(url, json={**base, "top_k": k}, timeout=60).json()["choices"][0]["token_ids"]
           for k in (9999999, 49152, 49153, -1, 0)}
    assert all(v == ids[-1] for v in ids.values())
    greedy = {**base, "temperature": 0.0}
    solo = httpx.post(url, json=greedy, timeout=60).json()["choices"][0]["token_ids"]
    with ThreadPoolExecutor(2) as pool:
        g = pool.submit(httpx.post, url, json=greedy, timeout=60)
        k = pool.submit(httpx.post, url, json={**base, "top_k": 5}, timeout=60)
        assert k.result().status_code == 200
        assert g.result().json()["choices"][0]["token_ids"] == solo
    assert server.healthy((greedy, solo))  # still serving, same greedy ids
