"""AsyncLLM: the asyncio front end of an LLMEngine (vLLM's ``vllm.v1.engine.async_llm.AsyncLLM``).

The engine runs in its own process by default (vLLM's engine core; engine/core_client.py), or on
a thread of this one (``multiprocess=False`` / PAGEDLLM_ENABLE_MULTIPROCESSING=0). Either way an
EngineLoop (engine/core_loop.py) owns the LLMEngine and steps it; asyncio code talks to it only
by commands, so the model keeps running while requests are tokenized, validated and their
chunks rendered and sent — and, with the process, without sharing the GIL with them::

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., max_model_len=512))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)          # cumulative text (output_kind=DELTA: only new text)
    await engine.abort("req-1")             # that generator ends (finish_reason "abort") < 1 s
    engine.get_metrics(); engine.shutdown()

Flow: event loop --(add / abort commands)--> engine loop: apply commands, ``LLMEngine.step()``,
then one event tuple per iteration back to this process's events thread (the engine thread
itself, or the reader of the engine process's pipe), which settles the adds, keeps the metrics
snapshot and hands each step's RequestOutputs to the event loop with one
``loop.call_soon_threadsafe`` per step. Each request has a ``RequestOutputCollector`` that merges outputs the consumer has not
read yet (DELTA outputs are concatenated, CUMULATIVE ones replaced), so a slow client never
queues up unbounded data. Detokenization and stop strings run in the engine (process).

Errors: ``add_request`` / ``generate`` raise ValueError (nothing queued, nothing leaked) for a bad
prompt or params, before anything is yielded. If a step raises (a bug), every request in flight
gets that error, their KV blocks are freed and the loop keeps serving. If the engine dies (its
process exits), every request in flight and every later call gets EngineDeadError and
``is_running`` turns False (the server then drains and exits with status 1).

Metrics: ``get_metrics()`` returns the engine's metrics (see pagedllm.metrics) as of its last
report (at least every 50 ms while busy, and with every finished request), with vLLM's request
histograms time_to_first_token_seconds, inter_token_latency_seconds,
e2e_request_latency_seconds, ... and the counter request_success (label finished_reason),
observed by the engine loop (engine/request_stats.py) from the arrival time this front end
gives each request.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, AsyncGenerator, Optional, Union

from pagedllm.engine.core_client import InprocClient, MPClient, multiprocessing_enabled
from pagedllm.engine.llm_engine import EngineArgs
from pagedllm.metrics import PREFIX, Metric
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedllm")

@dataclasses.dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for AsyncLLM (vLLM's name); the same fields as LLM's engine arguments."""


class EngineDeadError(RuntimeError):
    """The engine has stopped (after shutdown(), or its process / thread died)."""


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
    """Front-end bookkeeping of one request."""

    collector: RequestOutputCollector
    loop: asyncio.AbstractEventLoop
    prompt_token_ids: Optional[list] = None  # as sent; the engine's (truncated) ids once known


