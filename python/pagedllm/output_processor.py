"""OutputProcessor: the glue between one engine step and RequestOutputs.

It owns, per request, the n sequences' IncrementalDetokenizers (stop strings), logprobs and
finish state, registers new sequences with the Sampler, and turns each step's UpdateResult into
RequestOutputs (vLLM's output kinds: CUMULATIVE, DELTA, FINAL_ONLY). One engine step::

    proc = OutputProcessor(tokenizer, sampler, eos_token_ids)
    proc.add_request(request_id, prompt, prompt_token_ids, params)   # after core.add_request ok
    ...
    sched = core.schedule()
    proc.on_schedule(sched)                          # new_seqs -> sampler + detokenizers
    logits, prompt_rows = runner.execute(sched)      # prompt rows: see add_prompt_logprobs
    out = sampler(logits, sched.sample_seq_ids)
    result = core.update_from_output(sched, out.sampled_token_ids)
    outputs, stops = proc.on_update(result, sched.sample_seq_ids, out)
    for seq_id, stop_str in stops:                   # stop strings matched on the Python side
        core.finish_sequence(seq_id, stop_str)
    core.release(sched)

``outputs`` holds one RequestOutput per request with something to report this step (per its
output_kind; FINAL_ONLY requests only when finished). A request is finished when all n
sequences are; its state is then dropped.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from pagedllm.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from pagedllm.sample import LogprobsTensors, Sampler, SamplerOutput, TokenTextCache, logprob_dict
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


logger = logging.getLogger("pagedllm")


class RequestSetupError(RuntimeError):
    """Setting up some requests' sequences failed during a step (OutputProcessor.on_schedule).
    failures: {request_id: the exception}."""

    def __init__(self, failures: dict):
        self.failures = dict(failures)
        super().__init__("; ".join(f"request {rid}: {type(e).__name__}: {e}" for rid, e in self.failures.items()))


@dataclass
class _SeqState:
    index: int
    seq_id: int
    detok: IncrementalDetokenizer
    logprobs: Optional[SampleLogprobs]
    cumulative_logprob: Optional[float]
    finish_reason: Optional[str] = None
    stop_reason: object = None
    sent_tokens: int = 0  # DELTA: token ids / logprobs already reported
    changed: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: dict[int, _SeqState] = field(default_factory=dict)  # by index
    prompt_logprobs: Optional[PromptLogprobs] = None
    sent_prompt_logprobs: bool = False
    num_finished: int = 0
    metrics: Optional[RequestMetrics] = None
    tokens_timed: int = 0  # output tokens when metrics.last_token_time was set
    grammar: Optional[Future] = None  # structured outputs: the compiled grammar (StructuredOutputManager.submit)
    #: beam search: the engine's hypotheses once the search ended [(token_ids, cum_logprob, score, finish_reason)]
    beam_hypotheses: Optional[list] = None

    @property
    def finished(self) -> bool:
        return self.num_finished >= self.params.n


class OutputProcessor:
    """Per-request output state for an engine (see module docstring).

    tokenizer: for detokenization and Logprob.decoded_token. sampler: the engine's Sampler (new
    sequences are added to it, finished ones removed). eos_token_ids: the model's EOS ids
    (masked by the sampler before min_tokens).
    Errors: ValueError for a duplicate request id or params the sampler rejects.
    """

    def __init__(self, tokenizer, sampler: Sampler, eos_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.sampler = sampler
        self._structured = None  # StructuredOutputManager, at the first structured request
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.requests: dict[str, RequestState] = {}
        self._seq_owner: dict[int, tuple[str, int]] = {}
        self._token_text = TokenTextCache(tokenizer)
        self._num_with_stop_strings = 0

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, prompt: Optional[str], prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> Optional[Future]:
        """Register a request; returns its grammar's compile Future (structured outputs: the engine
        schedules the request once it is done), else None. ValueError: a duplicate id, bad params,
        a constraint that does not parse."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params.verify_for_vocab(self.sampler.vocab_size)
        grammar = None
        if params.structured_outputs is not None:  # parsed now (a bad one is refused here), compiled meanwhile
            grammar = self.structured_output_manager().submit(params.structured_outputs)
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, metrics=RequestMetrics(time.time()))
        state.grammar = grammar
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(state.prompt_token_ids)
        self.requests[request_id] = state
        if params.stop:
            self._num_with_stop_strings += 1
        return grammar

    def structured_output_manager(self):
        """The compiled grammars of this tokenizer (created at the first structured request)."""
        if self._structured is None:
            from pagedllm.structured_output import StructuredOutputManager

            self._structured = StructuredOutputManager(self.tokenizer, self.sampler.vocab_size)
        return self._structured

    def shutdown(self) -> None:
        """Stop the grammar threads (structured outputs: compiles, the sampler's bitmask fill)."""
        if self._structured is not None:
            self._structured.shutdown()
        self.sampler.shutdown()

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    @property
    def has_stop_strings(self) -> bool:
        """Whether an unfinished request has stop strings (matched here, during detokenization)."""
        return self._num_with_stop_strings > 0

    def _add_seq(self, seq_id: int, request_id: str, index: int) -> None:
        state = self.requests.get(request_id)
        if state is None or index in state.seqs:
            return
        params = state.params
        want_lp = params.logprobs is not None
        state.seqs[index] = _SeqState(
            index=index,
            seq_id=seq_id,
            # FINAL_ONLY without stop strings: no text before the end, decode once then.
            detok=IncrementalDetokenizer(
                self.tokenizer, params,
                defer_text=params.output_kind == RequestOutputKind.FINAL_ONLY and not params.stop,
                prompt_token_ids=state.prompt_token_ids),
            logprobs=[] if want_lp else None,
            cumulative_logprob=0.0 if want_lp else None,
        )
        self._seq_owner[seq_id] = (request_id, index)
        try:
            matcher = (self.structured_output_manager().matcher(params.structured_outputs, state.grammar.result())
                       if state.grammar is not None else None)
            self.sampler.add_sequence(seq_id, params, state.prompt_token_ids, index, self.eos_token_ids, matcher)
        except BaseException:  # nothing of the sequence stays registered
            del state.seqs[index]
            del self._seq_owner[seq_id]
            raise
        if state.metrics.first_scheduled_time is None:
            state.metrics.first_scheduled_time = time.time()

    def on_schedule(self, sched) -> None:
        """Register SchedulerOutput.new_seqs [(seq_id, request_id, index)] (sampler + state).

        A sequence whose setup raises (its detokenizer or sampler state) is left unregistered and
        the others are still registered; then RequestSetupError names the failed requests, so
        that the engine fails those alone (LLMEngine.step releases the step; the rest is
        rescheduled)."""
        failed: dict[str, BaseException] = {}
        for seq_id, request_id, index in sched.new_seqs:
            try:
                self._add_seq(int(seq_id), request_id, int(index))
            except Exception as exc:
                logger.exception("setting up request %s failed", request_id)
                failed.setdefault(request_id, exc)
        if failed:
            raise RequestSetupError(failed)

    def add_prompt_logprobs(self, request_id: str, first_position: int, tensors: LogprobsTensors) -> None:
        """Store prompt logprobs of rows scoring prompt tokens first_position+1 ... (one row each),
        as computed by ``compute_prompt_logprobs`` for a SchedulerOutput.prompt_logprob_rows entry."""
        state = self.requests.get(request_id)
        if state is None or state.prompt_logprobs is None:
            return
        for i in range(tensors.token_ids.shape[0]):
            pos = first_position + i + 1
            if pos < len(state.prompt_logprobs):
                state.prompt_logprobs[pos] = logprob_dict(tensors, i, self._token_text)

    # ------------------------------------------------------------------ one step
    def on_update(
        self, result, sample_seq_ids: np.ndarray, sampler_output: Optional[SamplerOutput]
    ) -> tuple[list[RequestOutput], list[tuple[int, str]]]:
        """Apply an UpdateResult; returns (RequestOutputs to report, [(seq_id, stop_str)] for
        core.finish_sequence). Sequences that finished are removed from the sampler."""
        seq_ids = np.asarray(result.seq_ids, dtype=np.int64)
        token_ids = np.asarray(result.token_ids)
        self.sampler.append_output_tokens(seq_ids, token_ids)
        for request_id, hypotheses in getattr(result, "beam_results", ()):  # (beams: in result.finished too)
            state = self.requests.get(request_id)
            if state is not None:
                state.beam_hypotheses = hypotheses
        finished_by_engine = {int(f[1]): f for f in result.finished}
        rows_of = None
        lp = sampler_output.logprobs if sampler_output is not None else None
        if lp is not None:
            # the k-th token a sequence appended this step comes from its k-th sampled row (a
            # speculative run has k + 1 rows; those past a rejection appended nothing)
            rows_of = {}
            for r, s in enumerate(np.asarray(sample_seq_ids).tolist()):
                rows_of.setdefault(int(s), []).append(r)
        seq_list = seq_ids.tolist()
        last_of = {s: i for i, s in enumerate(seq_list)}  # a sequence's last token of this step
        nth: dict[int, int] = {}
        touched: dict[str, RequestState] = {}
        stops: list[tuple[int, str]] = []

        for i, (seq_id, tok) in enumerate(zip(seq_list, token_ids.tolist())):
            k = nth[seq_id] = nth.get(seq_id, -1) + 1
            owner = self._seq_owner.get(seq_id)
            if owner is None:
                continue
            state = self.requests[owner[0]]
            seq = state.seqs[owner[1]]
            if seq.finish_reason is not None:
                continue
            if seq.logprobs is not None and rows_of is not None and k < len(rows_of.get(seq_id, ())):
                d = logprob_dict(lp, rows_of[seq_id][k], self._token_text)
                if d is not None:
                    seq.logprobs.append(d)
                    if tok in d:  # (not for a draft that a debug accept-all run emitted unsampled)
                        seq.cumulative_logprob += d[tok].logprob
            fin = finished_by_engine.get(seq_id) if i == last_of[seq_id] else None
            stop_terminated = fin is not None and fin[3] == "stop"
            stop_str = seq.detok.update([tok], stop_terminated, finished=fin is not None)
            seq.changed = True
            touched[state.request_id] = state
            if stop_str is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
                if seq_id not in finished_by_engine:  # (a later token of its run may have ended it)
                    stops.append((seq_id, stop_str))
                self._finish_seq(state, seq)
            elif fin is not None:
                seq.finish_reason, seq.stop_reason = fin[3], fin[4]
                self._finish_seq(state, seq)

        # Sequences finished without a token this step (max_tokens=0, max_model_len, abort).
        for seq_id, fin in finished_by_engine.items():
            request_id, index = fin[0], int(fin[2])
            state = self.requests.get(request_id)
            if state is None:
                continue
            if index not in state.seqs:
                self._add_seq(seq_id, request_id, index)
            seq = state.seqs[index]
            if seq.finish_reason is None:
                seq.detok.update([], finished=True)
                seq.finish_reason, seq.stop_reason = fin[3], fin[4]
                seq.changed = True
                touched[request_id] = state
                self._finish_seq(state, seq)

        outputs = []
        for state in touched.values():
            out = self._make_output(state)
            if out is not None:
                outputs.append(out)
            if state.finished:
                self._drop(state)
        return outputs, stops

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Finish every unfinished sequence with "abort" (after core.abort_request) and return
        the final RequestOutput (None for an unknown id)."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for index in range(state.params.n):
            seq = state.seqs.get(index)
            if seq is None:
                continue
            if seq.finish_reason is None:
                seq.detok.update([], finished=True)
                seq.finish_reason = "abort"
                seq.changed = True
                self._finish_seq(state, seq)
        state.num_finished = state.params.n
        out = self._make_output(state, force=True)
        self._drop(state)
        return out

    # ------------------------------------------------------------------ helpers
    def _finish_seq(self, state: RequestState, seq: _SeqState) -> None:
        state.num_finished += 1
        self.sampler.remove_sequence(seq.seq_id)
        self._seq_owner.pop(seq.seq_id, None)

    def _drop(self, state: RequestState) -> None:
        for seq in state.seqs.values():
            self.sampler.remove_sequence(seq.seq_id)
            self._seq_owner.pop(seq.seq_id, None)
        if self.requests.pop(state.request_id, None) is not None and state.params.stop:
            self._num_with_stop_strings -= 1

    def _completion(self, seq: _SeqState, delta: bool) -> CompletionOutput:
        finished = seq.finish_reason is not None
        text = seq.detok.get_next_output_text(finished, delta)
        start = seq.sent_tokens if delta else 0
        token_ids = seq.detok.token_ids[start:]
        logprobs = seq.logprobs[start:] if seq.logprobs is not None else None
        if delta:
            seq.sent_tokens = len(seq.detok.token_ids)
        seq.changed = False
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _beam_completion(self, params: SamplingParams, index: int, hypothesis) -> CompletionOutput:
        token_ids, cum_logprob, _score, finish_reason = hypothesis
        token_ids = [int(t) for t in token_ids]
        shown = token_ids
        if finish_reason == "stop" and not params.include_stop_str_in_output:
            shown = token_ids[:-1]  # the EOS token's text is left out (vLLM's stop handling)
        text = self.tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens) if params.detokenize else ""
        return CompletionOutput(index=index, text=text, token_ids=token_ids, cumulative_logprob=float(cum_logprob),
                                logprobs=None, finish_reason=finish_reason, stop_reason=None)

    def _make_output(self, state: RequestState, force: bool = False) -> Optional[RequestOutput]:
        kind = state.params.output_kind
        finished = state.finished
        metrics, now = state.metrics, time.time()
        tokens = sum(len(s.detok.token_ids) for s in state.seqs.values())
        if tokens > state.tokens_timed:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            state.tokens_timed = tokens
        if finished and metrics.finished_time is None:
            metrics.finished_time = now
        if kind == RequestOutputKind.FINAL_ONLY and not finished and not force:
            return None
        delta = kind == RequestOutputKind.DELTA
        if state.params.use_beam_search and not finished and not force:
            return None  # beams change until the search ends: the hypotheses come at once
        if state.beam_hypotheses is not None:
            completions = [self._beam_completion(state.params, i, h) for i, h in enumerate(state.beam_hypotheses)]
        else:
            seqs = [state.seqs[i] for i in sorted(state.seqs)]
            if delta:
                seqs = [s for s in seqs if s.changed]
            completions = [self._completion(s, delta) for s in seqs]
        prompt_logprobs = state.prompt_logprobs
        if delta and state.sent_prompt_logprobs:
            prompt_logprobs = None
        state.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=metrics,
        )


__all__ = ["OutputProcessor", "RequestState"]
