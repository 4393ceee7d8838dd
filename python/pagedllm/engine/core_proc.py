"""The engine-core process (vLLM's EngineCoreProc): one LLMEngine and its EngineLoop serving one
or more front ends (an AsyncLLM each: the server's API processes) over pipes.

Started by engine/core_client.py (``start_engine_process``) with "spawn". It builds the engine,
answers ``("ready", EngineInfo)`` (or ``("error", exception)``) on the first pipe, then runs the
EngineLoop with ``ClientMux`` as its command source and event sink:

- commands from every pipe, in arrival order; with several front ends a request id becomes
  ``"<front end>|<id>"`` inside the engine (each front end numbers its requests on its own), and
  a front end's ``abort_all`` / ``stop`` / closed pipe aborts only its own requests;
- each event goes to the front end that owns its requests (ids restored); metrics go with them,
  and to a front end that asked (``("metrics",)``: its /metrics); with several front ends an idle
  one gets nothing (a front end still starting does not read its pipe, and a full pipe would
  stall the engine);
  RequestOutputs travel as tuples (engine/serial_utils.py), a request's prompt_token_ids with
  its first output only (the front end keeps them);
- the loop stops once every front end has gone (stop command or closed pipe).

The process ignores SIGINT / SIGTERM (a server drains first, then stops it) and exits when its
parent process is gone.
"""

from __future__ import annotations

import collections
import logging
import pickle
import signal
import traceback
from multiprocessing.connection import wait
from typing import Optional

logger = logging.getLogger("pagedllm")


def portable(exc: BaseException) -> BaseException:
    """exc if it survives pickling, else a ValueError / RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        cls = ValueError if isinstance(exc, ValueError) else RuntimeError
        return cls(str(exc) if cls is ValueError else f"{type(exc).__name__}: {exc}")


class ClientMux:
    """The engine's side of the front ends' pipes: ``recv`` and ``emit`` for the EngineLoop."""

    def __init__(self, conns: list):
        from pagedllm.engine.serial_utils import encode_output, without_prompt_ids

        self._encode, self._strip = encode_output, without_prompt_ids
        self.conns = list(conns)
        self.multi = len(conns) > 1
        self.open = set(range(len(conns)))
        self.pending: collections.deque = collections.deque()
        self.live: list[set[str]] = [set() for _ in conns]  # engine request ids of each front end
        self.sent_prompt: set[str] = set()  # requests whose prompt ids went out already
        self.asked: set[int] = set()  # front ends waiting for a metrics snapshot

    # ---- commands in ------------------------------------------------------------------------
    def recv(self, block: bool) -> Optional[tuple]:
        while not self.pending:
            if not self.open:
                raise EOFError
            ready = wait([self.conns[i] for i in self.open], timeout=None if block else 0)
            if not ready:
                return None
            for conn in ready:
                i = self.conns.index(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._close(i)
                    continue
                self._command(i, msg)
        return self.pending.popleft()

    def _command(self, i: int, cmd: tuple) -> None:
        kind = cmd[0]
        if not self.multi:
            if kind == "add":
                self.live[0].add(cmd[1])
            self.pending.append(cmd)
        elif kind == "add":
            rid = f"{i}|{cmd[1]}"
            self.live[i].add(rid)
            self.pending.append(("add", rid, *cmd[2:]))
        elif kind == "abort":
            self.pending.append(("abort", [f"{i}|{r}" for r in cmd[1]]))
        elif kind == "abort_all":
            self.pending.append(("abort", list(self.live[i])))
        elif kind == "metrics":
            self.asked.add(i)
            self.pending.append(cmd)
        elif kind == "stop":  # this front end is leaving: the others keep the engine
            self._send(i, ("stopped", None))
            self._close(i)
        else:
            self.pending.append(cmd)

    def _close(self, i: int) -> None:
        if i not in self.open:
            return
        self.open.discard(i)
        try:
            self.conns[i].close()
        except OSError:
            pass
        if self.multi and self.live[i]:
            self.pending.append(("abort", list(self.live[i])))
        if not self.open:
            self.pending.append(("stop",))

    # ---- events out -------------------------------------------------------------------------
    def _owner(self, rid: str) -> tuple[int, str]:
        if not self.multi:
            return 0, rid
        i, _, own = rid.partition("|")
        return int(i), own

    def emit(self, msg: tuple) -> None:
        if msg[0] != "events":
            for i in list(self.open):
                self._send(i, msg)
            return
        _, accepted, outputs, failed, error, metrics = msg
        parts = [([], [], []) for _ in self.conns]
        for rid, exc in accepted:
            i, own = self._owner(rid)
            if exc is not None:
                self.live[i].discard(rid)
                exc = portable(exc)
            parts[i][0].append((own, exc))
        for out in outputs:
            rid = out.request_id
            i, own = self._owner(rid)
            t = self._encode(out)
            if rid in self.sent_prompt:
                t = self._strip(t)
            if out.finished:
                self.sent_prompt.discard(rid)
                self.live[i].discard(rid)
            else:
                self.sent_prompt.add(rid)
            parts[i][1].append(t if own is rid else (own,) + t[1:])
        for rid in failed:
            i, own = self._owner(rid)
            self.sent_prompt.discard(rid)
            self.live[i].discard(rid)
            parts[i][2].append(own)
        for i in list(self.open):
            acc, outs, fail = parts[i]
            mine = bool(acc or outs or fail)
            wanted = metrics is not None and (not self.multi or mine or i in self.asked)
            if mine or wanted:
                self._send(i, ("events", acc, outs, fail, error, metrics if wanted else None))
                if wanted:
                    self.asked.discard(i)

    def _send(self, i: int, msg: tuple) -> None:
        try:
            self.conns[i].send(msg)
        except (OSError, ValueError):  # that front end is gone
            self._close(i)


def engine_core_main(conns: list, engine_args, threads: int, log: tuple) -> None:
    """Entry point of the engine-core process (module docstring). conns: one pipe per front end;
    threads: torch's CPU threads (0: leave); log: (the pagedllm logger's level, whether to set up
    logging as the parent has)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from pagedllm.worker.worker_process import exit_with_parent

    exit_with_parent()
    level, configure = log
    if configure:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllm").setLevel(level)
    from pagedllm import ops
    from pagedllm.engine.core_client import EngineInfo
    from pagedllm.engine.core_loop import EngineLoop
    from pagedllm.engine.llm_engine import LLMEngine

    if threads > 0:
        ops.set_cpu_threads(threads)
    try:
        engine = LLMEngine(engine_args)
    except BaseException as exc:
        logger.debug("engine start-up failed:\n%s", traceback.format_exc())
        conns[0].send(("error", portable(exc)))
        for conn in conns:
            conn.close()
        return
    conns[0].send(("ready", EngineInfo.of(engine)))
    mux = ClientMux(conns)
    try:
        EngineLoop(engine, mux.recv, mux.emit, metrics_interval=0.05).run()
    finally:
        engine.shutdown()
        for conn in conns:
            try:
                conn.close()
            except OSError:
                pass
