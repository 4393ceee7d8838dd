"""EngineLoop: the busy loop that owns an LLMEngine for AsyncLLM (vLLM's EngineCore busy loop).

It runs on AsyncLLM's engine thread, or in the engine-core process (engine/core_client.py): the
same code either way, talking to the front end only through messages.

Commands in (tuples, in order)::

    ("add", request_id, prompt, prompt_token_ids, SamplingParams, priority, cache_salt, arrival)
    ("abort", [request_id, ...])      ("abort_all",)      ("model_name", name)      ("stop",)
    ("metrics",)                      a metrics snapshot with the next events

Events out, one tuple per loop iteration that has something to say::

    ("events", accepted, outputs, failed, error, metrics)

- accepted: [(request_id, None | exception)] for the adds applied (an exception: refused, e.g.
  ValueError for a prompt longer than max_model_len; nothing was queued);
- outputs: the RequestOutputs of the step (and the final outputs of aborted requests);
- failed: request ids finished because the step raised (error: its message): the requests whose
  own setup failed (RequestSetupError: the others are rescheduled and go on), else every request
  in flight; their KV blocks are freed and the loop keeps serving;
- metrics: the engine's metrics (pagedllm.metrics) and the request histograms the loop observes
  (engine/request_stats.py; ``arrival``: the front end's time.monotonic() at add_request), or
  None when unchanged enough to skip (a snapshot always comes with accepted adds, finished
  requests, failures and going idle, else at most every ``metrics_interval`` seconds).

When the loop ends (a "stop" command, the commands' source closing, or a bug in the loop itself)
it aborts every request still in the engine, sends their final outputs and then
``("stopped", error)`` (error: None after a clean stop).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.request_stats import RequestStats
from pagedllm.output_processor import RequestSetupError
from pagedllm.outputs import RequestOutput

logger = logging.getLogger("pagedllm")

#: a command source: recv(block) -> the next command, or None when block is False and none is queued;
#: raises EOFError when the source is closed
Recv = Callable[[bool], Optional[tuple]]
Emit = Callable[[tuple], None]


class EngineLoop:
    """Steps `engine` while it has work, reading commands with `recv` and sending event tuples with
    `emit` (module docstring); metrics_interval: seconds between metrics snapshots while busy (0:
    every iteration). `run()` returns when the loop ends."""

    def __init__(self, engine: LLMEngine, recv: Recv, emit: Emit, metrics_interval: float = 0.0):
        self.engine = engine
        self.recv = recv
        self.emit = emit
        self.metrics_interval = metrics_interval
        self.stats = RequestStats(engine.max_model_len)
        self._last_metrics = 0.0
        self._metrics_asked = False

    def run(self) -> None:
        engine = self.engine
        error: Optional[str] = None
        try:
            while True:
                accepted, outputs = [], []
                if not self._apply_commands(not engine.has_unfinished_requests(), accepted, outputs):
                    break
                failed, step_error = [], None
                if engine.has_unfinished_requests():
                    try:
                        outputs += engine.step()
                    except RequestSetupError as exc:  # those requests alone; the step runs again
                        failed = list(exc.failures)
                        step_error = f"engine step failed: {exc}"
                        for rid in failed:
                            self._abort(rid)
                    except Exception as exc:  # a bug: fail the requests in flight, keep serving
                        failed = list(engine.output_processor.requests)
                        logger.exception("engine step failed; aborting %d request(s)", len(failed))
                        step_error = f"engine step failed: {exc}"
                        for rid in failed:
                            self._abort(rid)
                self._send(accepted, outputs, failed, step_error)
        except EOFError:  # the front end is gone
            error = None
        except BaseException as exc:  # pragma: no cover - the loop itself failed
            logger.exception("the engine loop died")
            error = f"the engine loop died: {exc!r}"
        finally:
            finals = []
            for rid in list(engine.output_processor.requests):
                final = self._abort(rid)
                if final is not None:
                    finals.append(final)
            try:
                if finals:
                    self._send([], finals, [], None, force_metrics=True)
                self.emit(("stopped", error))
            except Exception:  # the front end is gone: nobody to tell
                pass

    # ---------------------------------------------------------------------------------------
    def _apply_commands(self, block: bool, accepted: list, outputs: list) -> bool:
        """Run queued commands (waiting for the first one when block); False on "stop"."""
        first = True
        while True:
            cmd = self.recv(block and first)
            if cmd is None:
                return True
            first = False
            kind = cmd[0]
            if kind == "add":
                rid = cmd[1]
                try:
                    self.engine.add_request(rid, cmd[2], cmd[3], cmd[4], priority=cmd[5], cache_salt=cmd[6])
                except Exception as exc:
                    accepted.append((rid, exc))
                else:
                    accepted.append((rid, None))
                    self.stats.on_add(rid, cmd[4], cmd[7])
            elif kind == "abort":
                for rid in cmd[1]:
                    final = self._abort(rid)
                    if final is not None:
                        outputs.append(final)
            elif kind == "abort_all":
                for rid in list(self.engine.output_processor.requests):
                    final = self._abort(rid)
                    if final is not None:
                        outputs.append(final)
            elif kind == "model_name":
                self.engine.model_name = cmd[1]
            elif kind == "metrics":
                self._metrics_asked = True
            elif kind == "stop":
                return False
            else:
                raise ValueError(f"unknown engine command {kind!r}")

    def _abort(self, rid: str) -> Optional[RequestOutput]:
        try:
            return self.engine.abort_request(rid)
        except Exception:
            logger.exception("abort of %s failed", rid)
            return None

    def _send(self, accepted: list, outputs: list, failed: list, error: Optional[str],
              force_metrics: bool = False) -> None:
        now = time.monotonic()
        self.stats.on_outputs(outputs, now)
        self.stats.on_failed(failed)
        idle = not self.engine.has_unfinished_requests()
        want_metrics = (force_metrics or self._metrics_asked or accepted or failed or idle
                        or now - self._last_metrics >= self.metrics_interval or any(o.finished for o in outputs))
        self._metrics_asked = False
        if not (accepted or outputs or failed or want_metrics):
            return
        metrics = None
        if want_metrics:
            name = self.engine.model_name
            metrics = self.engine.get_metrics() + self.stats.metrics({"model_name": name} if name else {})
        if metrics is not None:
            self._last_metrics = now
        self.emit(("events", accepted, outputs, failed, error, metrics))
