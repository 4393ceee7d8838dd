"""MultiprocExecutor: tensor and pipeline parallelism over N = tp x pp ranks of one host
(distributed_executor_backend="mp"; pipeline stages: distributed/pipeline.py, the steps themselves:
distributed_executor.py).

Rank 0 runs in this (the driver's) process, beside the engine core, the sampler and the
detokenizer; ranks 1..N-1 run in worker processes started with torch.multiprocessing's "spawn"
(worker/worker_process.py; a script that builds an LLM at module level needs the usual
``if __name__ == "__main__":`` guard, as with vLLM). Rank 0 being in-process keeps every
single-rank feature unchanged: the sampler reads rank 0's logits where they are, async
scheduling's placeholder ids stay on rank 0's device (and reach the others by a broadcast).

Each step: the driver publishes the SchedulerOutput's flat arrays on a shared-memory message
queue (distributed/shm_broadcast.py, no pickle: executor/step_message.py), then runs rank 0's
forward pass; the workers run theirs on the same step, and the collectives inside the model pair
the ranks up. Collectives: NCCL on CUDA; on the CPU pagedllm's shared-memory communicator ("shm",
the default) or gloo (PAGEDLLM_CPU_TP_BACKEND=gloo). On the CPU each rank gets
cores // N threads (the driver's own torch thread count is restored at shutdown).

Failures: a monitor thread watches the workers. When one dies (or reports an error) the group is
aborted, which releases rank 0 from a collective that will never complete (shm: the wait raises;
gloo: the peer's socket closes; NCCL: the communicator is aborted), and the next (or current)
execute_model raises RuntimeError naming the rank, its exit code and its traceback. An error in
rank 0 (including KeyboardInterrupt) aborts the group too, so the workers exit. shutdown() (also
run at interpreter exit) stops every worker: a shutdown message, then terminate, then kill.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import weakref
from typing import Optional

import torch

from pagedllm import ops
from pagedllm.distributed.parallel_state import GroupCoordinator, default_backend, free_port
from pagedllm.distributed.pipeline import PipelineGroup
from pagedllm.distributed.shm_broadcast import MessageQueue
from pagedllm.executor.abstract import ExecutorConfig
from pagedllm.executor.distributed_executor import DistributedExecutor, is_collective_failure
from pagedllm.executor.step_message import max_step_bytes, shutdown_message
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.worker_process import stop_processes, worker_main

logger = logging.getLogger("pagedllm")

#: seconds a worker may take from spawn to "ready" (imports, loading its shard, graph capture)
STARTUP_TIMEOUT_S = float(os.environ.get("PAGEDLLM_WORKER_STARTUP_TIMEOUT", "900"))


def cpu_threads_per_rank(world_size: int) -> int:
    """Threads of each CPU rank: the cores this process may use, divided among the ranks."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def _finalize(procs: list, closing: threading.Event, queue: MessageQueue, group_box: list) -> None:
    """At garbage collection or interpreter exit without shutdown(): stop the workers, release
    the shared memory."""
    closing.set()
    queue.close()  # waiting workers see the close and exit at once
    stop_processes(procs, timeout=2.0)
    for group in group_box:
        group.destroy()


def _monitor(ref, procs: list, conns: list, closing: threading.Event) -> None:
    """The monitor thread: reads the workers' messages and notices their deaths, calling into the
    executor (held weakly, so that dropping it runs its finalizer) until it closes or is gone."""
    live = {p.sentinel: r for r, p in enumerate(procs, start=1)}
    readers = {c: r for r, c in enumerate(conns, start=1)}
    while live and not closing.is_set():
        ready = multiprocessing.connection.wait(list(live) + list(readers), timeout=0.5)
        executor = ref()
        if executor is None:
            return
        for w in ready:
            if w in readers:
                executor._receive(readers, w)
            elif w in live:
                rank = live.pop(w)
                conn = conns[rank - 1]
                while conn in readers and conn.poll():  # its last words (an error report)
                    executor._receive(readers, conn)
                executor._on_death(rank)
        del executor


