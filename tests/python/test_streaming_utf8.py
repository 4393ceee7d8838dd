"""Fault: streaming corrupts multi-byte UTF-8 — tokens decoded one at a time, or a non-monotonic
hold-back of incomplete characters (public case C09: llama.cpp #4036 / PR #4446, TensorRT-LLM
#2595, SGLang #31598). Every path that streams text is checked on a random-weight model with
SmolLM2's byte-level vocabulary (its tokens are often partial UTF-8 bytes): /v1/completions and
/v1/chat/completions SSE, AsyncLLM.generate with DELTA and CUMULATIVE outputs and the offline
engine's step() with DELTA outputs. The joined deltas equal the non-streamed text exactly, every
SSE line is valid UTF-8 JSON, and each test asserts that a character really was split across
tokens. (a)-(c) with chat prompts: test_server_api.py::test_c09_chat_stream_utf8."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from bundled_llm import random_llm  # noqa: E402
from server_utils import DEFAULT_ARGS, shared_server, tiny_model_dir  # noqa: E402

MODEL = "tiny"


def split_characters(tok, ids: list[int]) -> int:
    """How many times a character's UTF-8 bytes are spread over 2-4 consecutive tokens: the
    token alone decodes to U+FFFD, but together with the next 1-3 tokens it decodes cleanly."""
    count = 0
    for j in range(len(ids) - 1):
        if "\ufffd" not in tok.decode([ids[j]]):
            continue
        for k in range(j + 2, min(j + 4, len(ids)) + 1):
            if "\ufffd" not in tok.decode(ids[j:k]):
                count += 1
                break
    return count


@pytest.fixture(scope="module")
def server():
    return shared_server("default", DEFAULT_ARGS)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir()))


def sse_raw(server, path: str, body: dict) -> list[dict]:
    """Every `data:` line decoded as strict UTF-8 JSON ([DONE] last, dropped)."""
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        raw = b"".join(resp.iter_raw())
    lines = [ln for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(ln[6:].decode("utf-8", errors="strict")) for ln in lines[:-1]]


# logit_bias that makes the random model emit a random mix of the byte tokens of "世" (7906 =
# bytes E4 B8, 240 = byte 96) and "😀" (10813, 242, 218) and a space: valid characters split
# across tokens next to invalid byte runs (which must come out as the same U+FFFD as decode()).
SPLIT_BIAS = {"7906": 100, "240": 100, "10813": 100, "242": 100, "218": 100, "220": 100}


def _check_split_tokens(tok):
    assert "\ufffd" in tok.decode([7906]) and tok.decode([7906, 240]) == "世"
    assert tok.decode([10813, 242, 218]) == "😀"


@pytest.mark.parametrize("prompt", ["Hello, world", "Repeat exactly: A 世ab 😀 café ďábel"])
def test_completions_stream_equals_non_stream_greedy(server, tok, prompt):
    """Case (d): the random model, greedy, ignore_eos, a long output, streamed and not."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    events = sse_raw(server, "/v1/completions", {**body, "stream": True})
    deltas = [c["text"] for e in events for c in e["choices"]]
    ids = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
    assert ids == full["token_ids"] and len(ids) == 400
    assert "".join(deltas) == full["text"]
    assert full["text"] == tok.decode(full["token_ids"], skip_special_tokens=True)
    assert sum(d.count("\ufffd") for d in deltas) == full["text"].count("\ufffd")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_split_characters_stream_equals_non_stream(server, tok, path):
    _check_split_tokens(tok)
    chat = "chat" in path
    body = {"model": MODEL, "max_tokens": 200, "temperature": 1.0, "seed": 11, "ignore_eos": True,
            "return_token_ids": True, "logit_bias": SPLIT_BIAS}
    body.update({"messages": [{"role": "user", "content": "Write in Chinese: 猫"}]} if chat else {"prompt": "数字"})
    full = httpx.post(server.url + path, json=body, timeout=120).json()["choices"][0]
    text = full["message"]["content"] if chat else full["text"]
    events = sse_raw(server, path, {**body, "stream": True})
    deltas = [(c["delta"].get("content") or "") if chat else c["text"] for e in events for c in e["choices"]]
    assert "".join(deltas) == text
    # the token ids of steps whose text was held back still reach the client
    assert [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])] == full["token_ids"]
    assert text == tok.decode(full["token_ids"], skip_special_tokens=True)
    assert sum(d.count("\ufffd") for d in deltas) == text.count("\ufffd")
    assert split_characters(tok, full["token_ids"]) > 0, "no character was split across tokens"
    assert any(ord(ch) >= 0x3000 and ch != "\ufffd" for ch in text)  # a multi-byte character came out whole


def _biased(max_tokens=200):
    from pagedllm import SamplingParams

    return SamplingParams(temperature=1.0, seed=11, max_tokens=max_tokens, ignore_eos=True,
                          logit_bias={int(k): float(v) for k, v in SPLIT_BIAS.items()})


def _engine_delta_stream(llm, ids, params):
    from pagedllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.DELTA
    engine = llm.llm_engine
    rid = engine.new_request_id()
    engine.add_request(rid, None, ids, params)
    deltas, token_ids = [], []
    while True:
        for o in engine.step():
            if o.request_id != rid:
                continue
            deltas.append(o.outputs[0].text)
            token_ids += o.outputs[0].token_ids
            if o.finished:
                return deltas, token_ids


def test_offline_engine_delta_stream():
    llm = random_llm()
    tok = llm.get_tokenizer()
    _check_split_tokens(tok)
    ids = tok.encode("Hello, world")
    full = llm.generate({"prompt_token_ids": ids}, _biased(), use_tqdm=False)[0].outputs[0]
    deltas, token_ids = _engine_delta_stream(llm, ids, _biased())
    assert token_ids == full.token_ids
    assert "".join(deltas) == full.text
    assert sum(d.count("\ufffd") for d in deltas) == full.text.count("\ufffd")
    assert split_characters(tok, token_ids) > 0


@pytest.mark.parametrize("kind", ["DELTA", "CUMULATIVE"])
def test_async_llm_streams(kind):
    from pagedllm.engine.async_llm import AsyncEngineArgs, AsyncLLM
    from pagedllm.sampling_params import RequestOutputKind

    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tiny_model_dir()), dtype="float32", max_model_len=512,
                                                    kv_cache_memory_bytes=16 << 20))
    try:
        tok = eng.get_tokenizer()
        prompt = {"prompt_token_ids": tok.encode("Hello, world")}

        async def run(output_kind):
            p = _biased()
            p.output_kind = output_kind
            return [o async for o in eng.generate(prompt, p, f"utf8-{output_kind.name}")]

        final = asyncio.run(run(RequestOutputKind.FINAL_ONLY))[-1].outputs[0]
        outs = asyncio.run(run(RequestOutputKind[kind]))
    finally:
        eng.shutdown()
    assert len(outs) > 1
    texts = [o.outputs[0].text for o in outs]
    if kind == "DELTA":
        joined = "".join(texts)
        ids = [t for o in outs for t in o.outputs[0].token_ids]
    else:
        for a, b in zip(texts, texts[1:]):
            assert b.startswith(a)  # never retracts a character
        joined = texts[-1]
        ids = outs[-1].outputs[0].token_ids
    assert ids == final.token_ids and joined == final.text
    if kind == "DELTA":
        assert sum(t.count("\ufffd") for t in texts) == final.text.count("\ufffd")
    assert split_characters(tok, ids) > 0
