"""Tool-call parsers (entrypoints/openai/tool_parsers): hermes, llama3_json and the outputs that
tool_choice "required" / a named function constrain. For every output, cut into random chunks,
the streamed deltas (ToolCallStreamer) concatenate to the non-streamed extraction; the calls and
arguments parse back to the objects the output was built from; malformed or cut-off calls are
content, never a broken call; partial_json's spans only grow as text arrives."""

from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.tool_parsers import (
    HermesToolParser, Llama3JsonToolParser, NamedToolParser, RequiredToolParser, ToolCallStreamer,
)
from pagedllm.entrypoints.openai.tool_parsers.partial_json import scan_object

CALLS = [("get_weather", {"city": "Paris", "days": [1, 2, {"note": "a } and ] inside \" quotes"}]}),
         ("get_time", {}), ("search", {"q": "semi;colon", "k": 3.5e2, "ok": True, "none": None})]


def hermes_text(calls, before="", sep="\n"):
    blocks = [f'<tool_call>{sep}{json.dumps({"name": n, "arguments": a})}{sep}</tool_call>' for n, a in calls]
    return before + "\n".join(blocks)


def llama3_text(calls, tag=True):
    return ("<|python_tag|>" if tag else "") + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def stream(parser, text: str, rng: random.Random):
    s = ToolCallStreamer(parser)
    content, calls = "", {}
    pieces, i = [], 0
    while i < len(text):
        k = rng.randint(1, 7)
        pieces.append(text[i:i + k])
        i += k
    for j, piece in enumerate(pieces + [""]):
        c, entries = s.feed(piece, final=j == len(pieces))
        content += c or ""
        for e in entries:
            if "id" in e:
                assert e["index"] not in calls and e["type"] == "function" and e["id"].startswith("chatcmpl-tool-")
                calls[e["index"]] = [e["function"]["name"], ""]
            calls[e["index"]][1] += e["function"]["arguments"]
    return content, [tuple(calls[k]) for k in sorted(calls)]


CASES = [
    (HermesToolParser(), hermes_text(CALLS, "Let me look that up. "), "Let me look that up. ", CALLS),
    (HermesToolParser(), hermes_text(CALLS[:1], sep=""), None, CALLS[:1]),
    (Llama3JsonToolParser(), llama3_text(CALLS), None, CALLS),
    (Llama3JsonToolParser(), llama3_text(CALLS[1:], tag=False), None, CALLS[1:]),
    (RequiredToolParser(), json.dumps([{"name": n, "parameters": a} for n, a in CALLS]), None, CALLS),
    (NamedToolParser("get_weather"), json.dumps(CALLS[0][1]), None, CALLS[:1]),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_streamed_deltas_join_to_the_extracted_calls(parser, text, content, calls):
    got_content, got_calls = parser.extract(text)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got_calls] == calls
    rng = random.Random(len(text))
    for _ in range(25):
        s_content, s_calls = stream(parser, text, rng)
        assert s_content == (content or "")
        assert s_calls == got_calls


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), "No tools needed: 2 < 3 and <b>bold</b>."),
    (HermesToolParser(), 'Broken: <tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>'),
    (HermesToolParser(), 'Cut off: <tool_call>\n{"name": "f", "arguments": {"x": 1'),
    (Llama3JsonToolParser(), "Plain text answer, not a call."),
    (Llama3JsonToolParser(), '{"name": "f", "parameters": {"x": 1}'),
    (Llama3JsonToolParser(), '{"not_a_call": 1}'),
    (RequiredToolParser(), '[{"name": "f", "parameters": {"x": 1}'),
    (NamedToolParser("f"), '{"x": 1'),
])
def test_anything_but_complete_calls_is_content(parser, text):
    content, calls = parser.extract(text)
    assert calls == [] and content == text


def test_text_that_may_become_a_tag_is_held_back_then_released():
    s = ToolCallStreamer(HermesToolParser())
    assert s.feed("Answer <tool") == ("Answer ", [])
    assert s.feed("box> done") == ("<toolbox> done", [])
    s = ToolCallStreamer(Llama3JsonToolParser())
    assert s.feed("  ") == (None, [])
    assert s.feed("Hi") == ("  Hi", [])


def test_partial_object_spans_only_grow():
    """Every cut of an object: each member's value text is a prefix of its final text."""
    text = json.dumps({"name": "f", "arguments": {"a": [1, "x]}"], "b": {"c": None}}, "n": -12.5})
    final, end = scan_object(text, 0)
    assert end == len(text)
    spans = {m.key: text[m.start:m.end] for m in final}
    assert [json.loads(v) for v in spans.values()] == ["f", {"a": [1, "x]}"], "b": {"c": None}}, -12.5]
    for cut in range(1, len(text)):
        members, end = scan_object(text[:cut], 0)
        assert end is None
        for m in members:
            if m.start is not None:
                part = text[:cut][m.start:m.end if m.end is not None else cut]
                assert spans[m.key].startswith(part), (cut, m)


def test_a_call_that_breaks_after_it_began_streaming_sends_nothing_more():
    """Cut off by max_tokens: the stream has sent the call's start; it sends no raw text after it
    (the finished response, which never streamed, returns the text as content)."""
    s = ToolCallStreamer(HermesToolParser())
    c1, e1 = s.feed('Hi <tool_call>\n{"name": "f", ')
    c2, e2 = s.feed('"arguments": {"a": 1')
    assert (c1, e1) == ("Hi ", [{"index": 0, "id": e1[0]["id"], "type": "function",
                                 "function": {"name": "f", "arguments": ""}}])
    assert (c2, e2) == (None, [{"index": 0, "function": {"arguments": '{"a": 1'}}])
    assert s.feed("2", final=True) == (None, [])
    assert HermesToolParser().extract('Hi <tool_call>\n{"name": "f", "arguments": {"a": 12') == (
        'Hi <tool_call>\n{"name": "f", "arguments": {"a": 12', [])


def test_an_unclosed_last_block_counts_once_the_output_is_finished():
    """stop=["</tool_call>"] or EOS right after the object: vLLM's hermes parser reads the call."""
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
    assert HermesToolParser().extract(text) == ("Sure. ", [("f", '{"a": 1}')])
    s = ToolCallStreamer(HermesToolParser())
    s.feed(text)
    assert s.feed("", final=True) == (None, []) and s.called
    broken = ToolCallStreamer(HermesToolParser())
    broken.feed('<tool_call>\n{"name": "f", "arguments": {"a": ')
    assert broken.feed("", final=True) == (None, []) and not broken.called  # finish_reason stays the engine's
