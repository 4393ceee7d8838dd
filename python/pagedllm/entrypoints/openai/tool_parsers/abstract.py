"""What every tool-call parser gives, and how a stream of parses becomes OpenAI's deltas.

A parser reads the model's output text so far and returns ``Parsed``: the content (text for the
user) and the tool calls, each with its function name (once complete) and its arguments' JSON text
so far. Parsers are written so that each field only grows as text arrives (text that may still
turn into a tool call, such as a partial ``<tool_c``, is held back from content), which lets the
same function serve a finished response (``final=True``) and a stream: ``ToolCallStreamer`` sends
what is new since the previous parse as ``delta.content`` and ``delta.tool_calls`` entries (the
first entry of a call carries its index, id, type and name; the next ones argument text), so the
concatenated deltas equal the non-streamed message. (Except for an output whose call breaks after
it began to stream — cut off by max_tokens, or malformed: the stream has sent the call's start
and sends nothing more of it, while the finished response returns the text as content.)
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.partial_json import member, scan_object


@dataclass
class ParsedCall:
    name: Optional[str]  # None until the name's string is complete
    arguments: str  # the arguments' JSON text so far
    complete: bool = False  # the call's text is complete (its arguments parse)


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser:
    """Reads tool calls out of model output (vLLM's ToolParser; --tool-call-parser NAME).

    ``parse(text, final)``: final=False for a stream's text so far (fields only grow from one call
    to the next), final=True for the whole output (only complete calls; when the calls do not
    parse, the whole text is content and there are no calls)."""

    #: tokens the parser needs to see (special tokens such as <tool_call> in Hermes-style vocabularies)
    needs_special_tokens = False

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def extract(self, text: str) -> tuple[Optional[str], list[tuple[str, str]]]:
        """(content or None, [(name, arguments JSON)]) of a finished output."""
        try:
            parsed = self.parse(text, final=True)
        except ValueError:  # not (well-formed) tool calls: the text is the answer
            return text, []
        calls = [(c.name, c.arguments) for c in parsed.calls if c.complete and c.name is not None]
        if not calls:
            return text, []
        return (parsed.content or None), calls


def parse_call_object(text: str, start: int, argument_keys: tuple[str, ...]) -> tuple[ParsedCall, Optional[int]]:
    """The call written as the JSON object at text[start] ({"name": ..., "arguments": {...}}) and
    the index after it (None: cut off). ValueError when it is not such an object."""
    members, end = scan_object(text, start)
    name_m, args_m = member(members, "name"), member(members, *argument_keys)
    name = None
    if name_m is not None and name_m.end is not None:
        name = json.loads(text[name_m.start:name_m.end])
        if not isinstance(name, str):
            raise ValueError("the tool call's name is not a string")
    args = ""
    if args_m is not None and args_m.start is not None:
        args = text[args_m.start:args_m.end if args_m.end is not None else len(text)]
    complete = end is not None and name is not None and args_m is not None and args_m.end is not None
    if complete:
        json.loads(args)  # ValueError when the arguments are not JSON
    if end is not None and not complete:
        raise ValueError("a tool call object without a name and arguments")
    return ParsedCall(name, args, complete), end


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


class ToolCallStreamer:
    """Turns successive parses of a growing output into OpenAI's stream deltas."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.sent: list[tuple[str, int]] = []  # per call started: (id, argument characters sent)
        self.broken = False  # a call went out and the finished output did not parse

    @property
    def called(self) -> bool:
        """Whether the output is tool calls (finish_reason "tool_calls"): calls went out and none broke."""
        return bool(self.sent) and not self.broken

    def feed(self, delta_text: str, final: bool = False) -> tuple[Optional[str], list[dict]]:
        """(content delta or None, delta.tool_calls entries) for new output text."""
        self.text += delta_text
        try:
            parsed = self.parser.parse(self.text, final)
        except ValueError:
            if self.sent:  # a call already went out and then broke (cut off, malformed): nothing more
                self.broken = self.broken or final
                return None, []
            parsed = Parsed(self.text)  # not a tool call after all: hold nothing back
        content = None
        if len(parsed.content) > self.sent_content and parsed.content.startswith(self.text[:self.sent_content]):
            content = parsed.content[self.sent_content:]
            self.sent_content = len(parsed.content)
        entries = []
        for k, call in enumerate(parsed.calls):
            if call.name is None:
                break  # a call is announced once its name is known; later calls wait for it
            if k >= len(self.sent):
                cid = tool_call_id()
                self.sent.append((cid, len(call.arguments)))
                entries.append({"index": k, "id": cid, "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}})
                continue
            cid, n = self.sent[k]
            if len(call.arguments) > n:
                entries.append({"index": k, "function": {"arguments": call.arguments[n:]}})
                self.sent[k] = (cid, len(call.arguments))
        return content, entries
