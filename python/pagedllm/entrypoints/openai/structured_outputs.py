"""A request's output constraint (SamplingParams.structured_outputs) from vLLM's
``structured_outputs`` field and OpenAI's ``response_format`` (which overrides the constraint and
keeps the other fields, such as disable_any_whitespace, as vLLM's server does):

- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``: JSON valid under schema;
- ``structured_outputs: {"json" | "json_object" | "regex" | "choice" | "grammar": ..., "disable_any_whitespace"}``.

Errors: OpenAIError 400 naming the field (an unknown key, two constraints, a bad value).
"""

from __future__ import annotations

from typing import Any, Optional

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import GrammarError, grammar_of

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_KEYS = _CONSTRAINTS + ("disable_any_whitespace",)


def structured_outputs_params(fields: Optional[dict[str, Any]], response_format=None,
                              extra: Optional[dict[str, Any]] = None) -> Optional[StructuredOutputsParams]:
    """StructuredOutputsParams of a request (None: unconstrained). extra: a constraint of the
    server's own (tool_choice), which the request may not combine with another."""
    merged: dict[str, Any] = {}
    if fields is not None:
        unknown = sorted(set(fields) - set(_KEYS))
        if unknown:
            raise OpenAIError(f"structured_outputs.{unknown[0]}: unknown field (supported: {', '.join(_KEYS)})", 400,
                              "structured_outputs")
        merged.update({k: v for k, v in fields.items() if v is not None})
    rf = response_format
    if rf is not None and rf.type != "text":
        for k in _CONSTRAINTS:
            merged.pop(k, None)
        if rf.type == "json_object":
            merged["json_object"] = True
        else:
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise OpenAIError("response_format.json_schema.schema: required with type 'json_schema'", 400,
                                  "response_format")
            merged["json"] = rf.json_schema.json_schema
    if extra:
        if any(k in merged for k in _CONSTRAINTS):
            raise OpenAIError("tool_choice: a required or named tool choice constrains the output itself; it cannot "
                              "be combined with response_format or structured_outputs", 400, "tool_choice")
        merged.update(extra)
    if not any(k in merged for k in _CONSTRAINTS):  # disable_any_whitespace alone constrains nothing
        return None
    from_rf = rf is not None and rf.type != "text" and not extra
    try:
        params = StructuredOutputsParams(**merged)
        grammar_of(params)  # parsing only (well under a millisecond): a bad one is a 400 here, named
    except ValueError as exc:
        if not from_rf:
            raise OpenAIError(str(exc), 400, "structured_outputs") from None
        why = f"cannot compile it: {exc.reason}" if isinstance(exc, GrammarError) else str(exc).split(": ", 1)[-1]
        raise OpenAIError(f"response_format.json_schema.schema: {why}", 400, "response_format") from None
    return params
