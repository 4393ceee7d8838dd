"""The server as vLLM's users expect it (issue 31), through the `openai` client and httpx against a
real `pagedllm serve` process (server_utils): completions' default max_tokens of 16,
stream_options (continuous usage stats; a 400 without streaming), one choice per streamed chunk,
chat's prompt_logprobs and streamed prompt_token_ids, requests that must be a 400 naming their
field while neighbours complete (repetition_penalty 1e-60, token ids beyond int64, lone UTF-16
surrogates), and the API key on every route but /health."""

from __future__ import annotations

import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_utils import DEFAULT_ARGS, MAX_MODEL_LEN, shared_server  # noqa: E402

MODEL = "tiny"
PROMPT = "The sky over the harbour was grey."
# fixtures server / client: conftest.py's (the shared default server)


def sse_events(url: str, body: dict, headers: dict | None = None) -> list[dict]:
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        raw = b"".join(resp.iter_raw())
    lines = [ln for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def assert_400(resp: httpx.Response, param: str, *words: str) -> dict:
    assert resp.status_code == 400, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["param"] == param and err["code"] == 400, err
    for w in (param, *words):
        assert w in err["message"], err
    return err


# ---------------------------------------------------------------------------- max_tokens default
def test_completion_without_max_tokens_generates_16_capped_by_the_context(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0.0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    near_end = [7] * (MAX_MODEL_LEN - 5)  # room for 5 tokens: the default is capped, not an error
    r = client.completions.create(model=MODEL, prompt=near_end, temperature=0.0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_chat_without_max_tokens_keeps_the_rest_of_the_context(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_MODEL_LEN - r.usage.prompt_tokens > 16


# ---------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_a_400(server, path):
    body = {"model": MODEL, "max_tokens": 2, "stream_options": {"include_usage": True}}
    body.update({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})
    assert_400(httpx.post(server.url + path, json=body, timeout=60), "stream_options", "stream")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(server, path):
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"prompt": PROMPT} if "chat" not in path else {"messages": [{"role": "user", "content": PROMPT}]})
    events = sse_events(server.url + path, body)
    assert all(e.get("usage") for e in events)
    completion = [e["usage"]["completion_tokens"] for e in events]
    assert completion == sorted(completion) and completion[-1] == 12
    prompt = {e["usage"]["prompt_tokens"] for e in events}
    assert len(prompt) == 1 and all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"]
                                    + e["usage"]["completion_tokens"] for e in events)
    # without continuous_usage_stats only the final chunk has it (the existing behaviour)
    body["stream_options"] = {"include_usage": True}
    events = sse_events(server.url + path, body)
    assert [bool(e.get("usage")) for e in events] == [False] * (len(events) - 1) + [True]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_with_n_sends_one_choice_per_chunk(server, path):
    body = {"model": MODEL, "n": 3, "max_tokens": 10, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    body.update({"prompt": PROMPT} if "chat" not in path else {"messages": [{"role": "user", "content": PROMPT}]})
    full = httpx.post(server.url + path, json=body, timeout=120).json()
    events = sse_events(server.url + path, {**body, "stream": True})
    assert all(len(e["choices"]) == 1 for e in events)
    joined: dict[int, str] = {}
    for e in events:
        c = e["choices"][0]
        piece = c["text"] if "chat" not in path else (c["delta"].get("content") or "")
        joined[c["index"]] = joined.get(c["index"], "") + piece
    texts = {c["index"]: c["text"] if "chat" not in path else c["message"]["content"] for c in full["choices"]}
    assert joined == texts and sorted(joined) == [0, 1, 2]


def test_chat_returns_prompt_logprobs_and_streams_prompt_token_ids(server):
    messages = [{"role": "user", "content": PROMPT}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0.0, "prompt_logprobs": 1}
    full = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    lps = full["prompt_logprobs"]
    assert len(lps) == len(ids) and lps[0] is None
    assert all(str(t) in entry for t, entry in zip(ids[1:], lps[1:]))  # each position holds its own token
    events = sse_events(server.url + "/v1/chat/completions", {**body, "stream": True, "return_token_ids": True})
    assert events[0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in e or e["prompt_token_ids"] is None for e in events[1:])
    streamed = [e["prompt_logprobs"] for e in events if e.get("prompt_logprobs")]
    assert streamed == [lps]


# ---------------------------------------------------------------------------- one request never fails its neighbours
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.8, "repetition_penalty": 1e-60},
     "repetition_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "repetition_penalty": 1e-60}, "repetition_penalty"),
    ("/v1/completions", {"prompt": [5, 2**70, 6], "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "a \ud800 b", "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x\udfffy"}], "max_tokens": 4}, "messages"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
]


def _post_raw(url: str, body: dict) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800, as a client in another language would send it
    return httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=120)


def test_bad_requests_are_400s_naming_the_field_while_neighbours_complete(server):
    normal = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.7, "seed": 1, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        good = [pool.submit(_post_raw, server.url + "/v1/completions", normal) for _ in range(4)]
        bad = [pool.submit(_post_raw, server.url + path, {"model": MODEL, **body} if path != "/tokenize" else body)
               for path, body, _ in BAD_REQUESTS]
        more_good = [pool.submit(_post_raw, server.url + "/v1/completions", normal) for _ in range(4)]
        for (path, _, param), fut in zip(BAD_REQUESTS, bad):
            err = assert_400(fut.result(), param)
            assert "internal" not in err["message"], (path, err)
        outs = [f.result() for f in good + more_good]
    assert all(r.status_code == 200 for r in outs), [r.text for r in outs if r.status_code != 200]
    texts = {r.json()["choices"][0]["text"] for r in outs}
    assert len(texts) == 1 and all(r.json()["usage"]["completion_tokens"] == 24 for r in outs)
    err = assert_400(_post_raw(server.url + "/v1/completions", BAD_REQUESTS[0][1] | {"model": MODEL}),
                     "repetition_penalty", "1e-30")
    assert "1e-60" in err["message"]
    metrics = server.metrics()  # nothing left running, no KV block held
    assert metrics["pagedllm:num_requests_running"] == 0 and metrics["pagedllm:kv_cache_usage_perc"] == 0


# ---------------------------------------------------------------------------- API key
@pytest.fixture(scope="module")
def keyed():
    return shared_server("keyed-all-routes", DEFAULT_ARGS, api_key="k3y")


@pytest.fixture(scope="module")
def keyed_public_metrics():
    return shared_server("keyed-public-metrics", [*DEFAULT_ARGS, "--metrics-public"], api_key="k3y")


GUARDED = [("get", "/version", None), ("get", "/metrics", None), ("get", "/openapi.json", None), ("get", "/docs", None),
           ("get", "/redoc", None), ("post", "/tokenize", {"prompt": "hi"}), ("post", "/detokenize", {"tokens": [5]}),
           ("get", "/v1/models", None)]


def test_api_key_guards_every_route_but_health(keyed):
    for method, path, body in GUARDED:
        kw = {"json": body} if body is not None else {}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k3y"}):
            resp = getattr(httpx, method)(keyed.url + path, headers=headers, timeout=30, **kw)
            assert resp.status_code == 401, (path, headers, resp.status_code)
            assert resp.json()["error"]["code"] == 401
        ok = getattr(httpx, method)(keyed.url + path, headers={"Authorization": "Bearer k3y"}, timeout=30, **kw)
        assert ok.status_code == 200, (path, ok.status_code, ok.text[:200])
    assert httpx.get(keyed.url + "/health").status_code == 200


def test_metrics_public_leaves_only_metrics_open(keyed_public_metrics):
    url = keyed_public_metrics.url
    assert httpx.get(url + "/metrics").status_code == 200
    assert httpx.get(url + "/version").status_code == 401
    assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).status_code == 401


