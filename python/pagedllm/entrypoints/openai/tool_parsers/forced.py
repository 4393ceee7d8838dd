"""Outputs that tool_choice constrains (no --tool-call-parser needed, as vLLM): with a named
function the whole output is that function's arguments (a JSON object under its parameters
schema); with "required" it is a JSON array of ``{"name": ..., "parameters": {...}}`` objects, one
per call (vLLM's schema, ``tool_calls.required_schema``)."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.abstract import Parsed, ParsedCall, ToolParser, parse_call_object
from pagedllm.entrypoints.openai.tool_parsers.partial_json import skip_ws


class NamedToolParser(ToolParser):
    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        args = text.lstrip()
        if final:
            json.loads(args)  # ValueError: cut off (max_tokens)
        return Parsed("", [ParsedCall(self.name, args, complete=final)])


class RequiredToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> Parsed:
        out = Parsed("")
        i = skip_ws(text, 0)
        if i >= len(text):
            if final:
                raise ValueError("no tool call")
            return out
        if text[i] != "[":
            raise ValueError("not a JSON array of tool calls")
        i += 1
        while True:
            i = skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i += 1
                continue
            if i >= len(text) or text[i] == "]":
                break
            call, end = parse_call_object(text, i, ("parameters", "arguments"))
            out.calls.append(call)
            if end is None:
                break
            i = end
        if final and not (out.calls and all(c.complete for c in out.calls)):
            raise ValueError("a tool call was cut off")
        return out
