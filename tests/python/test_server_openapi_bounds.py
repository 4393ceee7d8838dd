"""The OpenAPI document states the bounds the server enforces (issue 31): for every numeric request
field of /v1/completions and /v1/chat/completions with a minimum / maximum in /openapi.json (the
static ranges of protocol.py plus this deployment's max_num_seqs, --max-logprobs and vocabulary),
a value on the bound is served and a value past it is a 400 naming the field. Excluded: the upper
bound of max_tokens, which also depends on the prompt's length (prompt + max_tokens <=
max_model_len, a rule across two fields that JSON schema cannot state)."""

from __future__ import annotations

import math

import httpx
import pytest

BASES = {
    "CompletionRequest": ("/v1/completions", {"model": "tiny", "prompt": [5, 6], "max_tokens": 1}),
    "ChatCompletionRequest": ("/v1/chat/completions",
                              {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
}
#: fields that only take effect with another one set (logprobs counts in chat need logprobs: true)
COMPANIONS = {("ChatCompletionRequest", "top_logprobs"): {"logprobs": True}}
CROSS_FIELD = {"max_tokens", "max_completion_tokens"}


def _numeric_bounds(schema: dict, name: str):
    for field, prop in schema["components"]["schemas"][name]["properties"].items():
        types = {t.get("type") for t in prop.get("anyOf", [prop])}
        kind = "integer" if "integer" in types else "number" if "number" in types else None
        if kind is None:
            continue
        for key in ("minimum", "exclusiveMinimum", "maximum"):
            if key in prop and not (key == "maximum" and field in CROSS_FIELD):
                yield field, kind, key, prop[key]


def _cases(schema: dict):
    for name in BASES:
        for field, kind, key, bound in _numeric_bounds(schema, name):
            step = 1 if kind == "integer" else max(abs(bound), 1.0) * 1e-3
            if key == "minimum":
                yield name, field, bound, bound - step
            elif key == "exclusiveMinimum":
                yield name, field, bound + step, bound - step
            else:
                yield name, field, bound, bound + step


def test_schema_states_bounds_and_the_server_keeps_them(server):
    schema = httpx.get(server.url + "/openapi.json", timeout=10).json()
    cases = list(_cases(schema))
    fields = {(n, f) for n, f, _, _ in cases}
    for expected in [("CompletionRequest", "temperature"), ("CompletionRequest", "top_p"),
                     ("CompletionRequest", "n"), ("CompletionRequest", "logprobs"),
                     ("ChatCompletionRequest", "top_logprobs"), ("CompletionRequest", "seed")]:
        assert expected in fields, expected
    failures = []
    for name, field, inside, outside in cases:
        route, base = BASES[name]
        extra = COMPANIONS.get((name, field), {})
        for value, ok in ((inside, True), (outside, False)):
            if isinstance(value, float) and not math.isfinite(value):
                continue
            resp = httpx.post(server.url + route, json={**base, **extra, field: value}, timeout=120)
            if ok and resp.status_code != 200:
                failures.append(f"{name}.{field}={value!r} (on the bound) got {resp.status_code}: {resp.text[:200]}")
            if not ok:
                body = resp.json() if resp.status_code == 400 else {}
                message = body.get("error", {}).get("message", "")
                if resp.status_code != 400 or field not in message + str(body.get("error", {}).get("param")):
                    failures.append(f"{name}.{field}={value!r} (past the bound) got {resp.status_code}: "
                                    f"{resp.text[:200]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids"])
def test_token_id_fields_are_bounded_by_the_vocabulary(server, field):
    schema = httpx.get(server.url + "/openapi.json", timeout=10).json()
    prop = schema["components"]["schemas"]["CompletionRequest"]["properties"][field]
    items = next(t["items"] for t in prop["anyOf"] if t.get("type") == "array")
    vocab = items["maximum"] + 1
    route, base = BASES["CompletionRequest"]
    assert httpx.post(server.url + route, json={**base, field: [vocab - 1]}, timeout=60).status_code == 200
    bad = httpx.post(server.url + route, json={**base, field: [vocab]}, timeout=60)
    assert bad.status_code == 400 and field in bad.text
