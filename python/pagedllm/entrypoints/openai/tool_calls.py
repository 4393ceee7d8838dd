"""What a chat request's ``tools`` and ``tool_choice`` mean for its prompt, its output constraint
and how its output is read (OpenAI's semantics, as vLLM's server implements them):

- ``"none"``: the tools go to the chat template, the output is text;
- ``"auto"`` (the default with tools): the model decides; --enable-auto-tool-choice with a
  --tool-call-parser reads calls out of its text (tool_parsers/), else a 400;
- ``"required"``: the output is constrained to a JSON array of one or more
  ``{"name": ..., "parameters": {...}}`` calls of the given tools (one with parallel_tool_calls
  false);
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to the arguments
  of N (its parameters schema).

finish_reason is "tool_calls" when "auto" or "required" produced calls, "stop" for a named
function (OpenAI's rule). Errors: OpenAIError 400 naming tools / tool_choice.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import GrammarError, grammar_of
from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS, NamedToolParser, RequiredToolParser, ToolParser,
)


@dataclasses.dataclass
class ToolPlan:
    tools: Optional[list[dict]] = None  # for the chat template (OpenAI's tool objects)
    parser: Optional[ToolParser] = None  # reads the output (None: plain text)
    constraint: Optional[dict[str, Any]] = None  # StructuredOutputsParams fields forced by tool_choice
    named: bool = False  # a named function: finish_reason stays "stop"
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only


def _params_schema(fn) -> dict:
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}


def required_schema(tools, parallel: bool) -> dict:
    """The JSON schema of tool_choice "required" (vLLM's): an array of calls, each the name of one
    tool with arguments under its schema; $defs of the tools are lifted to the top."""
    defs: dict[str, Any] = {}
    items = []
    for t in tools:
        params = dict(_params_schema(t.function))
        for name, schema in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise OpenAIError(f"tools: two tools define $defs/{name} differently", 400, "tools")
            defs[name] = schema
        items.append({"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _check_schema(schema: dict, where: str) -> None:
    """A tool's parameters must be a JSON schema xgrammar can read (400 naming the tool)."""
    try:
        grammar_of(StructuredOutputsParams(json=schema))
    except GrammarError as exc:
        raise OpenAIError(f"{where}: not a usable JSON schema: {exc.reason}", 400, "tools") from None


def plan_tools(req, tool_parser: Optional[str], enable_auto_tool_choice: bool) -> ToolPlan:
    tools = req.tools
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if tools is not None and len(tools) == 0:
        raise OpenAIError("tools: must not be an empty array; give at least one tool or omit the field", 400, "tools")
    if not tools:
        if choice not in (None, "none"):
            raise OpenAIError(f"tool_choice: {choice!r} needs tools", 400, "tool_choice")
        return ToolPlan()
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise OpenAIError(f"tools: function names must be unique, got {names}", 400, "tools")
    plan = ToolPlan(tools=[t.model_dump(exclude_none=True) for t in tools], parallel=parallel)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return plan
    if choice == "auto":
        if not enable_auto_tool_choice or tool_parser is None:
            raise OpenAIError('tool_choice: "auto" needs the server started with --enable-auto-tool-choice and '
                              '--tool-call-parser (hermes | llama3_json)', 400, "tool_choice")
        plan.parser = TOOL_PARSERS[tool_parser]()
        return plan
    if choice == "required":
        for i, t in enumerate(tools):
            _check_schema(_params_schema(t.function), f"tools[{i}].function.parameters")
        plan.parser = RequiredToolParser()
        plan.constraint = {"json": required_schema(tools, parallel)}
        _check_schema(plan.constraint["json"], "tools (the schema of tool_choice \"required\", which nests each "
                                               "tool's parameters: a root-relative $ref no longer resolves)")
        return plan
    fn = choice.get("function") if isinstance(choice, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise OpenAIError('tool_choice: give "none", "auto", "required" or {"type": "function", "function": '
                          f'{{"name": ...}}}}, got {json.dumps(choice)[:200]}', 400, "tool_choice")
    if fn["name"] not in names:
        raise OpenAIError(f"tool_choice: function {fn['name']!r} is not among the tools ({', '.join(names)})", 400,
                          "tool_choice")
    i = names.index(fn["name"])
    schema = _params_schema(tools[i].function)
    _check_schema(schema, f"tools[{i}].function.parameters")
    plan.parser = NamedToolParser(fn["name"])
    plan.constraint = {"json": schema}
    plan.named = True
    return plan