# ---------------------------------------------------------------------------- vLLM's request extensions
def test_unknown_fields_are_400s_and_informational_ones_are_accepted(server):
    url = server.url + "/v1/completions"
    base = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert_400(httpx.post(url, json={**base, "guided_json": {"type": "object"}}, timeout=60), "guided_json",
               "structured_outputs")
    assert_400(httpx.post(url, json={**base, "temprature": 0.5}, timeout=60), "temprature")  # a typo
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_400(httpx.post(server.url + "/v1/chat/completions", json={**chat, "bad_words": ["x"]}, timeout=60),
               "bad_words")
    ok = httpx.post(url, json={**base, "user": "u1", "metadata": {"k": "v"}, "store": False}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_allowed_token_ids_restrict_sampling(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True,
            "allowed_token_ids": [300, 301, 302], "return_token_ids": True, "n": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    for c in r["choices"]:
        assert len(c["token_ids"]) == 12 and set(c["token_ids"]) <= {300, 301, 302}
    assert_400(httpx.post(server.url + "/v1/completions", json={**body, "allowed_token_ids": [10**6]}, timeout=60),
               "allowed_token_ids", "vocabulary")


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    ids = list(range(1000, 1100))
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    cut = httpx.post(server.url + "/v1/completions", json={**body, "prompt": ids, "truncate_prompt_tokens": 10},
                     timeout=60).json()
    tail = httpx.post(server.url + "/v1/completions", json={**body, "prompt": ids[-10:]}, timeout=60).json()
    assert cut["usage"]["prompt_tokens"] == 10 and cut["choices"][0]["prompt_token_ids"] == ids[-10:]
    assert cut["choices"][0]["token_ids"] == tail["choices"][0]["token_ids"]
    # a prompt longer than the context fits once truncated
    long_ids = [7] * (MAX_MODEL_LEN + 50)
    ok = httpx.post(server.url + "/v1/completions", json={**body, "prompt": long_ids, "truncate_prompt_tokens": -1,
                                                          "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1
    assert_400(httpx.post(server.url + "/v1/completions", json={**body, "prompt": ids, "truncate_prompt_tokens": 0},
                          timeout=60), "truncate_prompt_tokens")


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server):
    import re

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "logprobs": 2, "echo": True,
            "return_tokens_as_token_ids": True}
    lp = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    assert lp["tokens"] and all(re.fullmatch(r"token_id:\d+", t) for t in lp["tokens"])
    assert all(re.fullmatch(r"token_id:\d+", t) for d in lp["top_logprobs"] if d for t in d)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2, "return_tokens_as_token_ids": True}
    content = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    tokens = [c["token"] for c in content["logprobs"]["content"]]
    tokens += [t["token"] for c in content["logprobs"]["content"] for t in c["top_logprobs"]]
    assert tokens and all(re.fullmatch(r"token_id:\d+", t) for t in tokens)


def test_tokenize_returns_token_strs(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert len(r["token_strs"]) == r["count"] and "".join(r["token_strs"]).replace("Ġ", " ") == PROMPT
    assert httpx.get(server.url + "/tokenizer_info").status_code == 404  # off unless asked for, as vLLM


@pytest.fixture(scope="module")
def flagged():
    return shared_server("flags", [*DEFAULT_ARGS, "--enable-force-include-usage", "--enable-tokenizer-info-endpoint",
                                   "--root-path", "/api", "--max-logprobs", "-1", "--max-request-bytes", "4096"])


def test_force_include_usage_tokenizer_info_and_root_path(flagged):
    events = sse_events(flagged.url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5,
                                                          "ignore_eos": True, "stream": True})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    info = httpx.get(flagged.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] and info["model_max_length"] == MAX_MODEL_LEN and "im_start" in info["chat_template"]
    assert {"url": "/api"} in httpx.get(flagged.url + "/openapi.json").json()["servers"]
    # --max-request-bytes 4096: a 5 kB body is refused, a small one is not
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    r = httpx.post(flagged.url + "/v1/completions", json={**body, "user": "x" * 5000}, timeout=60)
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
    assert httpx.post(flagged.url + "/v1/completions", json=body, timeout=60).status_code == 200


# ---------------------------------------------------------------------------- request size
def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_oversized_bodies_are_refused_before_parsing_and_memory_stays(server):
    import time

    url = server.url + "/v1/completions"
    big = json.dumps({"model": MODEL, "prompt": "word " * 2_000_000, "max_tokens": 1})  # 10 MB
    before = _rss_bytes(server.proc.pid)
    for _ in range(5):
        t0 = time.monotonic()
        r = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"], r.text[:200]
        assert time.monotonic() - t0 < 5  # refused, not tokenized (about 6 s before the limit)
    # a chunked body (no Content-Length) is counted as it arrives
    chunks = (big[i:i + 65536].encode() for i in range(0, len(big), 65536))
    r = httpx.post(url, content=chunks, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert _rss_bytes(server.proc.pid) - before < 64 << 20
    # under the limit: parsed as usual (a prompt too long for the context is the length 400)
    assert_400(httpx.post(url, json={"model": MODEL, "prompt": "word " * 20_000, "max_tokens": 1}, timeout=60), "prompt",
               "maximum context length")
    ok = httpx.post(url, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_logprobs_minus_one_is_the_whole_vocabulary_when_max_logprobs_allows(server, flagged):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0}
    assert_400(httpx.post(server.url + "/v1/completions", json={**body, "logprobs": -1}, timeout=60), "logprobs",
               "--max-logprobs")
    assert_400(httpx.post(server.url + "/v1/completions", json={**body, "logprobs": 21}, timeout=60), "logprobs",
               "[0, 20]")
    r = httpx.post(flagged.url + "/v1/completions", json={**body, "logprobs": -1}, timeout=120).json()
    top = r["choices"][0]["logprobs"]["top_logprobs"]
    assert len(top) == 2 and all(len(d) > 10_000 for d in top)  # every token (texts that repeat collapse)
    probs = sum(math.exp(v) for v in top[0].values())
    assert 0.5 < probs <= 1.0 + 1e-3


def test_prompt_ending_inside_a_utf8_character_streams_the_whole_character(server):
    """The prompt's last token is the first byte of "é" (byte-level BPE: 'Ã' = 0xC3); the output,
    forced by allowed_token_ids, is its second byte ('©' = 0xA9) then " ok": the text starts with
    "é", streamed and not (no U+FFFD, no lost character)."""
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "caf", "return_token_strs": True}).json()
    from transformers import AutoTokenizer

    from server_utils import tiny_model_dir

    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    first, second = hf.convert_tokens_to_ids("Ã"), hf.convert_tokens_to_ids("©")
    body = {"model": MODEL, "prompt": tok["tokens"] + [first], "max_tokens": 1, "allowed_token_ids": [second],
            "temperature": 0.0}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert full["choices"][0]["text"] == "é"
    events = sse_events(server.url + "/v1/completions", {**body, "stream": True})
    assert "".join(c["text"] for e in events for c in e["choices"]) == "é"


