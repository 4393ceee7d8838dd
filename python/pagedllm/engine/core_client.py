"""Where AsyncLLM's engine runs: a thread of this process, or its own process (vLLM's EngineCore
clients, vllm/v1/engine/core_client.py: InprocClient and the multiprocess MPClient).

Both run an EngineLoop (engine/core_loop.py) over an LLMEngine and hand its event tuples to
``on_message`` on one background thread, in order; both take commands through ``send``.

- ``InprocClient``: the loop on a thread of this process ("pagedllm-engine"). The engine's Python
  work (scheduling, batch preparation, sampling, detokenization) shares the GIL with the event
  loop that serves HTTP.
- ``MPClient`` (the default; ``PAGEDLLM_ENABLE_MULTIPROCESSING=0`` turns it off, as vLLM's
  VLLM_ENABLE_V1_MULTIPROCESSING): the loop in the engine-core process (engine/core_proc.py),
  started with "spawn" (a script that creates an AsyncLLM at module level needs
  ``if __name__ == "__main__":``, as with vLLM). Commands and events travel as pickles over a
  pipe (a socket pair), RequestOutputs as tuples (engine/serial_utils.py); a reader thread here
  receives the events. If the process dies, the reader reports ("stopped", "the engine process
  exited with status N") and AsyncLLM fails what is in flight.
  ``start_engine_process(args, n)`` starts one engine for n front ends (the server's
  --api-server-count); ``MPClient(conn=..., info=...)`` attaches a front end to its pipe.

``EngineInfo``: what the front end needs of the engine without owning it (model config,
max_model_len, tokenizer, generation defaults, the engine arguments, its process id).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from pagedllm.engine.llm_engine import EngineArgs, LLMEngine
from pagedllm.engine.serial_utils import decode_output
from pagedllm.worker.worker_process import stop_processes

logger = logging.getLogger("pagedllm")

OnMessage = Callable[[tuple], None]


def multiprocessing_enabled() -> bool:
    """PAGEDLLM_ENABLE_MULTIPROCESSING (default 1): AsyncLLM runs its engine in its own process."""
    value = os.environ.get("PAGEDLLM_ENABLE_MULTIPROCESSING", "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on", ""):
        raise ValueError(f"PAGEDLLM_ENABLE_MULTIPROCESSING must be 0 or 1, got {value!r}")
    return value in ("1", "true", "yes", "on", "")


@dataclasses.dataclass
class EngineInfo:
    """The engine's facts the front end reads (all picklable)."""

    args: EngineArgs
    model_config: Any
    model_path: Path
    model_name: str
    max_model_len: int
    generation_defaults: dict
    tokenizer: Any
    pid: int  # of the process that runs the engine

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineInfo":
        return cls(engine.args, engine.model_config, engine.model_path, engine.model_name, engine.max_model_len,
                   dict(engine.generation_defaults), engine.tokenizer, os.getpid())


class InprocClient:
    """The engine loop on a thread of this process (module docstring)."""

    def __init__(self, engine_args: EngineArgs, on_message: OnMessage):
        from pagedllm.engine.core_loop import EngineLoop

        self.engine = LLMEngine(engine_args)
        self.info = EngineInfo.of(self.engine)
        self._commands: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._on_message = on_message

        def recv(block: bool) -> Optional[tuple]:
            try:
                return self._commands.get(block=block)
            except queue.Empty:
                return None

        self._loop = EngineLoop(self.engine, recv, on_message)
        self._thread = threading.Thread(target=self._loop.run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def send(self, cmd: tuple) -> None:
        self._commands.put(cmd)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float) -> bool:
        self._commands.put(("stop",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("engine thread did not stop within %.0f s", timeout)
            return False
        self.engine.shutdown()
        self.engine = None
        gc.collect()
        return True


def start_engine_process(engine_args: EngineArgs, num_clients: int = 1):
    """Start the engine-core process for num_clients front ends and wait until its engine is
    built. Returns (process, [pipe per front end], EngineInfo); raises the engine's start-up error
    (ValueError for bad arguments) after the process has exited."""
    import torch

    from pagedllm.engine.core_proc import engine_core_main

    ctx = multiprocessing.get_context("spawn")
    pairs = [ctx.Pipe(duplex=True) for _ in range(num_clients)]
    root = logging.getLogger()
    log = (logging.getLogger("pagedllm").getEffectiveLevel(), bool(root.handlers))
    proc = ctx.Process(target=engine_core_main, name="pagedllm-engine-core",
                       args=([child for _, child in pairs], engine_args, torch.get_num_threads(), log), daemon=False)
    proc.start()
    for _, child in pairs:
        child.close()
    conns = [conn for conn, _ in pairs]
    try:
        while not conns[0].poll(0.5):
            if not proc.is_alive():
                raise RuntimeError(f"the engine process exited with status {proc.exitcode} before it was ready")
        try:
            msg = conns[0].recv()
        except EOFError:
            proc.join(5.0)
            raise RuntimeError(f"the engine process exited with status {proc.exitcode} before it was ready") from None
        if msg[0] == "error":
            raise msg[1]
    except BaseException:
        for conn in conns:
            conn.close()
        stop_engine_process(proc, 5.0)
        raise
    logger.info("engine core process %d ready", proc.pid)
    return proc, conns, msg[1]


def stop_engine_process(proc, timeout: float) -> None:
    """Wait for the engine process to exit (it stops once its pipes close), then end it."""
    if stop_processes([proc], timeout):
        logger.error("the engine process did not stop within %.0f s: terminated it", timeout)


class MPClient:
    """The engine loop in its own process (module docstring): started here (engine_args), or
    already running with this front end's pipe (conn and info; the process is not ours to stop)."""

    def __init__(self, engine_args: Optional[EngineArgs], on_message: OnMessage, *, conn=None,
                 info: Optional[EngineInfo] = None):
        if conn is None:
            self._proc, (self._conn,), self.info = start_engine_process(engine_args, 1)
        else:
            self._proc, self._conn, self.info = None, conn, info
        self._send_lock = threading.Lock()
        self._on_message = on_message
        self._reader = threading.Thread(target=self._read, name="pagedllm-engine-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The engine-core process's pid."""
        return self.info.pid

    def _read(self) -> None:
        error: Optional[str] = None
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "stopped":
                    error = msg[1]
                    break
                if msg[0] == "events":
                    msg = msg[:2] + ([decode_output(t) for t in msg[2]],) + msg[3:]
                self._on_message(msg)
        except (EOFError, OSError):
            code = None
            if self._proc is not None:
                self._proc.join(2.0)
                code = self._proc.exitcode
            error = f"the engine process exited with status {code}" if code is not None else "the engine process is gone"
            logger.error("%s", error)
        except BaseException as exc:  # pragma: no cover - a bug in on_message
            logger.exception("the engine reader thread failed")
            error = f"the engine reader thread failed: {exc!r}"
        self._on_message(("stopped", error))

    def send(self, cmd: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(cmd)
        except (OSError, ValueError) as exc:  # the process is gone (or the pipe closed at shutdown)
            from pagedllm.engine.async_llm import EngineDeadError

            raise EngineDeadError(f"the engine process is gone: {exc}") from None

    def is_alive(self) -> bool:
        return self._reader.is_alive()

    def shutdown(self, timeout: float) -> bool:
        try:
            self.send(("stop",))
        except Exception:
            pass
        self._reader.join(timeout)
        self._conn.close()
        if self._proc is not None:
            stop_engine_process(self._proc, timeout)
        return True
