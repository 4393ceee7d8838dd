"""Where AsyncLLM's engine runs: a thread of this process, or its own process (vLLM's EngineCore
clients, vllm/v1/engine/core_client.py: InprocClient and the multiprocess MPClient).

Both run an EngineLoop (engine/core_loop.py) over an LLMEngine and hand its event tuples to
``on_message`` on one background thread, in order; both take commands through ``send``.

- ``InprocClient``: the loop on a thread of this process ("pagedllm-engine"). The engine's Python
  work (scheduling, batch preparation, sampling, detokenization) shares the GIL with the event
  loop that serves HTTP.
- ``MPClient`` (the default; ``PAGEDLLM_ENABLE_MULTIPROCESSING=0`` turns it off, as vLLM's
  VLLM_ENABLE_V1_MULTIPROCESSING): the loop in an engine-core process started with "spawn" (a
  script that creates an AsyncLLM at module level needs ``if __name__ == "__main__":``, as with
  vLLM). Commands and events travel as pickles over a pipe (a socket pair), RequestOutputs as
  tuples (engine/serial_utils.py; a request's prompt_token_ids with its first output only, the
  front end keeps them); a reader thread here receives the events. The engine process ignores SIGINT / SIGTERM (the server drains first and
  then stops it) and exits when this process is gone. If it dies, the reader thread reports
  ("stopped", "the engine process exited with status N") and AsyncLLM fails what is in flight.

``EngineInfo``: what the front end needs of the engine without owning it (model config,
max_model_len, tokenizer, generation defaults, the engine arguments).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from pagedllm.engine.llm_engine import EngineArgs, LLMEngine
from pagedllm.engine.serial_utils import decode_output

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

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineInfo":
        return cls(engine.args, engine.model_config, engine.model_path, engine.model_name, engine.max_model_len,
                   dict(engine.generation_defaults), engine.tokenizer)


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


class MPClient:
    """The engine loop in its own process (module docstring)."""

    def __init__(self, engine_args: EngineArgs, on_message: OnMessage):
        import torch

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        root = logging.getLogger()
        log = (logging.getLogger("pagedllm").getEffectiveLevel(), bool(root.handlers))
        self._proc = ctx.Process(target=engine_core_main, name="pagedllm-engine-core",
                                 args=(child, engine_args, torch.get_num_threads(), log), daemon=False)
        self._proc.start()
        child.close()
        self._send_lock = threading.Lock()
        self._on_message = on_message
        try:
            self.info = self._wait_ready()
        except BaseException:
            self._stop_process(5.0)
            raise
        self._reader = threading.Thread(target=self._read, name="pagedllm-engine-reader", daemon=True)
        self._reader.start()
        logger.info("engine core process %d ready", self._proc.pid)

    @property
    def pid(self) -> Optional[int]:
        """The engine-core process's pid."""
        return self._proc.pid

    def _wait_ready(self) -> EngineInfo:
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited with status {self._proc.exitcode} before it was ready")
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5.0)
            raise RuntimeError(f"the engine process exited with status {self._proc.exitcode} before it was ready") from None
        if msg[0] == "error":
            raise msg[1]
        return msg[1]

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
        return self._stop_process(timeout)

    def _stop_process(self, timeout: float) -> bool:
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.error("the engine process did not stop within %.0f s: terminating it", timeout)
            self._proc.terminate()
            self._proc.join(5.0)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5.0)
        self._conn.close()
        return True


def _portable(exc: BaseException) -> BaseException:
    """exc if it survives pickling, else a ValueError / RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        cls = ValueError if isinstance(exc, ValueError) else RuntimeError
        return cls(str(exc) if cls is ValueError else f"{type(exc).__name__}: {exc}")


def engine_core_main(conn, engine_args: EngineArgs, threads: int, log: tuple) -> None:
    """Entry point of the engine-core process (module docstring): build the LLMEngine, answer
    ("ready", EngineInfo) or ("error", exception), then run the EngineLoop on the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from pagedllm.worker.worker_process import _exit_with_parent

    _exit_with_parent()
    level, configure = log
    if configure:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllm").setLevel(level)
    import torch

    from pagedllm import ops
    from pagedllm.engine.core_loop import EngineLoop
    from pagedllm.engine.serial_utils import encode_output, without_prompt_ids

    if threads > 0:
        torch.set_num_threads(threads)
        if hasattr(ops, "set_num_threads"):
            ops.set_num_threads(threads)
    try:
        engine = LLMEngine(engine_args)
    except BaseException as exc:
        logger.debug("engine start-up failed:\n%s", traceback.format_exc())
        conn.send(("error", _portable(exc)))
        conn.close()
        return
    conn.send(("ready", EngineInfo.of(engine)))

    def recv(block: bool) -> Optional[tuple]:
        if not block and not conn.poll():
            return None
        return conn.recv()  # EOFError once the front end is gone

    sent_prompt: set[str] = set()  # requests whose prompt_token_ids went out already (sent once)

    def encode(out) -> tuple:
        t = encode_output(out)
        rid = out.request_id
        if rid in sent_prompt:
            t = without_prompt_ids(t)
        if out.finished:
            sent_prompt.discard(rid)
        else:
            sent_prompt.add(rid)
        return t

    def emit(msg: tuple) -> None:
        if msg[0] == "events":
            _, accepted, outputs, failed, error, metrics = msg
            if accepted:
                accepted = [(rid, None if exc is None else _portable(exc)) for rid, exc in accepted]
            sent_prompt.difference_update(failed)
            msg = ("events", accepted, [encode(o) for o in outputs], failed, error, metrics)
        conn.send(msg)

    try:
        EngineLoop(engine, recv, emit, metrics_interval=0.05).run()
    finally:
        engine.shutdown()
        try:
            conn.close()
        except OSError:
            pass
