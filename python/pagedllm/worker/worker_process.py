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

import numpy as np
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


class WorkerRank:
    """One rank > 0: its groups and ModelRunner, and the step messages it runs (the "mp" worker
    process's loop and the Ray actor, executor/ray_executor.py, both drive one).

    Built by joining the groups (tensor x pipeline parallel, distributed/pipeline.py; master_addr
    the rendezvous host) and loading this rank's shard; handle(message) runs one message of
    executor/step_message.py in the order the driver sent it."""

    def __init__(self, rank: int, config, device: torch.device, backend: str, port: Optional[int],
                 shm_handle=None, master_addr: str = "127.0.0.1"):
        from pagedllm.distributed.pipeline import init_model_parallel
        from pagedllm.worker.model_runner import ModelRunner

        self.rank = rank
        self.device = device
        self.group = self.pp_group = self.runner = None
        self.group, self.pp_group = init_model_parallel(rank, config.tensor_parallel_size,
                                                        config.pipeline_parallel_size, device, backend, port=port,
                                                        shm_handle=shm_handle, master_addr=master_addr,
                                                        partition=config.pipeline_partition)
        try:
            self.runner = ModelRunner(config.model_path, config.model_config, device=device, tp_group=self.group,
                                      pp_group=self.pp_group, **config.runner_kwargs())
        except BaseException:
            self.abort()  # (the caller has no object to abort)
            raise
        self.pipelined = config.pipeline_parallel_size > 1
        self.handles = collections.deque()  # pipeline stage 0: submitted steps, collected on COLLECT

    def info(self) -> dict:
        r = self.runner
        return {"rank": self.rank, "pid": os.getpid(), "weight_bytes": r.weight_bytes, "num_blocks": r.num_blocks,
                "kv_bytes": r.num_blocks * r.bytes_per_block, "num_kv_heads": r.num_kv_heads}

    def handle(self, message) -> bool:
        """Run one message (a writable buffer); False for SHUTDOWN."""
        from pagedllm.executor.step_message import COLLECT, SHUTDOWN, decode_step, message_kind

        kind = message_kind(message)
        if kind == SHUTDOWN:
            return False
        if kind == COLLECT:
            if self.runner.pp.is_first:  # (stage 0 only: the logits' all-gather with the driver)
                step_id = int(np.frombuffer(message, dtype=np.int64, count=2)[1])
                if not self.handles or self.handles[0].step_id != step_id:
                    raise RuntimeError(f"COLLECT of step {step_id}, but this rank's oldest submitted step is "
                                       f"{self.handles[0].step_id if self.handles else None}")
                self.runner.collect_step(self.handles.popleft())
            return True
        step = decode_step(message)
        prev = None
        if step.num_placeholders:  # receives rank 0's sampled ids by broadcast
            prev = torch.empty(step.prev_num_sampled, dtype=torch.int64, device=self.device)
        if self.pipelined:
            handle = self.runner.submit_step(step, prev_sampled=prev)
            if handle is not None:
                self.handles.append(handle)
        else:
            self.runner.execute_model(step, prev_sampled=prev)
        return True

    def abort(self) -> None:
        """Release the peers from collectives this rank will not join (it failed)."""
        for g in (self.group, self.pp_group):
            if g is not None:
                g.abort()

    def close(self) -> None:
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
        for g in (self.group, self.pp_group):
            if g is not None:
                g.destroy()
        self.group = self.pp_group = None


def worker_main(rank: int, config, backend: str, port: Optional[int], shm_handle, reader, conn,
                threads: int) -> None:
    """Entry point of rank `rank` (see the module docstring). config: executor.abstract.ExecutorConfig."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()

    from pagedllm import ops
    from pagedllm.distributed.shm_broadcast import QueueClosed

    worker: Optional[WorkerRank] = None
    status = 0
    try:
        device = torch.device("cuda", rank) if config.device.type == "cuda" else torch.device("cpu")
        if device.type == "cpu":
            ops.set_cpu_threads(threads)
        conn.send(("joining", rank))
        worker = WorkerRank(rank, config, device, backend, port, shm_handle)
        conn.send(("ready", worker.info()))
        while worker.handle(reader.get()):
            pass
    except QueueClosed:
        pass
    except BaseException:  # noqa: BLE001 (reported to the driver, then the process ends)
        status = 1
        if worker is not None:
            worker.abort()
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, EOFError):
            pass
    finally:
        if status:
            os._exit(status)  # no teardown: the group may be wedged
        if worker is not None:
            worker.close()
        reader.close()
