"""Hermes-style tool calls (NousResearch Hermes 2 Pro / Qwen2.5 chat templates; vLLM's "hermes"
parser): ``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``, one block per call,
text before the first block is content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import Parsed, ToolParser, parse_call_object
from pagedllm.entrypoints.openai.tool_parsers.partial_json import partial_overlap, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    needs_special_tokens = True  # <tool_call> is a special token in Hermes and Qwen vocabularies

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(START)
        if first < 0:
            return Parsed(text if final else text[:len(text) - partial_overlap(text, START)])
        out = Parsed(text[:first])
        pos = first
        while pos >= 0:
            body_start = pos + len(START)
            close = text.find(END, body_start)
            body = text[body_start:close if close >= 0 else len(text)]
            j = skip_ws(body, 0)
            if j >= len(body):
                if close >= 0:
                    raise ValueError("an empty <tool_call> block")
                break
            call, end = parse_call_object(body, j, ("arguments", "parameters"))
            if close >= 0 and (end is None or body[end:].strip()):
                raise ValueError("a <tool_call> block that is not one JSON object")
            # an unclosed last block counts once the output is finished (a stop string on
            # </tool_call>, EOS), as vLLM's hermes parser reads it
            call.complete = call.complete and (close >= 0 or (final and not body[end:].strip()))
            out.calls.append(call)
            if close < 0:
                break
            pos = text.find(START, close + len(END))
        if final and not all(c.complete for c in out.calls):
            raise ValueError("a tool call was cut off")
        return out