# ---------------------------------------------------------------------------- rate limits
@pytest.fixture(scope="module")
def limited():
    srv = shared_server("rate-limited", [*DEFAULT_ARGS, "--api-key", "k1", "k2", "--rate-limit-rpm", "3",
                                         "--rate-limit-tpm", "200"])
    srv.api_key = "k1"  # for its metrics()
    return srv


def test_rate_limits_per_api_key_answer_429_with_retry_after(limited):
    url = limited.url + "/v1/completions"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    k1, k2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
    assert [httpx.post(url, json=body, headers=k1, timeout=60).status_code for _ in range(3)] == [200] * 3
    refused = httpx.post(url, json=body, headers=k1, timeout=60)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    err = refused.json()["error"]
    assert err["type"] == "RateLimitError" and err["code"] == 429 and "--rate-limit-rpm" in err["message"]
    assert httpx.post(url, json=body, headers=k2, timeout=60).status_code == 200  # its own buckets
    # tokens: prompt + max_tokens over the whole bucket can never fit (no Retry-After)
    too_big = httpx.post(url, json={**body, "max_tokens": 300}, headers=k2, timeout=60)
    assert too_big.status_code == 429 and "retry-after" not in too_big.headers
    assert "--rate-limit-tpm" in too_big.json()["error"]["message"]
    metrics = limited.metrics()
    assert metrics['pagedllm:rate_limited_requests_total{limit="requests",model_name="tiny"}'] >= 1
    assert metrics['pagedllm:rate_limited_requests_total{limit="tokens",model_name="tiny"}'] >= 1
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer k3"}, timeout=60).status_code == 401


def test_openapi_document_says_what_the_server_answers(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    health = doc["paths"]["/health"]["get"]["responses"]
    assert set(health) >= {"200", "503"} and not health["200"].get("content")
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert any(ct.startswith("text/plain") for ct in metrics)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert {"400", "401", "413", "429", "503"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
