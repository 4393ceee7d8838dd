"""Tool-call parsers of the OpenAI server (vLLM's ``--tool-call-parser``): model output text ->
content + tool calls, for a finished response and incrementally for a stream (abstract.py).

``hermes``: ``<tool_call>{...}</tool_call>`` blocks (Hermes 2 Pro, Qwen2.5, the bundled
``hermes_tools`` chat template); ``llama3_json``: Llama 3.1 / 3.2 JSON calls. forced.py reads
the outputs that tool_choice "required" or a named function constrains.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import Parsed, ParsedCall, ToolCallStreamer, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

#: --tool-call-parser NAME -> parser class
TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "NamedToolParser", "Parsed", "ParsedCall",
           "RequiredToolParser", "ToolCallStreamer", "ToolParser"]
