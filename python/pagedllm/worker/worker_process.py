"""The process of one tensor-parallel rank > 0 (started by executor/multiproc_executor.py).

worker_main joins the group, builds its ModelRunner (its shard of the weights and of every KV
block), reports ("ready", info) to the driver, then runs every step that arrives on the message
queue — the same steps, in the same order, as rank 0 — until a shutdown message or the queue's
close. It returns nothing per step: rank 0 samples.

Lifecycle: SIGINT is ignored (Ctrl-C reaches the whole process group; the driver decides), a
thread ends the process when the driver process is gone, and any error is sent to the driver as
("error", traceback) after aborting the group (so that rank 0 is not left waiting in a
collective); the process then exits with status 1.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from typing import Optional

import torch


def exit_with_parent() -> None:
    """In a spawned child: a daemon thread that ends this process (exit status 1) once the parent
    process is gone (its sentinel), so that no worker or engine process outlives its server."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)  # the driver is gone: nothing else will stop this process

    threading.Thread(target=watch, name="pagedllm-parent-watch", daemon=True).start()


def stop_processes(procs: list, timeout: float = 5.0) -> list:
    """Wait up to `timeout` seconds for `procs` (multiprocessing.Process) to exit, then terminate,
    then kill whatever still runs. Returns those it had to terminate (for the caller's log)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [p for p in procs if p.is_alive()]
    for p in stuck:
        p.terminate()
    for p in stuck:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    return stuck


def worker_main(rank: int, config, backend: str, port: Optional[int], shm_handle, reader, conn,
                threads: int) -> None:
    """Entry point of rank `rank` (see the module docstring). config: executor.abstract.ExecutorConfig."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()

    from pagedllm import ops
    from pagedllm.distributed.pipeline import init_model_parallel
    from pagedllm.distributed.shm_broadcast import QueueClosed
    from pagedllm.executor.step_message import COLLECT, SHUTDOWN, decode_step, message_kind
    from pagedllm.worker.model_runner import ModelRunner

    group = pp_group = runner = None
    status = 0
    try:
        device = torch.device("cuda", rank) if config.device.type == "cuda" else torch.device("cpu")
        if device.type == "cpu":
            ops.set_cpu_threads(threads)
        conn.send(("joining", rank))
        group, pp_group = init_model_parallel(rank, config.tensor_parallel_size, config.pipeline_parallel_size,
                                              device, backend, port=port, shm_handle=shm_handle)
        runner = ModelRunner(config.model_path, config.model_config, device=device, tp_group=group,
                             pp_group=pp_group, **config.runner_kwargs())
        conn.send(("ready", {"rank": rank, "pid": os.getpid(), "weight_bytes": runner.weight_bytes,
                             "num_blocks": runner.num_blocks, "kv_bytes": runner.num_blocks * runner.bytes_per_block,
                             "num_kv_heads": runner.num_kv_heads}))
        pipelined = config.pipeline_parallel_size > 1
        handles = collections.deque()  # pipeline stage 0: submitted steps, collected on COLLECT
        while True:
            message = reader.get()
            kind = message_kind(message)
            if kind == SHUTDOWN:
                break
            if kind == COLLECT:
                if handles:  # (stage 0 only: the logits' all-gather with the driver)
                    runner.collect_step(handles.popleft())
                continue
            step = decode_step(message)
            prev = None
            if step.num_placeholders:  # receives rank 0's sampled ids by broadcast
                prev = torch.empty(step.prev_num_sampled, dtype=torch.int64, device=device)
            if pipelined:
                handle = runner.submit_step(step, prev_sampled=prev)
                if handle is not None:
                    handles.append(handle)
            else:
                runner.execute_model(step, prev_sampled=prev)
    except QueueClosed:
        pass
    except BaseException:  # noqa: BLE001 (reported to the driver, then the process ends)
        status = 1
        for g in (group, pp_group):
            if g is not None:
                g.abort()
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, EOFError):
            pass
    finally:
        if status:
            os._exit(status)  # no teardown: the group may be wedged
        if runner is not None:
            runner.shutdown()
        for g in (group, pp_group):
            if g is not None:
                g.destroy()
        reader.close()
