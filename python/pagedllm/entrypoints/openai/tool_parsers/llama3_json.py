"""Llama 3.1 / 3.2 JSON tool calls (Meta's "JSON based tool calling" prompt format; vLLM's
"llama3_json" parser): the output is ``{"name": "f", "parameters": {...}}`` (optionally after
``<|python_tag|>``), several calls separated by ``;``; an output that does not start with ``{``
is content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import Parsed, ToolParser, parse_call_object
from pagedllm.entrypoints.openai.tool_parsers.partial_json import skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        rest = text[i:]
        if rest.startswith(PYTHON_TAG):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(rest):  # still may become the tag (or be empty)
            return Parsed("")
        if i >= len(text):
            return Parsed("" if not final or rest.startswith(PYTHON_TAG) else text)
        if text[i] != "{":
            return Parsed(text)
        out = Parsed("")
        while i < len(text):
            call, end = parse_call_object(text, i, ("parameters", "arguments"))
            out.calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            elif i < len(text):
                raise ValueError(f"unexpected {text[i]!r} after a tool call")
        if final and not (out.calls and all(c.complete for c in out.calls)):
            raise ValueError("a tool call was cut off")
        return out
