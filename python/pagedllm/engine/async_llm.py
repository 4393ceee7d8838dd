"""AsyncLLM: the asyncio front end of an LLMEngine (vLLM's ``vllm.v1.engine.async_llm.AsyncLLM``).

One background thread (the *engine thread*) owns the LLMEngine and runs its step loop; asyncio
code talks to it only through a command queue, so the model keeps running while requests are
tokenized, validated, detokenized into HTTP chunks and sent::

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., max_model_len=512))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)          # cumulative text (output_kind=DELTA: only new text)
    await engine.abort("req-1")             # that generator ends (finish_reason "abort") < 1 s
    engine.get_metrics(); engine.shutdown()

Threads and queues:
  event loop  --(add / abort commands, queue.SimpleQueue)-->  engine thread
  engine thread: apply commands, ``LLMEngine.step()``, then hand each step's RequestOutputs to the
  event loop with one ``loop.call_soon_threadsafe`` per step; each request has a
  ``RequestOutputCollector`` that merges outputs the consumer has not read yet (DELTA outputs
  are concatenated, CUMULATIVE ones replaced), so a slow client never queues up unbounded data.

Errors: ``add_request`` / ``generate`` raise ValueError (nothing queued, nothing leaked) for a bad
prompt or params, before anything is yielded. If a step raises (a bug), every request in flight
gets that error, their KV blocks are freed and the loop keeps serving.

Metrics: ``get_metrics()`` returns the engine's metrics (see pagedllm.metrics) as of the last
loop iteration, plus the front-end histograms time_to_first_token_seconds,
inter_token_latency_seconds, e2e_request_latency_seconds (measured on the engine thread when
the step's outputs are produced) and the counter request_success (label finished_reason).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, AsyncGenerator, Optional, Union

from pagedllm.engine.llm_engine import EngineArgs, LLMEngine
from pagedllm.metrics import PREFIX, Counter, HistogramData, Metric
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedllm")

# Bucket bounds of vLLM's front-end histograms (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort", "error")
#: vLLM's request_params_n buckets
N_BUCKETS = [1, 2, 5, 10, 20]


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


@dataclasses.dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for AsyncLLM (vLLM's name); the same fields as LLM's engine arguments."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (after shutdown())."""


class RequestOutputCollector:
    """Holds the outputs of one request that its consumer has not read yet.

    put() runs on the event loop (via call_soon_threadsafe); get() awaits the next output. DELTA
    outputs are merged by concatenating text, token ids and logprobs per sequence index; other
    kinds keep only the newest output (it contains everything). An exception put here is raised
    by the next get()."""

    def __init__(self, output_kind: RequestOutputKind):
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: Union[RequestOutput, BaseException, None] = None
        self.ready = asyncio.Event()

    def put(self, output: Union[RequestOutput, BaseException]) -> None:
        if self.output is None or isinstance(output, BaseException) or isinstance(self.output, BaseException):
            if not isinstance(self.output, BaseException):
                self.output = output
        elif self.aggregate:
            self.output = _merge_delta(self.output, output)
        else:
            self.output = output
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        out, self.output = self.output, None
        self.ready.clear()
        if isinstance(out, BaseException):
            raise out
        return out


