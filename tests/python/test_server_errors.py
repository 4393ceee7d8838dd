"""Client mistakes get OpenAI error objects (4xx naming the field), never a 5xx, and the server
stays healthy: empty prompts (C18), context length (C19, checked before any SSE event),
malformed bodies and wrong types (C20, plus hypothesis-generated bodies against the app's
OpenAPI schema), unsupported fields, unknown model; API key on (401) and queue limit (503)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from server_utils import DEFAULT_ARGS, MAX_MODEL_LEN as L, shared_server  # noqa: E402

MODEL = "tiny"
REFERENCE = {"model": MODEL, "prompt": [11, 22, 33, 44], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
             "return_token_ids": True}


@pytest.fixture(scope="module")
def server():
    return shared_server("default", DEFAULT_ARGS)


@pytest.fixture(scope="module")
def reference(server):
    ids = httpx.post(server.url + "/v1/completions", json=REFERENCE, timeout=60).json()["choices"][0]["token_ids"]
    assert len(ids) == 8
    return REFERENCE, ids


def post(server, path: str, body=None, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def assert_error(resp: httpx.Response, status: int, *words: str) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["code"] == status and err["type"] and err["message"]
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err


# ---------------------------------------------------------------------------- C18 empty prompts
@pytest.mark.parametrize("prompt", ["", [""], [], [[]]])
def test_empty_completion_prompt_is_400(server, reference, prompt):
    for stream in (False, True):
        resp = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 20,
                                                "temperature": 0, "stream": stream})
        assert_error(resp, 400, "prompt", "empty")
    assert server.healthy(reference)


def test_empty_chat_messages_is_400_and_empty_content_is_served(server, reference):
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 20}), 400,
                 "messages")
    ok = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": ""}],
                                               "max_tokens": 20, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] >= 1
    assert server.healthy(reference)


# ---------------------------------------------------------------------------- C19 context length
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_context_length_limits(server, reference, path):
    def body(n_prompt: int, max_tokens, stream: bool):
        b = {"model": MODEL, "temperature": 0, "stream": stream, "ignore_eos": True}
        if max_tokens is not None:
            b["max_tokens"] = max_tokens
        if path == "/v1/completions":
            b["prompt"] = [7] * n_prompt
        else:  # the ChatML wrapper of one user message costs 5 tokens + the generation prompt 3
            overhead = post(server, "/tokenize", {"messages": [{"role": "user", "content": ""}]}).json()["count"]
            b["messages"] = [{"role": "user", "content": " a" * (n_prompt - overhead)}]
        return b

    for stream in (False, True):
        for n, m in [(L + 1, 1), (L, 1), (L - 1, 2), (L // 2, L)]:
            resp = post(server, path, body(n, m, stream))
            err = assert_error(resp, 400, str(L))
            assert str(n) in err["message"]  # names the counts
            assert "data:" not in resp.text  # a 400 before any SSE event
        ok = post(server, path, body(L - 1, 1, stream))
        assert ok.status_code == 200, ok.text
        if not stream:
            choice = ok.json()["choices"][0]
            assert ok.json()["usage"]["completion_tokens"] == 1 and choice["finish_reason"] == "length"
            assert ok.json()["usage"]["prompt_tokens"] == L - 1
        else:
            assert ok.text.rstrip().endswith("data: [DONE]")
    omitted = post(server, path, body(L - 3, None, False))
    assert omitted.status_code == 200 and omitted.json()["usage"]["completion_tokens"] == 3
    assert server.healthy(reference)


# ---------------------------------------------------------------------------- C20 malformed bodies
MALFORMED = [
    ("raw", b'{"model": "tiny", "prompt": "hi", bogus}', "body"),
    ("raw", b'["model", "prompt"]', "body"),
    ("raw", b"", "body"),
    ("json", {"model": MODEL, "prompt": "hi", "stream": "false"}, "stream"),
    ("json", {"model": MODEL, "prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ("json", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("json", {"model": MODEL, "prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("json", {"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    ("json", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ("json", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ("json", {"model": MODEL, "prompt": "hi", "n": 0}, "n "),
    ("json", {"model": MODEL}, "prompt"),
    ("json", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("json", {"model": MODEL, "prompt": [10**9]}, "vocabulary"),
    ("json", {"model": MODEL, "prompt": "hi", "suffix": "x"}, "suffix"),
    ("json", {"model": MODEL, "prompt": "hi", "use_beam_search": True, "temperature": 0.7}, "temperature"),
    ("json", {"model": MODEL, "prompt": "hi", "use_beam_search": True, "stop": ["x"]}, "use_beam_search"),
    ("json", {"model": MODEL, "prompt": "hi", "use_beam_search": True, "length_penalty": "long"}, "length_penalty"),
    ("json", {"model": MODEL, "prompt": "hi", "logprobs": 1000}, "logprobs"),
    ("json", {"model": MODEL, "prompt": "hi", "logprobs": -1}, "logprobs"),
    ("json", {"model": MODEL, "prompt": "hi", "n": 100000}, "max_num_seqs"),
    ("raw", b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', "temperature"),
    ("raw", b'{"model": "tiny", "prompt": "hi", "logit_bias": {"5": -Infinity}}', "logit_bias"),
    ("raw", b'{"model": "tiny", "prompt": "hi", "top_p": NaN}', "top_p"),
]

CHAT_MALFORMED = [
    ({"model": MODEL, "messages": "hello"}, "messages"),
    ({"model": MODEL, "messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, "tool_choice"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     "response_format"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": "5"},
     "max_completion_tokens"),
]


def test_malformed_completion_bodies_are_400_naming_the_field(server, reference):
    for kind, body, word in MALFORMED:
        if kind == "raw":
            resp = httpx.post(server.url + "/v1/completions", content=body, timeout=30,
                              headers={"Content-Type": "application/json"})
        else:
            resp = post(server, "/v1/completions", body)
        err = assert_error(resp, 400, word)
        if kind == "json" and word.strip() in body:
            assert err["param"] == word.strip() or word.strip() in err["message"]
    assert server.healthy(reference)


def test_stream_string_false_never_streams(server):
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "false"})
    assert resp.status_code == 400 and resp.headers["content-type"].startswith("application/json")


def test_text_plain_content_type_is_4xx(server, reference):
    resp = httpx.post(server.url + "/v1/completions", content=json.dumps({"model": MODEL, "prompt": "hi"}),
                      headers={"Content-Type": "text/plain"}, timeout=30)
    assert 400 <= resp.status_code < 500 and "error" in resp.json()
    assert server.healthy(reference)


def test_malformed_chat_bodies_are_400_naming_the_field(server, reference):
    for body, word in CHAT_MALFORMED:
        assert_error(post(server, "/v1/chat/completions", body), 400, word)
    assert server.healthy(reference)


def test_unknown_model_is_404(server):
    for path, body in [("/v1/completions", {"model": "nope", "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]})]:
        assert_error(post(server, path, body), 404, "nope")


def test_openai_client_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[7] * (L + 1), max_tokens=1)
    assert str(L) in str(err.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=1)


# ---------------------------------------------------------------------------- fuzzing (bounded)
def _schema(server, name: str) -> dict:
    spec = httpx.get(server.url + "/openapi.json", timeout=30).json()
    return spec["components"]["schemas"][name]


_ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.mark.parametrize("path,schema", [("/v1/completions", "CompletionRequest"),
                                         ("/v1/chat/completions", "ChatCompletionRequest")])
def test_fuzzed_bodies_never_5xx(server, reference, path, schema):
    """Bodies built from the app's OpenAPI schema: a valid base plus 1-3 fields (known to the
    schema, or unknown) set to arbitrary JSON values; every answer must be < 500."""
    props = sorted(_schema(server, schema)["properties"])
    base = ({"model": MODEL, "prompt": "hi", "max_tokens": 2} if path == "/v1/completions"
            else {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    fields = st.sampled_from(props) | st.text(min_size=1, max_size=8)
    bodies = st.dictionaries(fields, _ANY_JSON, min_size=1, max_size=3).map(lambda extra: {**base, **extra})
    seen = []

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def check(body):
        if body.get("stream") is True:
            body = {**body, "stream": False}
        for key in ("max_tokens", "max_completion_tokens"):  # keep each example short
            if body.get(key, 0) is None or (isinstance(body.get(key), int) and body[key] > 4):
                body[key] = 4
        if isinstance(body.get("n"), int) and body["n"] > 4:
            body["n"] = 4
        resp = post(server, path, body)
        seen.append(resp.status_code)
        assert resp.status_code < 500, (body, resp.text)
        if resp.status_code >= 400:
            assert "error" in resp.json()

    check()
    assert any(code == 400 for code in seen)
    assert server.healthy(reference)


# ---------------------------------------------------------------------------- API key, queue limit
@pytest.fixture(scope="module")
def keyed_server():
    args = [a for a in DEFAULT_ARGS]
    i = args.index("--max-num-seqs")
    args[i + 1] = "2"
    return shared_server("keyed", [*args, "--max-queued-requests", "1"], api_key="s3cret")


def test_api_key_required_on_v1_routes(keyed_server):
    url = keyed_server.url
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert_error(httpx.post(url + "/v1/completions", json=body), 401)
    assert_error(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer s3cret0"}), 401)
    ok = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=60)
    assert ok.status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # open, as vLLM's
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in keyed_server.client().models.list().data] == ["tiny", "tiny-alias"]


def test_queue_limit_answers_503_with_retry_after(keyed_server):
    """max_num_seqs=2, --max-queued-requests 1: two long requests run, a third waits, and a
    fourth is refused with 503 + Retry-After; after they finish requests are accepted again."""
    headers = {"Authorization": "Bearer s3cret"}
    long_body = {"model": MODEL, "prompt": [5] * 8, "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    results = []

    def run():
        results.append(httpx.post(keyed_server.url + "/v1/completions", json=long_body, headers=headers, timeout=120))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    deadline = time.monotonic() + 10
    while keyed_server.metrics().get("pagedllm:num_requests_waiting", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert keyed_server.metrics()["pagedllm:num_requests_waiting"] == 1
    refused = httpx.post(keyed_server.url + "/v1/completions", json={**long_body, "max_tokens": 1}, headers=headers,
                         timeout=30)
    err = assert_error(refused, 503, "--max-queued-requests=1")
    assert err["type"] and refused.headers["retry-after"]
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200, 200, 200]
    again = httpx.post(keyed_server.url + "/v1/completions", json={**long_body, "max_tokens": 1}, headers=headers,
                       timeout=30)
    assert again.status_code == 200


def test_error_after_the_stream_started_is_one_event():
    """Once the 200 and the first events are sent, an error ends the stream as one SSE event with an
    OpenAI error object: an OpenAIError keeps its status and param, anything else is a 500
    "internal error" naming the exception."""
    from pagedllm.entrypoints.openai.errors import OpenAIError
    from pagedllm.entrypoints.openai.serving import sse_error

    for exc, status, param, text in ((OpenAIError("n: too many", 400, "n"), 400, "n", "n: too many"),
                                     (RuntimeError("boom"), 500, None, "internal error: boom")):
        event = sse_error(exc)
        assert event.startswith("data: ") and event.endswith("\n\n"), event
        body = json.loads(event[len("data: "):])
        assert body["error"]["code"] == status and body["error"]["param"] == param, body
        assert text in body["error"]["message"], body
