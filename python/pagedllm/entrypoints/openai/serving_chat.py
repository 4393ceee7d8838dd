"""POST /v1/chat/completions: messages through the chat template (the same token ids as
``LLM.chat``), n, logprobs / top_logprobs, max_tokens and max_completion_tokens, streaming
(SSE: a role chunk, content deltas, a finish chunk, an optional usage chunk, ``data: [DONE]``;
one choice per chunk, each with its index, as OpenAI and vLLM; the running usage in every chunk
with stream_options continuous_usage_stats; prompt_token_ids (return_token_ids) and
prompt_logprobs on the response, or on the first chunk of a stream, as vLLM).

Structured outputs (response_format json_object / json_schema, vLLM's structured_outputs:
structured_outputs.py) and tools (tools, tool_choice, parallel_tool_calls: tool_calls.py; the
model's calls read by the --tool-call-parser, tool_parsers/): the message's tool_calls, or in a
stream delta.tool_calls pieces whose concatenation is the same calls; tool messages (role "tool",
tool_call_id) and assistant messages with tool_calls go to the chat template, the arguments as
objects (as vLLM hands them to templates).

Not implemented, answered with a 400 naming the field: non-text content parts.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.chat_utils import chat_prompt_token_ids
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatResponseMessage,
    ChatStreamChoice, ChatTokenLogprob, DeltaMessage, DeltaToolCall, FunctionCall, PromptTokensDetails, ToolCall,
    TopLogprob, UsageInfo, random_id,
)
from pagedllm.entrypoints.openai.serving import (
    SSE_DONE, GroupStreamingResponse, PromptInput, RequestGroup, ServingContext, check_length, check_model,
    check_n, check_queue, check_rate_limit, check_unsupported, continuous_usage, prompt_logprobs_json,
    sampling_params, sse, sse_error, token_bytes, truncate_prompt,
)
from pagedllm.entrypoints.openai.tool_calls import ToolPlan, plan_tools
from pagedllm.entrypoints.openai.tool_parsers import ToolCallStreamer
from pagedllm.entrypoints.openai.tool_parsers.abstract import tool_call_id


def conversation(req_messages) -> list[dict]:
    """Messages as plain dicts for the chat template; content parts must be text (joined by
    newlines). Errors: OpenAIError 400 naming messages[i]."""
    if not req_messages:
        raise OpenAIError("messages: at least one message is required", 400, "messages")
    out = []
    for i, m in enumerate(req_messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for k, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise OpenAIError(f"messages[{i}].content[{k}].type: only 'text' content parts are supported, "
                                      f"got {part.type!r}", 400, "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        msg: dict = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:  # their JSON arguments become objects in chat_prompt_token_ids (chat_utils)
            msg["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        elif m.role == "tool":
            raise OpenAIError(f"messages[{i}].tool_call_id: required for role 'tool' (the id of the call it answers)",
                              400, "messages")
        out.append(msg)
    return out


def check_chat_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError("top_logprobs: requires logprobs=true", 400, "top_logprobs")
    if req.top_logprobs is not None and req.top_logprobs < 0:
        raise OpenAIError(f"top_logprobs must be non-negative, got {req.top_logprobs}", 400, "top_logprobs")


class ChatHandler:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    def prompt_ids(self, req, messages: list[dict], tools: Optional[list[dict]] = None) -> list[int]:
        try:
            ids = chat_prompt_token_ids(
                self.ctx.tokenizer, messages, req.chat_template or self.ctx.chat_template,
                req.add_generation_prompt is not False, bool(req.continue_final_message), req.chat_template_kwargs,
                tools=tools)
        except ValueError as exc:
            raise OpenAIError(f"messages: {exc}", 400, "messages") from None
        return ids

    async def __call__(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        check_model(ctx, req.model)
        check_unsupported(req, ctx)
        check_chat_unsupported(req)
        check_n(ctx, 1 if req.n is None else req.n)
        messages = conversation(req.messages)
        plan = plan_tools(req, ctx.tool_call_parser, ctx.enable_auto_tool_choice)
        ids = truncate_prompt(self.prompt_ids(req, messages, plan.tools), req.truncate_prompt_tokens, ctx)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if requested is not None and requested < 0:
            raise OpenAIError(f"{field} must be at least 0, got {requested}", 400, field)
        max_tokens = check_length(ctx, len(ids), requested, "messages", field)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(ctx, req, max_tokens, logprobs, req.prompt_logprobs, plan.constraint,
                                 False if plan.parser is not None and plan.parser.needs_special_tokens else None)
        check_rate_limit(ctx, raw_request, len(ids) + params.n * max_tokens)
        await check_queue(ctx)
        base_id = req.request_id or random_id("chatcmpl")
        group = RequestGroup(ctx, raw_request, base_id)
        await group.add([PromptInput(None, ids)], [params], req.priority, req.cache_salt)
        echo = ""
        if req.echo and messages and messages[-1]["role"] == "assistant":
            echo = messages[-1]["content"]
        renderer = _ChatRenderer(ctx, req, base_id, ids, echo, plan)
        if req.stream:
            return GroupStreamingResponse(renderer.stream(group), group)
        return await renderer.full(group)


class _ChatRenderer:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, response_id: str, prompt_ids: list[int],
                 echo: str, plan: Optional[ToolPlan] = None):
        self.ctx, self.req, self.id = ctx, req, response_id
        self.plan = plan or ToolPlan()
        self.prompt_ids = prompt_ids
        self.prompt_tokens = len(prompt_ids)
        self.echo = echo
        self.n = 1 if req.n is None else req.n
        self.top = req.top_logprobs or 0

    def _logprobs(self, token_ids: list[int], logprobs) -> Optional[ChatLogprobs]:
        if not self.req.logprobs:
            return None
        tok = self.ctx.tokenizer
        as_ids = bool(self.req.return_tokens_as_token_ids)

        def name(token_id: int, text: str) -> str:  # return_tokens_as_token_ids: "token_id:<id>"
            return f"token_id:{token_id}" if as_ids else text

        content = []
        for tid, entry in zip(token_ids, logprobs or []):
            lp = entry.get(tid)
            text = lp.decoded_token if lp is not None and lp.decoded_token is not None else tok.decode([tid])
            tops = [TopLogprob(token=name(t, e.decoded_token if e.decoded_token is not None else str(t)),
                               logprob=e.logprob, bytes=token_bytes(tok, t, e.decoded_token or ""))
                    for t, e in sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
                    if e.rank is not None and e.rank <= self.top][: self.top]
            content.append(ChatTokenLogprob(token=name(tid, text), logprob=lp.logprob if lp is not None else float("-inf"),
                                            bytes=token_bytes(tok, tid, text), top_logprobs=tops))
        return ChatLogprobs(content=content)

    def _usage(self, completion_tokens: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=self.prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=0))

    async def full(self, group: RequestGroup) -> Response:
        texts = {j: [self.echo] for j in range(self.n)}
        tokens: dict[int, list[int]] = {j: [] for j in range(self.n)}
        lps: dict[int, list] = {j: [] for j in range(self.n)}
        finish: dict[int, tuple] = {}
        prompt_lps = None
        async for _, out in group.outputs():
            if out.prompt_logprobs is not None and prompt_lps is None:
                prompt_lps = out.prompt_logprobs
            for c in out.outputs:
                texts[c.index].append(c.text)
                tokens[c.index] += c.token_ids
                if c.logprobs:
                    lps[c.index] += c.logprobs
                if c.finish_reason is not None:
                    finish[c.index] = (c.finish_reason, c.stop_reason)
        if group.disconnected:
            return Response(status_code=499)
        choices = []
        for j in range(self.n):
            reason, stop_reason = finish.get(j, (None, None))
            message = ChatResponseMessage(content="".join(texts[j]))
            if self.plan.parser is not None:
                content, calls = self.plan.parser.extract("".join(texts[j][1:]))
                if calls:
                    calls = calls if self.plan.parallel else calls[:1]
                    message = ChatResponseMessage(
                        content=(self.echo + (content or "")) or None,
                        tool_calls=[ToolCall(id=tool_call_id(), function=FunctionCall(name=name, arguments=args))
                                    for name, args in calls])
                    reason = self._finish_reason(reason, True)
            choices.append(ChatChoice(index=j, message=message, logprobs=self._logprobs(tokens[j], lps[j]),
                                      token_ids=tokens[j] if self.req.return_token_ids else None,
                                      finish_reason=reason, stop_reason=stop_reason))
        resp = ChatCompletionResponse(id=self.id, model=self.ctx.model_name, choices=choices,
                                      usage=self._usage(sum(len(t) for t in tokens.values())),
                                      prompt_logprobs=(prompt_logprobs_json(prompt_lps)
                                                       if self.req.prompt_logprobs is not None else None),
                                      prompt_token_ids=self.prompt_ids if self.req.return_token_ids else None)
        return Response(resp.model_dump_json(), media_type="application/json")

    def _finish_reason(self, reason: Optional[str], called: bool) -> Optional[str]:
        """OpenAI's rule: "tool_calls" when "auto" or "required" ended with calls, "stop" for a
        named function."""
        return "tool_calls" if called and reason == "stop" and not self.plan.named else reason

    def _chunk(self, choice: ChatStreamChoice, usage: Optional[UsageInfo] = None, **first) -> str:
        return sse(ChatCompletionChunk(id=self.id, model=self.ctx.model_name, choices=[choice], usage=usage, **first))

    async def stream(self, group: RequestGroup) -> AsyncIterator[str]:
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage) or self.ctx.force_include_usage
        running = continuous_usage(self.req)
        completion_tokens = 0
        try:
            usage = self._usage(0) if running else None
            # vLLM: the prompt's token ids (return_token_ids) on the first chunk; the prompt
            # logprobs, known after the first step, on the first chunk that follows it
            first = {"prompt_token_ids": self.prompt_ids} if self.req.return_token_ids else {}
            for j in range(self.n):  # one choice per chunk
                yield self._chunk(ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content="")), usage,
                                  **(first if j == 0 else {}))
            if self.echo:
                for j in range(self.n):
                    yield self._chunk(ChatStreamChoice(index=j, delta=DeltaMessage(content=self.echo)), usage)
            want_prompt_lps = self.req.prompt_logprobs is not None
            streamers = ({j: ToolCallStreamer(self.plan.parser) for j in range(self.n)}
                         if self.plan.parser is not None else None)
            async for _, out in group.outputs():
                choices = []
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    lp = self._logprobs(c.token_ids, c.logprobs) if c.token_ids else None
                    text, calls, reason = c.text, None, c.finish_reason
                    if streamers is not None:
                        streamer = streamers[c.index]
                        text, entries = streamer.feed(c.text, final=c.finish_reason is not None)
                        if not self.plan.parallel:
                            entries = [e for e in entries if e["index"] == 0]
                        calls = [DeltaToolCall(**e) for e in entries] or None
                        reason = self._finish_reason(reason, streamer.called)
                    if text or calls or lp is not None or reason is not None or (
                            c.token_ids and self.req.return_token_ids):
                        choices.append(ChatStreamChoice(
                            index=c.index, delta=DeltaMessage(content=text if text else None, tool_calls=calls),
                            logprobs=lp, finish_reason=reason, stop_reason=c.stop_reason,
                            token_ids=list(c.token_ids) if self.req.return_token_ids else None))
                usage = self._usage(completion_tokens) if running else None
                for choice in choices:
                    extra = {}
                    if want_prompt_lps and out.prompt_logprobs is not None:
                        extra = {"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
                        want_prompt_lps = False
                    yield self._chunk(choice, usage, **extra)
            if group.disconnected:
                return
            if include_usage:
                yield sse(ChatCompletionChunk(id=self.id, model=self.ctx.model_name, choices=[],
                                              usage=self._usage(completion_tokens)))
        except Exception as exc:  # after the 200 was sent, an error travels as an event
            yield sse_error(exc)
        yield SSE_DONE
