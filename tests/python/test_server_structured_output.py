"""Structured output and tool calling through the server and the official `openai` client, on
the bundled SmolLM2-135M with the bundled hermes_tools chat template, --enable-auto-tool-choice
--tool-call-parser hermes and --structured-outputs-config disable_any_whitespace (the 135M model
otherwise pads JSON with whitespace).

response_format json_schema / json_object on chat and completions (outputs validate with
`jsonschema`; streamed text == non-streamed text), vLLM's structured_outputs field (regex,
choice, grammar); tool_choice "required", a named function and "auto" (the model's hermes text,
forced through structured_outputs, read by the parser): calls whose arguments validate against the
tool's schema, the same calls streamed as delta.tool_calls, finish_reason per OpenAI's rule; tool
messages rendered by the template (usage.prompt_tokens == the locally rendered prompt's length);
invalid schemas, regexes, tool choices: 400 naming the field, the server healthy after them."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_utils import RemoteServer  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 12}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,10}", '
               r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def server():
    s = RemoteServer(MODEL, ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", "256MiB",
                             "--chat-template", "hermes_tools", "--enable-auto-tool-choice",
                             "--tool-call-parser", "hermes",
                             "--structured-outputs-config", '{"disable_any_whitespace": true}'])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, **kw):
    return client.chat.completions.create(**{"model": MODEL, "temperature": 0.0, "max_tokens": 120, **kw})


def streamed(client, **kw):
    """(content, {index: [id, name, arguments]}, finish_reason) joined from a stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**{"model": MODEL, "temperature": 0.0, "max_tokens": 120,
                                                   "stream": True, **kw}):
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function"
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                calls[tc.index][2] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def check_calls(message_calls):
    for call in message_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---------------------------------------------------------------------------- response_format
@pytest.mark.parametrize("schema", [
    PERSON,
    {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0,
                                                                            "maximum": 1}},
     "required": ["ok", "score"], "additionalProperties": False},
])
def test_chat_json_schema_validates_streamed_or_not(client, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    r = chat(client, messages=[{"role": "user", "content": "Answer in JSON."}], response_format=fmt)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)
    content, calls, finish = streamed(client, messages=[{"role": "user", "content": "Answer in JSON."}],
                                      response_format=fmt)
    assert (content, calls, finish) == (text, {}, "stop")


def test_json_object_on_chat_and_completions(client):
    r = chat(client, messages=[{"role": "user", "content": "Give me some JSON."}],
             response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=120, temperature=0.0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)


def test_structured_outputs_field_on_completions(client):
    def complete(prompt, so, **kw):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0.8, seed=5,
                                         extra_body={"structured_outputs": so}, **kw).choices

    for c in complete("Phone number:", {"regex": r"\+33 [1-9]( \d\d){4}"}, n=3):
        assert re.fullmatch(r"\+33 [1-9]( \d\d){4}", c.text), c.text
    for c in complete("Is the sky green?", {"choice": ["yes", "no", "maybe"]}, n=3):
        assert c.text in ("yes", "no", "maybe")
    grammar = 'root ::= "(" num (" + " num)* ")" \nnum ::= [1-9] [0-9]?'
    for c in complete("A sum:", {"grammar": grammar}):
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", c.text), c.text
    c = complete("A person:", {"json": PERSON})[0]
    jsonschema.validate(json.loads(c.text), PERSON)


