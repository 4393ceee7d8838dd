"""What the completion and chat handlers share: the served model's context, request checks
(model name, queue depth, context length), SamplingParams from a request, running a group of
engine requests with client-disconnect detection, and logprob formatting.

Length rule (vLLM's server, and the issue): a prompt of max_model_len tokens or more, or
prompt + max_tokens > max_model_len, is a 400 naming the limit and the counts, answered before
any SSE event; an omitted max_tokens means max_model_len - prompt tokens for chat and
min(16, max_model_len - prompt tokens) for completions (OpenAI's and vLLM's default of 16).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.engine.async_llm import AsyncLLM, RequestOutputCollector
from pagedllm.entrypoints.openai.errors import OpenAIError, error_body, from_value_error
from pagedllm.entrypoints.openai.protocol import _SamplingFields
from pagedllm.entrypoints.openai.rate_limit import RateLimiter
from pagedllm.entrypoints.openai.structured_outputs import structured_outputs_params
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, truncate_prompt_ids

#: Most top logprobs a request may ask for per token (vLLM's default max_logprobs; --max-logprobs).
MAX_LOGPROBS = 20


@dataclasses.dataclass
class ServingContext:
    engine: AsyncLLM
    served_model_names: list[str]
    max_queued_requests: Optional[int] = None
    #: --enable-force-include-usage: streams end with a usage chunk whether or not stream_options asks
    force_include_usage: bool = False
    #: --max-logprobs: most logprobs per token a request may ask for; -1: no limit (logprobs -1 =
    #: the whole vocabulary is then allowed)
    max_logprobs: int = MAX_LOGPROBS
    #: --rate-limit-rpm / --rate-limit-tpm (rate_limit.py); None: no limits
    rate_limiter: Optional["RateLimiter"] = None
    #: --chat-template: the template used when a request names none (None: the tokenizer's)
    chat_template: Optional[str] = None
    #: --enable-auto-tool-choice / --tool-call-parser (tool_calls.py, tool_parsers/)
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    #: --structured-outputs-config: defaults of a request's structured outputs (disable_any_whitespace)
    structured_outputs_defaults: dict = dataclasses.field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


def check_model(ctx: ServingContext, model: Optional[str]) -> None:
    if model is not None and model not in ctx.served_model_names:
        raise OpenAIError(f"The model `{model}` does not exist. Served models: {', '.join(ctx.served_model_names)}.",
                          404, "model")


def check_rate_limit(ctx: ServingContext, raw_request: Request, tokens: int) -> None:
    """429 (Retry-After) when the request's API key (its client address without keys) is over the
    requests or tokens per minute; tokens: the prompt tokens + max_tokens it may use."""
    limiter = ctx.rate_limiter
    if limiter is None or not limiter.enabled:
        return
    header = raw_request.headers.get("authorization", "")
    key = header[7:] if header.lower().startswith("bearer ") else ""
    if not key:
        key = "client:" + (raw_request.client.host if raw_request.client else "?")
    limiter.admit(key, tokens)


async def check_queue(ctx: ServingContext) -> None:
    """503 + Retry-After when max_queued_requests requests already wait for the engine (with an
    engine shared by several API servers, from a waiting count at most 0.5 s old)."""
    limit = ctx.max_queued_requests
    if limit is None:
        return
    await ctx.engine.refresh_metrics(max_age=0.5)
    if ctx.engine.num_waiting >= limit:
        raise OpenAIError(f"the server is busy: {ctx.engine.num_waiting} requests are waiting "
                          f"(--max-queued-requests={limit}); retry later", 503, None, {"Retry-After": "1"})


def check_length(ctx: ServingContext, prompt_len: int, max_tokens: Optional[int], where: str,
                 max_tokens_field: str = "max_tokens", default: Optional[int] = None) -> int:
    """The effective max_tokens for a prompt of prompt_len tokens (400 when it does not fit); an
    omitted max_tokens is `default` (None: the rest of the context), capped by the context."""
    limit = ctx.max_model_len
    if prompt_len == 0:
        raise OpenAIError(f"{where}: the prompt is empty (0 tokens); give at least one token", 400, where)
    if prompt_len >= limit:
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, your {where} has {prompt_len} "
            f"tokens, which leaves no room for a completion ({where} tokens must be fewer than {limit}).", 400, where)
    if max_tokens is None:
        return limit - prompt_len if default is None else min(default, limit - prompt_len)
    if prompt_len + max_tokens > limit:
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {where}, {max_tokens} in the completion). "
            f"Please reduce the length of the {where} or {max_tokens_field}.", 400, max_tokens_field)
    return max_tokens


#: Request fields outside the models that carry no instruction for the output (OpenAI's
#: bookkeeping): accepted and ignored. Any other unknown field is a 400 naming it, so that a field
#: that would change the output is never silently ignored.
INFORMATIONAL_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier",
                                  "prompt_cache_key", "vllm_xargs"})
#: Fields of vLLM's or OpenAI's API that pagedllm does not implement yet, with what to say.
_NOT_YET = {
    **{f: "vLLM replaced the guided_* fields with structured_outputs ({\"json\": ...} | {\"regex\": ...} | "
          "{\"choice\": [...]} | {\"grammar\": ...}); send that instead" for f in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
        "guided_whitespace_pattern")},
    "structural_tag": "structural tags are not supported (use structured_outputs or tools)",
    "bad_words": "bad_words is not supported", "logits_processors": "logits processors are not supported",
    "prompt_embeds": "prompt embeddings are not supported", "length_penalty": "beam search is not supported",
    "functions": "function calling is not supported", "function_call": "function calling is not supported",
"audio": "audio output is not supported",
    "modalities": "only text output is supported", "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning models are not supported", "web_search_options": "web search is not supported",
    "documents": "documents are not supported", "mm_processor_kwargs": "multimodal inputs are not supported",
}


def check_unknown_fields(req) -> None:
    """400 naming the first request field the server does not know, other than the informational
    ones (INFORMATIONAL_FIELDS)."""
    for name in req.model_extra or {}:
        if name in INFORMATIONAL_FIELDS:
            continue
        why = _NOT_YET.get(name, "pagedllm does not implement it and ignoring it could change the output")
        raise OpenAIError(f"{name}: {why}; remove the field", 400, name)


def truncate_prompt(ids: list[int], keep: Optional[int], ctx: "ServingContext") -> list[int]:
    """truncate_prompt_tokens (sampling_params.truncate_prompt_ids) before the length checks; a bad
    value is a 400 naming the field."""
    try:
        return truncate_prompt_ids(ids, keep, ctx.max_model_len)
    except ValueError as exc:
        raise from_value_error(exc) from None


def check_unsupported(req: _SamplingFields, ctx: Optional["ServingContext"] = None) -> None:
    check_unknown_fields(req)
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options: only allowed when stream is true", 400, "stream_options")
    for name in ("logprobs", "prompt_logprobs", "top_logprobs"):
        value = getattr(req, name, None)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        cap = MAX_LOGPROBS if ctx is None else ctx.max_logprobs
        if cap == -1:  # no limit: any count, or -1 for the whole vocabulary
            if value < -1:
                raise OpenAIError(f"{name}={value}: give a count >= 0, or -1 for the whole vocabulary", 400, name)
        elif not 0 <= value <= cap:
            raise OpenAIError(f"{name}={value} is outside [0, {cap}] (--max-logprobs={cap}; -1, the whole vocabulary, "
                              f"needs --max-logprobs -1)", 400, name)


def check_n(ctx: ServingContext, n: int) -> None:
    """n sequences of one prompt run side by side: at most max_num_seqs."""
    limit = ctx.engine.engine_args.max_num_seqs
    if isinstance(n, int) and n > limit:
        raise OpenAIError(f"n={n} is more than max_num_seqs={limit} (sequences that run at once)", 400, "n")


def sampling_params(ctx: ServingContext, req: _SamplingFields, max_tokens: int, logprobs: Optional[int],
                    prompt_logprobs: Optional[int], tool_constraint: Optional[dict] = None,
                    skip_special_tokens: Optional[bool] = None) -> SamplingParams:
    """SamplingParams for a request: the model's generation_config defaults for omitted
    temperature / top_p / top_k / min_p / repetition_penalty, output_kind DELTA (the handlers
    accumulate), the output constraint of structured_outputs / response_format (or of tool_choice:
    tool_constraint). ValueError of SamplingParams -> 400 naming the field."""
    fields = req.structured_outputs
    if fields is not None or tool_constraint or getattr(req, "response_format", None) is not None:
        fields = {**ctx.structured_outputs_defaults, **(fields or {})}
    structured = structured_outputs_params(fields, getattr(req, "response_format", None), tool_constraint)
    defaults = ctx.engine.generation_defaults

    beam = bool(req.use_beam_search)

    def pick(name: str, fallback):
        value = getattr(req, name)
        if beam:  # beam search is greedy and unpenalised: the checkpoint's sampling defaults do not apply
            return value if value is not None else {"temperature": 0.0, "repetition_penalty": 1.0}.get(name, fallback)
        return value if value is not None else defaults.get(name, fallback)

    bias = None
    if req.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise OpenAIError(f"logit_bias: keys must be token ids, got {list(req.logit_bias)[:4]}", 400,
                              "logit_bias") from None
    try:
        return SamplingParams(
            n=1 if req.n is None else req.n,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=bool(req.ignore_eos),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=(req.skip_special_tokens is not False if skip_special_tokens is None
                                 else skip_special_tokens),
            spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            logit_bias=bias,
            allowed_token_ids=req.allowed_token_ids,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured,
            use_beam_search=beam,
            length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
        )
    except ValueError as exc:
        raise from_value_error(exc) from None


@dataclasses.dataclass
class PromptInput:
    text: Optional[str]
    token_ids: list[int]
    max_tokens: int = 0


class GroupStreamingResponse(StreamingResponse):
    """A StreamingResponse that aborts its request group however the response ends (also when
    the body iterator never started because the client was already gone)."""

    def __init__(self, content, group: "RequestGroup"):
        super().__init__(content, media_type="text/event-stream")
        self.group = group
        group.streamed = True  # starlette's response watches the client and cancels the stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.group.abort()


class RequestGroup:
    """The engine requests of one HTTP request (one per prompt), added all-or-nothing, merged
    into one stream of (prompt index, RequestOutput), aborted when the client disconnects or the
    consumer stops early."""

    def __init__(self, ctx: ServingContext, raw_request: Request, base_id: str):
        self.ctx = ctx
        self.raw_request = raw_request
        self.base_id = base_id
        self.request_ids: list[str] = []
        self.collectors: list[RequestOutputCollector] = []
        self.finished: set[int] = set()
        self.disconnected = False
        self.streamed = False  # set by GroupStreamingResponse: no watcher of our own needed

    async def add(self, prompts: list[PromptInput], params: list[SamplingParams], priority: int,
                  cache_salt: Optional[str]) -> None:
        engine = self.ctx.engine
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = self.base_id if len(prompts) == 1 else f"{self.base_id}-{i}"
                collector = await engine.add_request(rid, p.text, p.token_ids, sp, priority or 0, cache_salt or "")
                self.request_ids.append(rid)
                self.collectors.append(collector)
        except ValueError as exc:
            await self.abort()
            raise from_value_error(exc) from None
        except BaseException:
            await self.abort()
            raise

    async def abort(self) -> None:
        pending = [rid for i, rid in enumerate(self.request_ids) if i not in self.finished]
        if pending:
            await self.ctx.engine.abort(pending)

    async def _watch_disconnect(self) -> None:
        """Abort the group when the client disconnects (a non-streamed response): waits on the ASGI
        receive channel, which yields http.disconnect once the body was read and the client went
        away (no polling)."""
        receive = self.raw_request.receive
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                self.disconnected = True
                await self.abort()
                return

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (prompt index, RequestOutput) until every request finished (aborted ones too)."""
        watcher = None if self.streamed else asyncio.create_task(self._watch_disconnect())
        getters: dict[asyncio.Task, int] = {}
        try:
            if len(self.collectors) == 1:  # one prompt: await its collector directly (per token)
                collector = self.collectors[0]
                while True:
                    out = await collector.get()
                    if out.finished:
                        self.finished.add(0)
                    yield 0, out
                    if out.finished:
                        return
            for i, c in enumerate(self.collectors):
                getters[asyncio.create_task(c.get())] = i
            while getters:
                done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: getters[t]):
                    i = getters.pop(task)
                    out = task.result()
                    if out.finished:
                        self.finished.add(i)
                    else:
                        getters[asyncio.create_task(self.collectors[i].get())] = i
                    yield i, out
        finally:
            if watcher is not None:
                watcher.cancel()
            for task in getters:
                task.cancel()
            await self.abort()


