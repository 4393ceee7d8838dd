"""POST /v1/completions: prompts (text, texts, token ids, token-id lists), echo (also with
max_tokens = 0: the prompt-scoring path), logprobs, n, stop, seed, streaming (SSE), usage.
max_tokens defaults to 16 (OpenAI's and vLLM's). A stream sends one choice per chunk (each with
its index, as OpenAI and vLLM), with the running usage in each when stream_options asks for
continuous_usage_stats.

Text always comes from the engine's detokenizer (partial UTF-8 characters and partial stop
strings are held back there); this module never decodes generated tokens itself. Only the
legacy logprobs object's per-token strings are rendered here (the echoed prompt's pieces by
prefix decoding, so that the pieces join to the prompt text).
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, PromptTokensDetails, UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving import (
    SSE_DONE, GroupStreamingResponse, PromptInput, RequestGroup, ServingContext, check_length, check_model,
    check_n, check_queue, check_rate_limit, check_unsupported, continuous_usage, prompt_logprobs_json,
    sampling_params, sse, sse_error, token_pieces, truncate_prompt,
)
from pagedllm.outputs import CompletionOutput

#: max_tokens of a completion request that gives none (OpenAI's Completions API and vLLM)
DEFAULT_MAX_TOKENS = 16


def _prompts(ctx: ServingContext, req: CompletionRequest) -> list[PromptInput]:
    p = req.prompt
    tok = ctx.tokenizer
    add_special = req.add_special_tokens is not False
    if isinstance(p, str):
        return [PromptInput(p, list(tok.encode(p, add_special_tokens=add_special)))]
    if not p:
        raise OpenAIError("prompt: the prompt is empty (an empty list)", 400, "prompt")
    if isinstance(p[0], str):
        return [PromptInput(s, list(tok.encode(s, add_special_tokens=add_special))) for s in p]
    if isinstance(p[0], int):
        return [PromptInput(None, list(p))]
    return [PromptInput(None, list(ids)) for ids in p]


class _Choice:
    """Accumulates one choice (prompt i, sequence j) across DELTA outputs."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: Optional[str] = None
        self.stop_reason = None

    def add(self, c: CompletionOutput) -> None:
        self.text.append(c.text)
        self.token_ids += c.token_ids
        if c.logprobs:
            self.logprobs += c.logprobs
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