# ---------------------------------------------------------------------------- tools
def test_tool_choice_required(client):
    r = chat(client, messages=ASK, tools=TOOLS, tool_choice="required")
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and msg.tool_calls
    check_calls(msg.tool_calls)
    content, calls, finish = streamed(client, messages=ASK, tools=TOOLS, tool_choice="required")
    assert content == "" and finish == "tool_calls"
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    one = chat(client, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1


def test_tool_choice_named_function(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, messages=ASK, tools=TOOLS, tool_choice=choice)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"  # OpenAI: a named function's call ends with "stop"
    assert [c.function.name for c in msg.tool_calls] == ["get_time"]
    check_calls(msg.tool_calls)
    content, calls, finish = streamed(client, messages=ASK, tools=TOOLS, tool_choice=choice)
    assert (content, finish) == ("", "stop")
    assert [(n, a) for _, n, a in calls.values()] == [("get_time", msg.tool_calls[0].function.arguments)]


def test_tool_choice_auto_reads_the_models_hermes_calls(client):
    forced = {"structured_outputs": {"regex": HERMES_CALL}}  # the model's own text, in hermes format
    r = chat(client, messages=ASK, tools=TOOLS, extra_body=forced)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    check_calls(msg.tool_calls)
    content, calls, finish = streamed(client, messages=ASK, tools=TOOLS, extra_body=forced)
    assert (content, finish) == ("", "tool_calls")
    assert [(n, a) for _, n, a in calls.values()] == [("get_weather", msg.tool_calls[0].function.arguments)]
    # a stop string on the closing tag: the unclosed last block still counts, streamed or not
    stopped = {"structured_outputs": {"regex": HERMES_CALL}, "stop": ["</tool_call>"]}
    r = chat(client, messages=ASK, tools=TOOLS, extra_body=stopped)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    assert streamed(client, messages=ASK, tools=TOOLS, extra_body=stopped)[2] == "tool_calls"
    # a call cut off by max_tokens: text, finish_reason "length", streamed or not
    r = chat(client, messages=ASK, tools=TOOLS, extra_body=forced, max_tokens=12)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls == []
    assert r.choices[0].message.content.startswith("<tool_call>")
    assert streamed(client, messages=ASK, tools=TOOLS, extra_body=forced, max_tokens=12)[2] == "length"
    # without a call in the output, "auto" answers in text
    r = chat(client, messages=ASK, tools=TOOLS, max_tokens=12)
    assert r.choices[0].message.tool_calls == [] and r.choices[0].message.content


def test_tool_results_go_through_the_chat_template(client, server):
    from transformers import AutoTokenizer

    from pagedllm.entrypoints.chat_templates import load_chat_template
    from pagedllm.model_executor.loader import resolve_model

    first = chat(client, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r = chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls == []
    tok = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))
    local = [dict(m) for m in history]
    local[1] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}
    text = tok.apply_chat_template(local, chat_template=load_chat_template("hermes_tools"), tools=TOOLS,
                                   tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    count = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": TOOLS}).json()["count"]
    assert count == r.usage.prompt_tokens


# ---------------------------------------------------------------------------- bad input
BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"jsonn": {}}}, "structured_outputs"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": [], "tool_choice": "none"}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": ASK + [{"role": "tool", "content": "21"}]}, "tool_call_id"),
    ("/v1/chat/completions", {"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
     "arguments is not JSON"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 7}}}}}], "tool_choice": "required"},
     "tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {  # resolves alone, not nested
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                     "b": {"$ref": "#/properties/a"}}}}}],
        "tool_choice": "required"}, "tools"),
]


def test_bad_constraints_are_400s_naming_the_field(server):
    for path, extra, param in BAD:
        body = ({"model": MODEL, "prompt": "hi", "max_tokens": 4} if path == "/v1/completions"
                else {"model": MODEL, "messages": ASK, "max_tokens": 4})
        resp = httpx.post(server.url + path, json={**body, **extra}, timeout=60)
        assert resp.status_code == 400, (extra, resp.text)
        err = resp.json()["error"]
        assert err["code"] == 400 and (err["param"] == param or param in err["message"]), (extra, err)
        assert "/project/" not in err["message"] and not err["message"].endswith("\n"), err  # no xgrammar log noise
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 3
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert re.search(r"^pagedllm:num_requests_running\{[^}]*\} 0\.0$", metrics, re.M)
    assert re.search(r"^pagedllm:kv_cache_usage_perc\{[^}]*\} 0\.0$", metrics, re.M)
