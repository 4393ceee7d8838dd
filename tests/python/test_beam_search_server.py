"""Beam search through the server (vLLM's extra request fields use_beam_search / length_penalty,
n beams): n choices, best first; streamed text == non-streamed; one beam == greedy decoding; chat
too; bad combinations are 400s naming the field and the server keeps serving with no KV held."""

from __future__ import annotations

import json

import httpx

MODEL = "tiny"
PROMPT = "The sky over the harbour was grey."

# fixtures server / client: conftest.py's (the shared default server)


def post(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_texts(server, path, body, n):
    texts, finish = [""] * n, [None] * n
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        raw = b"".join(resp.iter_raw())
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        for c in json.loads(line[6:]).get("choices", []):
            piece = c["text"] if "text" in c else (c.get("delta") or {}).get("content") or ""
            texts[c["index"]] += piece
            finish[c["index"]] = c.get("finish_reason") or finish[c["index"]]
    return texts, finish


def test_completions_beam_search(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "n": 3, "use_beam_search": True}
    out = post(server, "/v1/completions", body)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    assert len({c["text"] for c in choices}) == 3  # three different hypotheses
    assert out["usage"]["completion_tokens"] > 0
    texts, finish = streamed_texts(server, "/v1/completions", body, 3)
    assert texts == [c["text"] for c in choices]
    assert finish == [c["finish_reason"] for c in choices]
    again = post(server, "/v1/completions", {**body, "length_penalty": 1.0})
    assert [c["text"] for c in sorted(again["choices"], key=lambda c: c["index"])] == texts  # deterministic


def test_one_beam_is_greedy_decoding(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16}
    beam = post(server, "/v1/completions", {**body, "use_beam_search": True, "n": 1})
    greedy = post(server, "/v1/completions", {**body, "temperature": 0.0})
    assert beam["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_chat_beam_search(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "n": 2,
            "use_beam_search": True}
    out = post(server, "/v1/chat/completions", body)
    contents = [c["message"]["content"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert len(contents) == 2
    texts, _ = streamed_texts(server, "/v1/chat/completions", body, 2)
    assert texts == contents


def test_bad_beam_requests_are_400s(server):
    cases = [({"temperature": 0.5}, "temperature"), ({"logprobs": 2}, "use_beam_search"),
             ({"n": 1000}, "n"), ({"length_penalty": "x"}, "length_penalty")]
    for extra, field in cases:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "n": 2, "use_beam_search": True, **extra}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == field, r.json()
    assert server.healthy()
    assert server.metrics().get("pagedllm:num_requests_running", 0) == 0