class AsyncLLM:
    """Asynchronous engine: an LLMEngine stepped by an engine-core process or thread (module
    docstring).

    Construct with ``AsyncLLM.from_engine_args(AsyncEngineArgs(...))`` or
    ``AsyncLLM(model=..., **LLM keyword arguments)``; ``multiprocess`` (default: the environment's
    PAGEDLLM_ENABLE_MULTIPROCESSING, on) picks the engine's own process over a thread of this one;
    engine_conn + engine_info attach to an engine process already running (one of the server's
    API processes: engine/core_client.start_engine_process). Thread-safe for asyncio callers on
    any one event loop per request."""

    def __init__(self, engine_args: Optional[EngineArgs] = None, *, multiprocess: Optional[bool] = None,
                 engine_conn=None, engine_info=None, **kwargs: Any):
        if engine_conn is not None:  # an API server process: the engine process runs already
            engine_args = engine_info.args
        elif engine_args is None:
            engine_args = AsyncEngineArgs(**kwargs)
        elif kwargs:
            raise TypeError("pass either engine_args or keyword arguments, not both")
        self._lock = threading.Lock()  # guards the fields below (event loop vs the events thread)
        self._requests: dict[str, _Tracked] = {}  # accepted by the engine, not finished
        self._pending: dict[str, tuple[_Tracked, asyncio.Future]] = {}  # sent, not yet accepted
        self._engine_metrics: list[Metric] = []
        self._metrics_time = 0.0  # time.monotonic() of the snapshot
        self._metrics_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.shared_engine = engine_conn is not None  # one of several front ends of one engine
        self._stopped = False
        self._dead: Optional[str] = None
        if engine_conn is not None:
            multiprocess = True
            self.client = MPClient(None, self._on_message, conn=engine_conn, info=engine_info)
        else:
            if multiprocess is None:
                multiprocess = multiprocessing_enabled()
            client_cls = MPClient if multiprocess else InprocClient
            self.client = client_cls(engine_args, self._on_message)
        info = self.client.info
        self.info = info
        # The front end tokenizes on the event loop while the engine detokenizes: a thread of its
        # own gets its own tokenizer object (a fast tokenizer is not safe to share).
        self.tokenizer = info.tokenizer if multiprocess else copy.deepcopy(info.tokenizer)
        self.model_config = info.model_config
        self.max_model_len = info.max_model_len
        self._model_name = info.model_name
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> "AsyncLLM":
        return cls(engine_args, **kwargs)

    # ------------------------------------------------------------------ public API (event loop)
    @property
    def is_running(self) -> bool:
        return not self._stopped and self._dead is None and self.client.is_alive()

    @property
    def model_name(self) -> str:
        return self._model_name

    def set_model_name(self, name: str) -> None:
        """The model_name label of the metrics (the server sets its served model name)."""
        self._model_name = name
        self.client.send(("model_name", name))

    @property
    def engine_args(self) -> EngineArgs:
        return self.info.args

    @property
    def generation_defaults(self) -> dict:
        """The model's generation_config.json sampling defaults (temperature, top_p, ...)."""
        return self.info.generation_defaults

    @property
    def model_path(self):
        return self.info.model_path

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.info.generation_defaults)

    def new_request_id(self) -> str:
        return str(next(self._ids))

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the engine: queued in the scheduler or not yet accepted by it."""
        with self._lock:
            waiting = next((m.value for m in self._engine_metrics
                            if m.name == PREFIX + "num_requests_waiting"), 0)
            return int(waiting) + len(self._pending)

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
        ids = list(prompt_token_ids)
        tracked = _Tracked(collector, loop, prompt_token_ids=ids)
        with self._lock:
            if request_id in self._requests or request_id in self._pending:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._pending[request_id] = (tracked, accepted)
        try:
            self.client.send(("add", request_id, prompt, ids, params, priority, cache_salt, time.monotonic()))
        except BaseException:
            with self._lock:
                self._pending.pop(request_id, None)
            raise
        try:
            await asyncio.shield(accepted)
        except asyncio.CancelledError:
            # The caller went away while the engine was accepting: make sure nothing stays queued.
            self._send_quietly(("abort", [request_id]))
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
                self._send_quietly(("abort", [request_id]))

    async def abort(self, request_id: Union[str, list[str]]) -> None:
        """Abort request(s): their generators yield a final output with finish_reason "abort"
        and end; their KV blocks are freed by the engine's next iteration."""
        rids = [request_id] if isinstance(request_id, str) else list(request_id)
        if rids:
            self._send_quietly(("abort", rids))

    async def abort_all(self) -> None:
        """Abort every request in flight (a server's shutdown timeout): each generator yields a final
        output with finish_reason "abort"."""
        self._send_quietly(("abort_all",))

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics and its request histograms (engine/request_stats.py), as of the
        engine's last report."""
        with self._lock:
            return list(self._engine_metrics)

    async def refresh_metrics(self, max_age: float = 0.0) -> None:
        """With an engine shared by several front ends (an API server process), whose snapshot
        here is only refreshed by this front end's own requests: ask the engine for a fresh one
        unless it is at most max_age seconds old, and wait for it (about one engine step). A
        no-op otherwise (the engine reports to its only front end)."""
        if not self.shared_engine or time.monotonic() - self._metrics_time <= max_age:
            return
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            self._metrics_waiters.append((asyncio.get_running_loop(), fut))
        self.client.send(("metrics",))
        await asyncio.wait_for(fut, 30.0)

    async def check_health(self) -> None:
        self._check_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine (its process or thread), abort what is in flight, free the KV pool and
        the weights. Idempotent; another engine can be created in this process afterwards."""
        if self._stopped:
            return
        self._stopped = True
        self.client.shutdown(timeout)

    # ------------------------------------------------------------------ helpers (event loop)
    def _check_alive(self) -> None:
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        if self._dead is not None or not self.client.is_alive():
            raise EngineDeadError(f"the engine died: {self._dead}")

    def _send_quietly(self, cmd: tuple) -> None:
        """Send a command whose loss does not matter once the engine is gone (aborts)."""
        try:
            self.client.send(cmd)
        except EngineDeadError:
            pass

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

    # ------------------------------------------------------------------ events (engine / reader thread)
    def _on_message(self, msg: tuple) -> None:
        """The engine loop's events (engine/core_loop.py), in order, on one background thread:
        settle accepted adds, keep the metrics snapshot, then hand outputs to their event loops
        (so a consumer that sees an output also sees metrics that include its step)."""
        if msg[0] == "stopped":
            self._on_stopped(msg[1])
            return
        _, accepted, outputs, failed, error, metrics = msg
        calls: list = []  # (loop, fn, args)
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            if metrics is not None:
                self._engine_metrics = metrics
                self._metrics_time = time.monotonic()
                waiters, self._metrics_waiters = self._metrics_waiters, []
                calls += [(loop, _set_future, (fut, None)) for loop, fut in waiters]
            for rid, exc in accepted:
                entry = self._pending.pop(rid, None)
                if entry is None:
                    continue
                tracked, fut = entry
                if exc is None:
                    self._requests[rid] = tracked
                calls.append((tracked.loop, _set_future, (fut, exc)))
            for out in outputs:
                tracked = self._requests.get(out.request_id)
                if tracked is None:
                    continue
                if out.prompt_token_ids is None:  # sent once by the engine process
                    out.prompt_token_ids = tracked.prompt_token_ids
                else:
                    tracked.prompt_token_ids = out.prompt_token_ids
                batches.setdefault(tracked.loop, []).append((tracked.collector, out))
                if out.finished:
                    del self._requests[out.request_id]
            if failed:
                exc = RuntimeError(error or "engine step failed")
                for rid in failed:
                    tracked = self._requests.pop(rid, None)
                    if tracked is not None:
                        batches.setdefault(tracked.loop, []).append((tracked.collector, exc))
        for loop, fn, args in calls:
            _call_soon(loop, fn, *args)
        for loop, items in batches.items():
            _call_soon(loop, _put_all, items)

    def _on_stopped(self, error: Optional[str]) -> None:
        """The engine loop ended: refuse what is still pending, fail what is still running."""
        if error is not None:
            self._dead = error
            if not self._stopped:
                logger.error("the engine stopped: %s", error)
        exc = EngineDeadError("the engine is shut down" if error is None else f"the engine died: {error}")
        with self._lock:
            pending, self._pending = self._pending, {}
            requests, self._requests = self._requests, {}
            waiters, self._metrics_waiters = self._metrics_waiters, []
        for loop, fut in waiters:
            _call_soon(loop, _set_future, fut, exc)
        for tracked, fut in pending.values():
            _call_soon(tracked.loop, _set_future, fut, exc)
        for tracked in requests.values():
            _call_soon(tracked.loop, _put_all, [(tracked.collector, exc)])


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