# ---------------------------------------------------------------------------- logprobs helpers
def token_pieces(tokenizer, token_ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    """Text of each token such that "".join(pieces) == decode(token_ids) (each piece is the text
    that token adds to the decoded prefix; an incomplete UTF-8 character shows in the piece that
    completes it)."""
    pieces, prev = [], ""
    for i in range(len(token_ids)):
        text = tokenizer.decode(token_ids[: i + 1], skip_special_tokens=skip_special_tokens)
        if text.endswith("\ufffd") and i + 1 < len(token_ids):
            pieces.append("")
            continue
        pieces.append(text[len(prev):] if text.startswith(prev) else text)
        prev = text
    return pieces


_BYTE_DECODER: Optional[dict[str, int]] = None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map of byte-level BPE (Radford et al. 2019, the
    released encoder.py): printable Latin-1 bytes map to themselves, the rest to 256 + i."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def token_bytes(tokenizer, token_id: int, text: str) -> list[int]:
    """UTF-8 bytes of one token: exact for byte-level BPE (GPT-2 byte map), else its text's."""
    global _BYTE_DECODER
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and "ByteLevel" in str(backend.decoder):
        if _BYTE_DECODER is None:
            _BYTE_DECODER = {v: k for k, v in _bytes_to_unicode().items()}
        raw = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(raw, str) and all(ch in _BYTE_DECODER for ch in raw):
            return [_BYTE_DECODER[ch] for ch in raw]
    return list(text.encode("utf-8"))


def continuous_usage(req: _SamplingFields) -> bool:
    """Whether every streamed chunk carries the running usage (vLLM: stream_options.include_usage
    and stream_options.continuous_usage_stats both true)."""
    opts = req.stream_options
    return bool(opts and opts.include_usage and opts.continuous_usage_stats)


def prompt_logprobs_json(prompt_logprobs):
    """vLLM's prompt_logprobs field: per prompt position None or {token id: {logprob, rank,
    decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [None if d is None else {int(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in d.items()} for d in prompt_logprobs]


def sse(model) -> str:
    """One Server-Sent Event carrying a pydantic model as JSON."""
    return f"data: {model.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: Exception) -> str:
    """The event that ends a stream after an error (the 200 was already sent): an OpenAIError's own
    status and param, anything else as a 500 "internal error"."""
    if isinstance(exc, OpenAIError):
        return sse(error_body(exc.message, exc.status, exc.param))
    return sse(error_body(f"internal error: {exc}", 500))
