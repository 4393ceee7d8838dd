"""What the executors of several ranks share ("mp": multiproc_executor.py, "ray": ray_executor.py):
rank 0 runs in this process, the others receive each step as a message (executor/step_message.py)
and run it in the same order.

A subclass provides _send(parts, stage0_only) (the message to the other ranks) and
_raise_failure(exc, during) (abort, find the cause, raise); this class runs the steps:

    execute_model(sched)        one step: the message, then rank 0's forward pass
    submit(sched) / collect(h)  pipeline parallelism: stage 0's part now, its logits later (a
                                COLLECT message first, so that stage 0's other TP ranks collect too)
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from pagedllm.distributed.pipeline import init_model_parallel

from pagedllm.executor.abstract import Executor
from pagedllm.executor.step_message import collect_message, encode_step
from pagedllm.worker.model_runner import ModelRunnerOutput


def is_collective_failure(exc: BaseException) -> bool:
    """Whether rank 0's exception is a collective that was aborted or lost a peer (shm: aborted;
    gloo: a closed connection; NCCL: an aborted communicator), i.e. a symptom of another rank."""
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(k in text for k in ("aborted", "connection closed", "connection reset", "broken pipe", "nccl",
                                   "gloo", "the tensor-parallel engine has stopped"))


class DistributedExecutor(Executor):
    """Steps over tensor x pipeline parallel ranks (module docstring); config: ExecutorConfig."""

    def _send(self, parts, stage0_only: bool = False) -> None:
        """Hand one message (numpy parts) to the other ranks (stage0_only: those of stage 0 need it)."""
        raise NotImplementedError

    def _raise_failure(self, exc: BaseException, during: str):
        raise NotImplementedError

    def _join(self, device: torch.device, port: int, failed: Callable[[], Optional[str]],
              master_addr: str = "127.0.0.1"):
        """Rank 0's side of the torch.distributed rendezvous -> (tp group, pipeline group), run in a
        thread so that a rank failing before it joins (which would leave the rendezvous waiting for
        its timeout) is raised at once: failed() returns that rank's failure, else None."""
        config, box = self.config, {}

        def join() -> None:
            try:
                box["groups"] = init_model_parallel(0, config.tensor_parallel_size, config.pipeline_parallel_size,
                                                    device, self.backend, port=port, master_addr=master_addr,
                                                    partition=config.pipeline_partition)
            except BaseException as exc:  # noqa: BLE001 (re-raised below)
                box["error"] = exc

        thread = threading.Thread(target=join, name="pagedllm-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            failure = failed() if thread.is_alive() else None
            if failure is not None:
                raise RuntimeError(failure)
        if "error" in box:
            raise box["error"]
        return box["groups"]

    def execute_model(self, sched, greedy_vocab: int = 0,
                      prev_sampled: Optional[torch.Tensor] = None) -> ModelRunnerOutput:
        if self.config.pipeline_parallel_size > 1:
            return self.collect(self.submit(sched, prev_sampled))
        self.check_health()
        prev_n = int(prev_sampled.shape[0]) if sched.num_placeholders and prev_sampled is not None else 0
        self._send(encode_step(sched, prev_n))
        try:
            return self.driver_runner.execute_model(sched, greedy_vocab=0, prev_sampled=prev_sampled)
        except BaseException as exc:
            self._raise_failure(exc, during=f"step {sched.step_id}")

    def submit(self, sched, prev_sampled: Optional[torch.Tensor] = None):
        if self.config.pipeline_parallel_size == 1:
            return self.execute_model(sched, prev_sampled=prev_sampled)
        self.check_health()
        prev_n = int(prev_sampled.shape[0]) if sched.num_placeholders and prev_sampled is not None else 0
        self._send(encode_step(sched, prev_n))
        try:
            return self.driver_runner.submit_step(sched, prev_sampled=prev_sampled)
        except BaseException as exc:
            self._raise_failure(exc, during=f"step {sched.step_id}")

    def collect(self, handle) -> ModelRunnerOutput:
        if self.config.pipeline_parallel_size == 1:
            return handle
        self.check_health()
        if handle is not None and self.config.tensor_parallel_size > 1:  # stage 0's other ranks collect too
            self._send(collect_message(handle.step_id), stage0_only=True)
        try:
            return self.driver_runner.collect_step(handle)
        except BaseException as exc:
            self._raise_failure(exc, during="step " + ("?" if handle is None else str(handle.step_id)))

    @property
    def pipeline_depth(self) -> int:
        return self.config.pipeline_parallel_size

    def argmax_applies(self, num_sampled: int) -> bool:
        return False  # the LM head's logits are split across ranks (or made on stage 0 after the others)