def _merge_delta(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    by_index = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        by_index[c.index] = CompletionOutput(
            index=c.index, text=prev.text + c.text, token_ids=list(prev.token_ids) + list(c.token_ids),
            cumulative_logprob=c.cumulative_logprob,
            logprobs=(prev.logprobs or []) + (c.logprobs or []) if (prev.logprobs is not None or c.logprobs is not None) else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        )
    return dataclasses.replace(
        new, outputs=[by_index[i] for i in sorted(by_index)],
        prompt_logprobs=old.prompt_logprobs if old.prompt_logprobs is not None else new.prompt_logprobs,
    )


@dataclasses.dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request (for the latency histograms)."""

    collector: RequestOutputCollector
    loop: asyncio.AbstractEventLoop
    arrival: float
    params: Optional[SamplingParams] = None
    tokens_seen: int = 0
    last_token_time: Optional[float] = None
    seq_tokens: dict = dataclasses.field(default_factory=dict)  # sequence index -> output tokens


class AsyncLLM:
    """Asynchronous engine: an LLMEngine stepped by a background thread (see module docstring).

    Construct with ``AsyncLLM.from_engine_args(AsyncEngineArgs(...))`` or
    ``AsyncLLM(model=..., **LLM keyword arguments)``. Thread-safe for asyncio callers on any one
    event loop per request."""

    def __init__(self, engine_args: Optional[EngineArgs] = None, **kwargs: Any):
        if engine_args is None:
            engine_args = AsyncEngineArgs(**kwargs)
        elif kwargs:
            raise TypeError("pass either engine_args or keyword arguments, not both")
        self.engine = LLMEngine(engine_args)
        # The front end tokenizes on the event loop while the engine thread detokenizes: each
        # thread gets its own tokenizer object (a fast tokenizer is not safe to share).
        self.tokenizer = copy.deepcopy(self.engine.tokenizer)
        self.model_config = self.engine.model_config
        self.max_model_len = self.engine.max_model_len
        self._commands: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._requests: dict[str, _Tracked] = {}  # engine thread only
        self._lock = threading.Lock()  # guards the fields below
        self._pending_adds = 0
        self._metrics_snapshot: list[Metric] = []
        tokens = buckets_1_2_5(self.max_model_len)
        self._histograms = {  # vLLM v1's front-end histograms, its bucket bounds
            "time_to_first_token_seconds": HistogramData(TTFT_BUCKETS),
            "inter_token_latency_seconds": HistogramData(ITL_BUCKETS),
            "e2e_request_latency_seconds": HistogramData(E2E_BUCKETS),
            "request_queue_time_seconds": HistogramData(E2E_BUCKETS),
            "request_inference_time_seconds": HistogramData(E2E_BUCKETS),
            "request_prefill_time_seconds": HistogramData(E2E_BUCKETS),
            "request_decode_time_seconds": HistogramData(E2E_BUCKETS),
            "request_prompt_tokens": HistogramData(tokens),
            "request_generation_tokens": HistogramData(tokens),
            "request_max_num_generation_tokens": HistogramData(tokens),
            "request_params_max_tokens": HistogramData(tokens),
            "request_params_n": HistogramData(N_BUCKETS),
        }
        self._finished_by_reason = {r: 0 for r in FINISH_REASONS}
        self._refresh_metrics()
        self._stopped = False
        self._dead: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run_loop, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "AsyncLLM":
        return cls(engine_args)

    # ------------------------------------------------------------------ public API (event loop)
    @property
    def is_running(self) -> bool:
        return not self._stopped and self._thread.is_alive()

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def set_model_name(self, name: str) -> None:
        """The model_name label of the metrics (the server sets its served model name)."""
        self.engine.model_name = name

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.engine.generation_defaults)

    def new_request_id(self) -> str:
        return self.engine.new_request_id()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the engine: queued in the scheduler or not yet handed to it."""
        with self._lock:
            waiting = next((m.value for m in self._metrics_snapshot
                            if m.name == PREFIX + "num_requests_waiting"), 0)
            return int(waiting) + self._pending_adds

    async def add_request(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str = "",
    ) -> RequestOutputCollector:
        """Queue a request on the engine; returns its output collector once the engine accepted
        it. Raises ValueError (nothing queued) when the engine rejects it."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        collector = RequestOutputCollector(params.output_kind)
        accepted: asyncio.Future = loop.create_future()
        tracked = _Tracked(collector, loop, time.monotonic(), params)
        with self._lock:
            self._pending_adds += 1
        self._commands.put(("add", request_id, prompt, list(prompt_token_ids), params, priority, cache_salt,
                            tracked, accepted))
        try:
            await asyncio.shield(accepted)
        except asyncio.CancelledError:
            # The caller went away while the engine was accepting: make sure nothing stays queued.
            self._commands.put(("abort", request_id))
            raise
        return collector

    async def generate(
        self,
        prompt: Union[str, dict],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str = "",
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield RequestOutputs of one request until it finishes (vLLM's AsyncLLM.generate).

        prompt: str, {"prompt": str} or {"prompt_token_ids": [...]} (TokensPrompt). Cancelling
        or closing the generator aborts the request. Raises ValueError for a bad request."""
        text, ids = self._parse_prompt(prompt)
        collector = await self.add_request(request_id, text, ids, sampling_params, priority, cache_salt)
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: Union[str, list[str]]) -> None:
        """Abort request(s): their generators yield a final output with finish_reason "abort"
        and end; their KV blocks are freed by the engine thread's next iteration."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self._commands.put(("abort", rid))

    async def abort_all(self) -> None:
        """Abort every request in flight (a server's shutdown timeout): each generator yields a final
        output with finish_reason "abort"."""
        self._commands.put(("abort_all",))

    def get_metrics(self) -> list[Metric]:
        """Engine metrics (as of the last loop iteration) plus the front-end histograms."""
        with self._lock:
            return list(self._metrics_snapshot)

    async def check_health(self) -> None:
        self._check_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread, abort what is in flight, free the KV pool and the weights.
        Idempotent; another engine can be created in this process afterwards."""
        if self._stopped:
            return
        self._stopped = True
        self._commands.put(("stop",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("engine thread did not stop within %.0f s", timeout)
            return
        self.engine.shutdown()
        import gc

        gc.collect()

    # ------------------------------------------------------------------ helpers (event loop)
    def _check_alive(self) -> None:
        if self._stopped or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down" if self._stopped else f"the engine thread died: {self._dead!r}")

    def _parse_prompt(self, prompt) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], list(self.tokenizer.encode(prompt["prompt"]))
        raise ValueError(f"a prompt must be a str, a TextPrompt or a TokensPrompt dict, got {prompt!r:.80}")

    # ------------------------------------------------------------------ engine thread
    def _run_loop(self) -> None:
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished_requests()
                if not self._apply_commands(block):
                    break
                outputs: list[RequestOutput] = []
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                    except Exception as exc:  # a bug: fail the requests in flight, keep serving
                        logger.exception("engine step failed; aborting %d request(s)", len(self._requests))
                        self._fail_all(RuntimeError(f"engine step failed: {exc}"))
                self._dispatch(outputs)
        except BaseException as exc:  # pragma: no cover - the loop itself failed
            self._dead = exc
            logger.exception("engine thread died")
            self._fail_all(RuntimeError(f"the engine thread died: {exc}"))
        finally:
            while True:  # adds queued behind "stop" (or a dead loop): refuse them
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "add":
                    tracked, accepted = cmd[7], cmd[8]
                    _call_soon(tracked.loop, _set_future, accepted, EngineDeadError("the engine is shut down"))
            for rid in list(self._requests):
                try:
                    final = engine.abort_request(rid)
                except Exception:
                    final = None
                self._deliver(rid, final if final is not None else EngineDeadError("the engine is shut down"),
                              finished=True)
            self._refresh_metrics()

    def _apply_commands(self, block: bool) -> bool:
        """Run queued commands (blocking for the first one when idle); False on "stop"."""
        first = True
        added = 0
        try:
            while True:
                try:
                    cmd = self._commands.get(block=block and first, timeout=None)
                except queue.Empty:
                    return True
                first = False
                kind = cmd[0]
                if kind == "stop":
                    return False
                if kind == "add":
                    added += 1
                    self._apply_add(*cmd[1:])
                elif kind == "abort_all":
                    for rid in list(self._requests):
                        self._deliver(rid, self.engine.abort_request(rid), finished=True)
                elif kind == "abort":
                    rid = cmd[1]
                    if rid in self._requests:
                        final = self.engine.abort_request(rid)
                        self._deliver(rid, final, finished=True)
                    elif self.engine.has_request(rid):
                        self.engine.abort_request(rid)
        finally:
            if added:
                self._refresh_metrics(consumed_adds=added)

    def _apply_add(self, request_id, prompt, ids, params, priority, cache_salt, tracked: _Tracked, accepted) -> None:
        try:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.engine.add_request(request_id, prompt, ids, params, priority=priority, cache_salt=cache_salt)
        except Exception as exc:
            tracked.loop.call_soon_threadsafe(_set_future, accepted, exc)
            return
        self._requests[request_id] = tracked
        tracked.loop.call_soon_threadsafe(_set_future, accepted, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Observe latencies, refresh the metrics snapshot, then hand the outputs to their event
        loops (so a consumer that sees an output also sees metrics that include its step)."""
        if not outputs:
            self._refresh_metrics()
            return
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:
                continue
            self._observe(tracked, out, now)
            batches.setdefault(tracked.loop, []).append((tracked.collector, out))
            if out.finished:
                del self._requests[out.request_id]
        self._refresh_metrics()
        for loop, items in batches.items():
            _call_soon(loop, _put_all, items)

    def _observe(self, tracked: _Tracked, out: RequestOutput, now: float) -> None:
        delta = tracked.collector.aggregate
        for c in out.outputs:
            tracked.seq_tokens[c.index] = tracked.seq_tokens.get(c.index, 0) * delta + len(c.token_ids)
        total = sum(tracked.seq_tokens.values())
        hist = self._histograms
        with self._lock:
            if total > tracked.tokens_seen:
                if tracked.last_token_time is None:
                    hist["time_to_first_token_seconds"].observe(now - tracked.arrival)
                else:
                    hist["inter_token_latency_seconds"].observe(now - tracked.last_token_time)
                tracked.last_token_time = now
                tracked.tokens_seen = total
            if out.finished:
                hist["e2e_request_latency_seconds"].observe(now - tracked.arrival)
                reason = out.outputs[0].finish_reason if out.outputs else "abort"
                self._finished_by_reason[reason if reason in self._finished_by_reason else "abort"] += 1
                self._observe_finished(tracked, out, total)

    def _observe_finished(self, tracked: _Tracked, out: RequestOutput, total: int) -> None:
        """vLLM's per-request histograms of a finished request (vllm.v1.metrics: queued ->
        scheduled -> first token -> last token), from its RequestMetrics."""
        hist, m = self._histograms, out.metrics
        if m is not None and m.first_scheduled_time is not None:
            hist["request_queue_time_seconds"].observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                last = m.last_token_time if m.last_token_time is not None else m.first_token_time
                hist["request_prefill_time_seconds"].observe(m.first_token_time - m.first_scheduled_time)
                hist["request_decode_time_seconds"].observe(last - m.first_token_time)
                hist["request_inference_time_seconds"].observe(last - m.first_scheduled_time)
        hist["request_prompt_tokens"].observe(len(out.prompt_token_ids))
        hist["request_generation_tokens"].observe(total)
        hist["request_max_num_generation_tokens"].observe(max(tracked.seq_tokens.values(), default=0))
        if tracked.params is not None:
            hist["request_params_n"].observe(tracked.params.n)
            if tracked.params.max_tokens is not None:
                hist["request_params_max_tokens"].observe(tracked.params.max_tokens)

    def _deliver(self, request_id: str, item, finished: bool) -> None:
        tracked = self._requests.pop(request_id, None) if finished else self._requests.get(request_id)
        if tracked is None or item is None:
            return
        if isinstance(item, RequestOutput):
            self._observe(tracked, item, time.monotonic())
        self._refresh_metrics()
        _call_soon(tracked.loop, _put_all, [(tracked.collector, item)])

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._requests):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
            self._deliver(rid, exc, finished=True)

    def _refresh_metrics(self, consumed_adds: int = 0) -> None:
        metrics = self.engine.get_metrics()
        labels = {"model_name": self.engine.model_name}
        with self._lock:
            for name, hist in self._histograms.items():
                metrics.append(hist.metric(PREFIX + name, dict(labels)))
            # vLLM's older name of the same series (its dashboards still query it)
            metrics.append(self._histograms["inter_token_latency_seconds"].metric(
                PREFIX + "time_per_output_token_seconds", dict(labels)))
            for reason, count in self._finished_by_reason.items():
                metrics.append(Counter(PREFIX + "request_success", {**labels, "finished_reason": reason}, count))
            self._metrics_snapshot = metrics
            self._pending_adds -= consumed_adds


def _set_future(fut: asyncio.Future, exc: Optional[BaseException]) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _put_all(items) -> None:
    for collector, item in items:
        collector.put(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's event loop is closed: nobody is listening
        pass


#: vLLM's older name of AsyncLLM (vllm.AsyncLLMEngine is an alias of AsyncLLM in vLLM's v1 engine), so
#: scripts written as ``AsyncLLMEngine.from_engine_args(AsyncEngineArgs(...))`` run unchanged.
AsyncLLMEngine = AsyncLLM

__all__ = ["AsyncLLM", "AsyncLLMEngine", "AsyncEngineArgs", "EngineDeadError", "RequestOutputCollector"]
