"""Pydantic models of the OpenAI-compatible API (requests and responses), with the fields of
OpenAI's API reference and the extra sampling fields vLLM's server accepts.

Requests are validated in *strict* mode: a wrong JSON type is a 400 naming the field (never a
coercion: ``"stream": "false"`` is rejected, it does not turn streaming on; sgl-project/sglang
#3805, ggml-org/llama.cpp PR #6452). Unknown fields are ignored, as OpenAI and vLLM do.
Value ranges (temperature >= 0, 0 < top_p <= 1, n >= 1, ...) are checked by SamplingParams, whose
ValueError messages start with the field's name.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedllm.sampling_params import REPETITION_PENALTY_BOUNDS, SEED_BOUNDS


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, (list, tuple)):
        return any(_has_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    return False


class _Request(BaseModel):
    # strict: no type coercion; allow_inf_nan=False: Infinity / NaN (Python's json accepts them)
    # are rejected as the field's error instead of reaching the sampler.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """JSON's "\\ud800" escape gives Python a lone UTF-16 surrogate, which no tokenizer can
        encode: a 400 naming the field, before the request goes further."""
        if _has_surrogate(value):
            raise ValueError("contains a lone UTF-16 surrogate (such as \\ud800), which is not valid Unicode text")
        return value


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


def _bounds(**schema) -> dict:
    """JSON-schema bounds of a field for the OpenAPI document only: SamplingParams enforces them
    (with its own messages, 400 naming the field); the server adds the deployment's limits
    (max_model_len, max_num_seqs, --max-logprobs, the vocabulary: api_server.openapi_with_limits)."""
    return {"json_schema_extra": schema}


class JsonSchemaFormat(_Request):
    name: str = Field(max_length=64)
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False, populate_by_name=True)


class ResponseFormat(_Request):
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None
    frequency_penalty: Optional[float] = Field(0.0, **_bounds(minimum=-2, maximum=2))
    presence_penalty: Optional[float] = Field(0.0, **_bounds(minimum=-2, maximum=2))
    logit_bias: Optional[dict[str, float]] = None
    max_tokens: Optional[int] = Field(default=None, description="omitted: max_model_len - prompt tokens",
                                      **_bounds(minimum=0))
    n: Optional[int] = Field(1, **_bounds(minimum=1))
    seed: Optional[int] = Field(None, **_bounds(minimum=SEED_BOUNDS[0], maximum=SEED_BOUNDS[1]))
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(None, **_bounds(minimum=0))
    top_p: Optional[float] = Field(None, **_bounds(exclusiveMinimum=0, maximum=1))
    user: Optional[str] = None
    # vLLM's extra sampling parameters
    top_k: Optional[int] = Field(None, **_bounds(minimum=-1))
    min_p: Optional[float] = Field(None, **_bounds(minimum=0, maximum=1))
    repetition_penalty: Optional[float] = Field(None, **_bounds(minimum=REPETITION_PENALTY_BOUNDS[0],
                                                                maximum=REPETITION_PENALTY_BOUNDS[1]))
    min_tokens: Optional[int] = Field(0, **_bounds(minimum=0))
    ignore_eos: Optional[bool] = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True
    spaces_between_special_tokens: Optional[bool] = True
    prompt_logprobs: Optional[int] = Field(None, **_bounds(minimum=-1))
    priority: Optional[int] = 0
    cache_salt: Optional[str] = None
    request_id: Optional[str] = None
    use_beam_search: Optional[bool] = Field(default=False, description="beam search with n beams: the n best "
                                            "hypotheses, best first (temperature 0; docs/beam_search.md)")
    length_penalty: Optional[float] = Field(default=1.0, description="beam search: score = cum_logprob / "
                                            "num_generated ** length_penalty")
    return_token_ids: Optional[bool] = Field(default=False, description="add token_ids (and prompt_token_ids) "
                                             "to each choice, as vLLM's return_token_ids")
    allowed_token_ids: Optional[list[int]] = Field(default=None, description="only these token ids can be sampled")
    truncate_prompt_tokens: Optional[int] = Field(default=None, description="keep the prompt's last k tokens "
                                                  "(-1: the last max_model_len - 1)")
    return_tokens_as_token_ids: Optional[bool] = Field(default=False, description="logprobs name tokens as "
                                                       "'token_id:<id>' instead of their text")
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = Field(
        default=None, description="vLLM's structured outputs: exactly one of json (a JSON schema), json_object, "
        "regex, choice, grammar (EBNF); disable_any_whitespace (docs/structured_output.md)")


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. prompt: a string, a list of strings, token ids, or a list of token-id
    lists (one choice group per prompt; choice index = prompt index * n + sequence index)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(default=None, description="omitted: 16 (OpenAI's and vLLM's default), "
                                      "at most max_model_len - prompt tokens", **_bounds(minimum=0))
    best_of: Optional[int] = None
    echo: Optional[bool] = False
    logprobs: Optional[int] = Field(None, **_bounds(minimum=-1))
    suffix: Optional[str] = None
    add_special_tokens: Optional[bool] = True


class ContentPart(_Request):
    type: str
    text: Optional[str] = None


class FunctionCallParam(_Request):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallParam(_Request):
    """An assistant message's tool call, as the client sends it back."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Request):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallParam]] = None  # role assistant
    tool_call_id: Optional[str] = None  # role tool: the call this message answers


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments; omitted: no arguments
    strict: Optional[bool] = None


class ChatCompletionToolParam(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. messages go through the model's chat template."""

    messages: list[ChatMessage]
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, **_bounds(minimum=-1))
    max_completion_tokens: Optional[int] = Field(None, **_bounds(minimum=0))
    tools: Optional[list[ChatCompletionToolParam]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = Field(
        default=None, description='"none" | "auto" (the default with tools; needs --enable-auto-tool-choice) | '
        '"required" | {"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: Optional[bool] = True
    echo: Optional[bool] = False
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    add_special_tokens: Optional[bool] = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeRequest(_Request):
    """POST /tokenize: either prompt (text) or messages (rendered by the chat template)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    return_token_strs: Optional[bool] = False
    tools: Optional[list[ChatCompletionToolParam]] = None  # with messages: as the chat template shows them


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[int]


# ---------------------------------------------------------------------------- responses
class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(_Response):
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    prompt_logprobs: Optional[list[Optional[dict[int, dict[str, Any]]]]] = None
    token_ids: Optional[list[int]] = None
    prompt_token_ids: Optional[list[int]] = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: Optional[list[ChatTokenLogprob]] = None


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[list[Optional[dict[int, dict[str, Any]]]]] = None
    prompt_token_ids: Optional[list[int]] = None


class DeltaFunctionCall(_Response):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Response):
    """One piece of a streamed tool call: the first names it (id, type, function.name), the next
    ones add argument text; index tells the calls of one message apart."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(_Response):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_logprobs: Optional[list[Optional[dict[int, dict[str, Any]]]]] = None  # first chunk (vLLM)
    prompt_token_ids: Optional[list[int]] = None  # first chunk, with return_token_ids (vLLM)


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None  # return_token_strs: the tokenizer's token strings


class TokenizerInfoResponse(_Response):
    """GET /tokenizer_info (--enable-tokenizer-info-endpoint), as vLLM's: the tokenizer's class and
    its configuration (special tokens, chat template, lengths)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class DetokenizeResponse(_Response):
    prompt: str