class CompletionHandler:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def __call__(self, req: CompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        check_model(ctx, req.model)
        check_unsupported(req, ctx)
        if req.suffix is not None:
            raise OpenAIError("suffix: insertion (suffix) is not supported", 400, "suffix")
        n = 1 if req.n is None else req.n
        check_n(ctx, n)
        if req.best_of is not None and req.best_of != n:
            raise OpenAIError(f"best_of={req.best_of}: only best_of == n is supported (n={n})", 400, "best_of")
        prompts = _prompts(ctx, req)
        for p in prompts:
            kept = truncate_prompt(p.token_ids, req.truncate_prompt_tokens, ctx)
            if len(kept) != len(p.token_ids):
                p.token_ids, p.text = kept, None  # the echoed text is the kept tokens'
            p.max_tokens = check_length(ctx, len(p.token_ids), req.max_tokens, "prompt", default=DEFAULT_MAX_TOKENS)
        echo = bool(req.echo)
        logprobs = req.logprobs
        prompt_logprobs = req.prompt_logprobs
        if echo and logprobs is not None:
            prompt_logprobs = max(logprobs, prompt_logprobs or 0)
        params = [sampling_params(ctx, req, p.max_tokens, logprobs, prompt_logprobs) for p in prompts]
        check_rate_limit(ctx, raw_request, sum(len(p.token_ids) + n * p.max_tokens for p in prompts))
        await check_queue(ctx)
        base_id = req.request_id or random_id("cmpl")
        group = RequestGroup(ctx, raw_request, base_id)
        await group.add(prompts, params, req.priority, req.cache_salt)
        renderer = _Renderer(ctx, req, prompts, n, echo, base_id)
        if req.stream:
            return GroupStreamingResponse(renderer.stream(group), group)
        return await renderer.full(group)


class _Renderer:
    def __init__(self, ctx: ServingContext, req: CompletionRequest, prompts: list[PromptInput], n: int, echo: bool,
                 response_id: str):
        self.ctx, self.req, self.prompts, self.n, self.echo = ctx, req, prompts, n, echo
        self.id = response_id
        self.want_logprobs = req.logprobs is not None
        self.num_cached = 0

    def _prompt_text(self, i: int) -> str:
        p = self.prompts[i]
        if p.text is None:
            p.text = self.ctx.tokenizer.decode(p.token_ids)
        return p.text

    def _prompt_logprobs_part(self, i: int, prompt_logprobs, offset0: int = 0) -> CompletionLogprobs:
        """The echoed prompt's entries of the legacy logprobs object (first token: null)."""
        ids = self.prompts[i].token_ids
        pieces = ([f"token_id:{t}" for t in ids] if self.req.return_tokens_as_token_ids
                  else token_pieces(self.ctx.tokenizer, ids))
        out = CompletionLogprobs()
        offset = offset0
        for k, (tid, piece) in enumerate(zip(ids, pieces)):
            entry = prompt_logprobs[k] if prompt_logprobs is not None and k < len(prompt_logprobs) else None
            out.tokens.append(piece)
            out.text_offset.append(offset)
            offset += len(piece)
            if entry is None or tid not in entry:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(entry[tid].logprob)
                out.top_logprobs.append(_top(entry, self.req.logprobs, self.req.return_tokens_as_token_ids))
        return out

    def _output_logprobs_part(self, token_ids: list[int], logprobs, offset0: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        offset = offset0
        for tid, entry in zip(token_ids, logprobs or []):
            lp = entry.get(tid)
            if self.req.return_tokens_as_token_ids:
                piece = f"token_id:{tid}"
            else:
                piece = (lp.decoded_token if lp is not None and lp.decoded_token is not None
                         else self.ctx.tokenizer.decode([tid]))
            out.tokens.append(piece)
            out.text_offset.append(offset)
            offset += len(piece)
            out.token_logprobs.append(lp.logprob if lp is not None else None)
            out.top_logprobs.append(_top(entry, self.req.logprobs, self.req.return_tokens_as_token_ids))
        return out

    def _usage(self, completion_tokens: int) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached))

    async def full(self, group: RequestGroup) -> Response:
        choices = {(i, j): _Choice() for i in range(len(self.prompts)) for j in range(self.n)}
        prompt_lps: dict[int, object] = {}
        async for i, out in group.outputs():
            if out.prompt_logprobs is not None and i not in prompt_lps:
                prompt_lps[i] = out.prompt_logprobs
            if out.num_cached_tokens:
                self.num_cached += out.num_cached_tokens
            for c in out.outputs:
                choices[(i, c.index)].add(c)
        if group.disconnected:
            return Response(status_code=499)
        result = []
        for (i, j), ch in sorted(choices.items()):
            text = "".join(ch.text)
            lp = None
            if self.echo:
                ptext = self._prompt_text(i)
                if self.want_logprobs:
                    lp = self._prompt_logprobs_part(i, prompt_lps.get(i))
                    gen = self._output_logprobs_part(ch.token_ids, ch.logprobs, len(ptext))
                    _extend(lp, gen)
                text = ptext + text
            elif self.want_logprobs:
                lp = self._output_logprobs_part(ch.token_ids, ch.logprobs, 0)
            result.append(CompletionChoice(
                index=i * self.n + j, text=text, logprobs=lp, finish_reason=ch.finish_reason,
                stop_reason=ch.stop_reason,
                token_ids=ch.token_ids if self.req.return_token_ids else None,
                prompt_token_ids=self.prompts[i].token_ids if self.req.return_token_ids else None,
                prompt_logprobs=prompt_logprobs_json(prompt_lps.get(i)) if self.req.prompt_logprobs is not None else None,
            ))
        completion_tokens = sum(len(ch.token_ids) for ch in choices.values())
        resp = CompletionResponse(id=self.id, model=self.ctx.model_name, choices=result,
                                  usage=self._usage(completion_tokens))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def stream(self, group: RequestGroup) -> AsyncIterator[str]:
        started: set[tuple[int, int]] = set()
        offsets: dict[tuple[int, int], int] = {}
        completion_tokens = 0
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage) or self.ctx.force_include_usage
        running = continuous_usage(self.req)
        try:
            async for i, out in group.outputs():
                if out.num_cached_tokens:
                    self.num_cached += out.num_cached_tokens
                choices = []
                for c in out.outputs:
                    key = (i, c.index)
                    text, lp = c.text, None
                    completion_tokens += len(c.token_ids)
                    offset = offsets.get(key, 0)
                    if self.echo and key not in started:
                        ptext = self._prompt_text(i)
                        if self.want_logprobs:
                            lp = self._prompt_logprobs_part(i, out.prompt_logprobs)
                        text = ptext + text
                        offset = len(ptext)
                    if self.want_logprobs and c.token_ids:
                        gen = self._output_logprobs_part(c.token_ids, c.logprobs, offset)
                        lp = gen if lp is None else _extend(lp, gen)
                    offsets[key] = lp.text_offset[-1] + len(lp.tokens[-1]) if lp is not None and lp.tokens else offset
                    first = key not in started
                    started.add(key)
                    # a step whose text is held back (partial UTF-8 / stop string) still
                    # carries its token ids when the client asked for them (as the chat stream)
                    if (not text and c.finish_reason is None and lp is None and not first
                            and not (c.token_ids and self.req.return_token_ids)):
                        continue
                    choices.append(CompletionChoice(
                        index=i * self.n + c.index, text=text, logprobs=lp, finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if self.req.return_token_ids else None,
                        prompt_token_ids=self.prompts[i].token_ids if first and self.req.return_token_ids else None,
                        prompt_logprobs=(prompt_logprobs_json(out.prompt_logprobs)
                                         if first and self.req.prompt_logprobs is not None else None),
                    ))
                usage = self._usage(completion_tokens) if running else None
                for choice in choices:  # one choice per chunk, as OpenAI and vLLM
                    yield sse(CompletionResponse(id=self.id, model=self.ctx.model_name, choices=[choice], usage=usage))
            if group.disconnected:
                return
            if include_usage:
                yield sse(CompletionResponse(id=self.id, model=self.ctx.model_name, choices=[],
                                             usage=self._usage(completion_tokens)))
        except Exception as exc:  # after the 200 was sent, an error travels as an event
            yield sse_error(exc)
        yield SSE_DONE


def _top(entry: dict, k: Optional[int], as_ids: bool = False) -> dict[str, float]:
    """{token text (as_ids: "token_id:<id>"): logprob} of the entry's top-k tokens (plus the
    chosen one, as vLLM)."""
    items = sorted(entry.items(), key=lambda kv: (kv[1].rank or 0))
    out: dict[str, float] = {}
    for tid, lp in items:
        text = f"token_id:{tid}" if as_ids else lp.decoded_token if lp.decoded_token is not None else str(tid)
        if text not in out:
            out[text] = lp.logprob
    return out


def _extend(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    a.tokens += b.tokens
    a.text_offset += b.text_offset
    a.token_logprobs += b.token_logprobs
    a.top_logprobs += b.top_logprobs
    return a