class MultiprocExecutor(DistributedExecutor):
    """See the module docstring. config.tensor_parallel_size x config.pipeline_parallel_size >= 2."""

    def __init__(self, config: ExecutorConfig):
        self.config = config
        tp = config.tensor_parallel_size * config.pipeline_parallel_size  # every rank
        device = config.device
        if device.type == "cuda":
            device = torch.device("cuda", 0)
        self.device = device
        # pipeline stages talk through torch.distributed: gloo on the CPU (not the shm communicator)
        self.backend = default_backend(device) if config.pipeline_parallel_size == 1 or device.type == "cuda" else "gloo"
        self.driver_runner: Optional[ModelRunner] = None
        self.group: Optional[GroupCoordinator] = None
        self.pp_group: Optional[PipelineGroup] = None
        self._procs: list = []
        self._conns: list = []
        self._messages: dict[int, dict[str, object]] = {r: {} for r in range(1, tp)}
        self._cond = threading.Condition()
        self._dead: Optional[str] = None  # why the group stopped (a worker died, or rank 0 failed)
        self._worker_failure: Optional[str] = None  # a worker's death or error report
        self._closing = threading.Event()  # set by shutdown (and the finalizer): deaths are expected
        self._group_box: list = []  # the group, for the finalizer (which must not hold self)
        self._threads_before = None
        self.worker_info: list[dict] = []
        self._finalizer = None
        self._monitor: Optional[threading.Thread] = None
        self.queue: Optional[MessageQueue] = None
        try:
            self._start(config, tp, device)
        except BaseException as exc:
            self._raise_failure(exc, during="start-up")
        r0 = self.driver_runner
        logger.info("%d ranks: tensor_parallel_size %d x pipeline_parallel_size %d (%s, backend %s%s); rank 0 (pid %d): "
                    "weights %.3f GiB, %d KV blocks (%.2f GiB)", tp, config.tensor_parallel_size,
                    config.pipeline_parallel_size, device.type, self.backend,
                    f", {cpu_threads_per_rank(tp)} threads per rank" if device.type == "cpu" else "", os.getpid(),
                    r0.weight_bytes / 2**30, r0.num_blocks, r0.num_blocks * r0.bytes_per_block / 2**30)
        for info in self.worker_info:
            logger.info("worker rank %d (pid %d): weights %.3f GiB, %d KV blocks (%.2f GiB, %d KV heads)",
                        info["rank"], info["pid"], info["weight_bytes"] / 2**30, info["num_blocks"],
                        info["kv_bytes"] / 2**30, info["num_kv_heads"])

    def _start(self, config: ExecutorConfig, tp: int, device: torch.device) -> None:
        """Create the group's shared state, spawn the workers, build rank 0, wait for every rank's
        "ready" (on any failure __init__ shuts everything down)."""
        ctx = multiprocessing.get_context("spawn")
        port, shm_handle = None, None
        if self.backend == "shm":  # rank 0 creates the region; workers attach by name
            self.group = GroupCoordinator.init(0, tp, device, "shm")
            self._group_box.append(self.group)
            shm_handle = self.group.shm.handle()
        else:
            port = free_port()
        width = -(-config.max_model_len // config.block_size)
        # pipeline parallelism: a STEP and a COLLECT per step in flight must not wait for free slots
        self.queue = MessageQueue(tp - 1, max_step_bytes(config.max_num_batched_tokens, config.max_num_seqs, width),
                                  ctx, num_slots=max(4, 2 * config.pipeline_parallel_size + 2))
        # at garbage collection or interpreter exit without shutdown(): the workers stop (the
        # monitor thread holds this object only weakly)
        self._finalizer = weakref.finalize(self, _finalize, self._procs, self._closing, self.queue, self._group_box)
        threads = cpu_threads_per_rank(tp)
        for rank in range(1, tp):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, name=f"pagedllm-tp-rank{rank}", daemon=True,
                               args=(rank, config, self.backend, port, shm_handle, self.queue.reader(rank - 1), send,
                                     threads))
            proc.start()
            send.close()
            self._procs.append(proc)
            self._conns.append(recv)
        self._monitor = threading.Thread(target=_monitor, args=(weakref.ref(self), list(self._procs),
                                                                list(self._conns), self._closing),
                                         name="pagedllm-tp-monitor", daemon=True)
        self._monitor.start()
        if device.type == "cpu":
            self._threads_before = (torch.get_num_threads(), ops.get_num_threads())
            ops.set_cpu_threads(threads)
        if self.backend != "shm":
            self._wait_for("joining")
            self.group, self.pp_group = self._join(
                device, port, lambda: None if self._dead is None else (self._worker_failure or self._dead))
            self._group_box.extend([self.group, self.pp_group])
        self.driver_runner = ModelRunner(config.model_path, config.model_config, device=device,
                                         tp_group=self.group, pp_group=self.pp_group, **config.runner_kwargs())
        self.worker_info = [self._wait_for("ready")[r] for r in range(1, tp)]

    # ---- the monitor ----------------------------------------------------------------------
    def _on_death(self, rank: int) -> None:
        proc = self._procs[rank - 1]
        proc.join(1.0)  # reap it: its exit code
        if not self._closing.is_set():
            error = self._messages[rank].get("error")
            self._stop(f"tensor-parallel worker rank {rank} (pid {proc.pid}) stopped with exit code "
                       f"{proc.exitcode}" + (f":\n{error}" if error else ""))

    def _receive(self, conns: dict, conn) -> None:
        rank = conns[conn]
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            conns.pop(conn)
            return
        with self._cond:
            self._messages[rank][kind] = payload
            self._cond.notify_all()
        if kind == "error" and not self._closing.is_set():
            self._stop(f"tensor-parallel worker rank {rank} failed:\n{payload}")

    def _stop(self, why: str, worker: bool = True) -> None:
        """Mark the group dead (worker: a worker's failure, which explains rank 0's) and release
        every rank from its collectives."""
        with self._cond:
            if worker and self._worker_failure is None:
                self._worker_failure = why
            if self._dead is None:
                self._dead = why
                logger.error("%s", why)
            self._cond.notify_all()
        if self.group is not None:
            self.group.abort()
        if self.pp_group is not None:
            self.pp_group.abort()

    def _wait_for(self, kind: str) -> dict[int, object]:
        """Every worker's `kind` message (rank -> payload); RuntimeError when one dies first."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with self._cond:
            while True:
                if self._dead is not None:
                    raise RuntimeError(self._worker_failure or self._dead)
                if all(kind in m for m in self._messages.values()):
                    return {r: m[kind] for r, m in self._messages.items()}
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"tensor-parallel workers did not report {kind!r} within {STARTUP_TIMEOUT_S:.0f} "
                                       "s (PAGEDLLM_WORKER_STARTUP_TIMEOUT)")
                self._cond.wait(min(left, 0.5))

    def _raise_failure(self, exc: BaseException, during: str):
        """After rank 0 failed: abort the group (the workers must not wait for it), then raise.
        When rank 0's error is a collective that was aborted or lost its peer (a symptom of another
        rank), a worker's failure is the cause (given 2 s to be noticed); otherwise rank 0's own
        exception is raised unchanged (a ValueError stays one), even when a worker reported one
        first: every rank runs the same checks (e.g. the KV block count after its all-reduce), so
        a worker may report the same error a moment before rank 0 raises it; it is logged."""
        self._stop(f"tensor-parallel rank 0 failed during {during}: {type(exc).__name__}: {exc}", worker=False)
        cause = None
        if is_collective_failure(exc):
            deadline = time.monotonic() + 2.0
            with self._cond:
                while self._worker_failure is None and time.monotonic() < deadline:
                    self._cond.wait(0.1)
                cause = self._worker_failure
        if during == "start-up":
            self.shutdown()
        if cause is not None:
            raise RuntimeError(cause) from exc
        raise exc

    # ---- the executor interface -----------------------------------------------------------
    def check_health(self) -> None:
        if self._dead is not None:
            raise RuntimeError(f"the tensor-parallel engine has stopped: {self._dead}")

    def _send(self, parts, stage0_only: bool = False) -> None:
        self.queue.put(parts, alive=self.check_health)  # (one queue: every worker reads every message)

    @property
    def num_workers_alive(self) -> int:
        return sum(p.is_alive() for p in self._procs)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def shutdown(self) -> None:
        """Stop the workers (a shutdown message, then terminate / kill), free rank 0's weights and
        caches, leave the group. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._dead is None and any(p.is_alive() for p in self._procs):
            try:
                self.queue.put(shutdown_message(), alive=self.check_health)
            except Exception:  # noqa: BLE001 (a worker died meanwhile: terminate below)
                pass
        stop_processes(self._procs, timeout=10.0)
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._monitor is not None:
            self._monitor.join(2.0)
        if self.driver_runner is not None:
            self.driver_runner.shutdown()
            self.driver_runner = None
        if self.group is not None:
            self.group.destroy()
            self.group = None
        if self.pp_group is not None:
            self.pp_group.destroy()
            self.pp_group = None
        self._group_box.clear()
        if self.queue is not None:
            self.queue.close()
        for conn in self._conns:
            conn.close()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before[0])
            ops.set_num_threads(self._threads_before[1])
            self._threads_before = None
