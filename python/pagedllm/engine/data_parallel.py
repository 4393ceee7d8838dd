"""Data parallelism: D independent engine replicas behind one front end (vLLM's
``--data-parallel-size``).

``DPAsyncLLM`` has AsyncLLM's interface (what the OpenAI server uses) over D AsyncLLMs, each with
its own engine process, KV pool and model copy (on CUDA tensor_parallel_size x
pipeline_parallel_size GPUs each, the process and its workers seeing only those:
CUDA_VISIBLE_DEVICES). A request goes
to the live replica with the fewest requests in flight as this front end counts them (accepted and
not finished, plus those being accepted: running + waiting), the lowest index on ties, and stays
there; aborts go to every live replica (an unknown id is a no-op). Metrics are each replica's with
the label ``engine`` = its index (vLLM's label for data-parallel ranks).

Failure: a replica whose process dies fails its own requests (EngineDeadError) and takes no new
ones; the others keep serving. ``is_running`` is True while any replica runs (the server keeps
serving), ``is_healthy`` only while all do (the server's /health answers 503 otherwise). A dead
replica's last metrics stay exported (its gauges frozen). On a CPU the replicas share the cores,
each with the server's thread count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
from typing import Any, AsyncGenerator, Optional, Union

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.engine.llm_engine import EngineArgs
from pagedllm.metrics import Metric
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


def replica_args(engine_args: EngineArgs) -> EngineArgs:
    """A replica's EngineArgs: the same with data_parallel_size 1."""
    return dataclasses.replace(engine_args, data_parallel_size=1)


@contextlib.contextmanager
def replica_device(engine_args: EngineArgs, index: int):
    """While replica `index`'s engine process starts on a CUDA machine: CUDA_VISIBLE_DEVICES = its
    n = tensor_parallel_size x pipeline_parallel_size visible GPUs, [index * n, (index + 1) * n),
    so the process sees its first GPU as the current one and its worker ranks (spawned from it,
    cuda:rank) the others, as vLLM's data-parallel ranks do (the native kernels use the current
    device). A no-op without a GPU."""
    import torch

    if str(engine_args.device) not in ("auto", "cuda") or not torch.cuda.is_available():
        yield
        return
    n = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = saved.split(",") if saved else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[index * n:(index + 1) * n])
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def check_data_parallel(engine_args: EngineArgs) -> int:
    """data_parallel_size as an int >= 1 (ValueError naming the value otherwise, or when the
    replicas need more GPUs than the machine has); checked before any replica starts."""
    d = engine_args.data_parallel_size
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ValueError(f"data_parallel_size must be an int >= 1, got {d!r}")
    if d > 1 and str(engine_args.device).startswith("cuda:"):
        raise ValueError(f"data_parallel_size={d} with device={engine_args.device!r}: the replicas take one GPU "
                         "each; use device 'cuda' or 'auto'")
    if d > 1 and str(engine_args.device) in ("auto", "cuda"):
        import torch

        if torch.cuda.is_available():
            tp, pp = engine_args.tensor_parallel_size, engine_args.pipeline_parallel_size
            if tp * pp > 1 and engine_args.distributed_executor_backend == "ray":
                raise ValueError(f"data_parallel_size={d} with distributed_executor_backend='ray' on GPUs is not "
                                 "supported (Ray places each replica's ranks itself): use 'mp'")
            if d * tp * pp > torch.cuda.device_count():
                raise ValueError(f"data_parallel_size={d} x tensor_parallel_size={tp} x pipeline_parallel_size={pp} "
                                 f"needs {d * tp * pp} GPUs, but {torch.cuda.device_count()} are visible")
    return d


class DPAsyncLLM:
    """D AsyncLLM replicas behind one front end (module docstring). Construct with the engine's
    arguments (data_parallel_size = D >= 2); keyword arguments go to each AsyncLLM."""

    def __init__(self, engine_args: EngineArgs, **kwargs: Any):
        d = check_data_parallel(engine_args)
        kwargs.setdefault("multiprocess", True)  # a process per replica (its GPU: CUDA_VISIBLE_DEVICES)
        if not kwargs["multiprocess"]:
            raise ValueError("data_parallel_size > 1 runs each replica in its own process (multiprocess=True)")
        self.replicas: list[AsyncLLM] = []
        try:
            for i in range(d):
                with replica_device(engine_args, i):
                    self.replicas.append(AsyncLLM(replica_args(engine_args), **kwargs))
                logger.info("data parallel: replica %d of %d is up", i, d)
        except BaseException:
            self.shutdown()
            raise
        first = self.replicas[0]
        self._args = engine_args
        self.tokenizer = first.tokenizer
        self.model_config = first.model_config
        self.max_model_len = first.max_model_len
        self.info = first.info
        self.shared_engine = False
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> "DPAsyncLLM":
        return cls(engine_args, **kwargs)

    # ------------------------------------------------------------------ state
    @property
    def is_running(self) -> bool:
        return any(r.is_running for r in self.replicas)

    @property
    def is_healthy(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def model_name(self) -> str:
        return self.replicas[0].model_name

    def set_model_name(self, name: str) -> None:
        for r in self._live():
            r.set_model_name(name)

    @property
    def engine_args(self) -> EngineArgs:
        return self._args

    @property
    def generation_defaults(self) -> dict:
        return self.replicas[0].generation_defaults

    @property
    def model_path(self):
        return self.replicas[0].model_path

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.replicas[0].get_default_sampling_params()

    def new_request_id(self) -> str:
        return str(next(self._ids))

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self._live())

    def load(self) -> list[int]:
        """Requests in flight per replica (accepted and not finished, or being accepted); -1: dead."""
        return [len(r._requests) + len(r._pending) if r.is_running else -1 for r in self.replicas]

    # ------------------------------------------------------------------ requests
    def _live(self) -> list[AsyncLLM]:
        return [r for r in self.replicas if r.is_running]

    def _pick(self) -> AsyncLLM:
        load = self.load()
        live = [i for i, n in enumerate(load) if n >= 0]
        if not live:
            raise EngineDeadError("every data-parallel replica has stopped")
        return self.replicas[min(live, key=lambda i: (load[i], i))]

    def _check_unused(self, request_id: str) -> None:
        for r in self._live():
            with r._lock:  # (the events thread moves ids from _pending to _requests under it)
                if request_id in r._requests or request_id in r._pending:
                    raise ValueError(f"request id {request_id!r} is already in use")

    async def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                          params: SamplingParams, priority: int = 0, cache_salt: str = ""):
        """AsyncLLM.add_request on the least-loaded live replica (another one if that one dies
        before accepting it)."""
        self._check_unused(request_id)
        while True:
            replica = self._pick()
            try:
                return await replica.add_request(request_id, prompt, prompt_token_ids, params, priority, cache_salt)
            except EngineDeadError:
                if replica.is_running or not self._live():
                    raise

    async def generate(self, prompt: Union[str, dict], sampling_params: SamplingParams, request_id: str,
                       priority: int = 0, cache_salt: str = "") -> AsyncGenerator:
        """AsyncLLM.generate on the least-loaded live replica."""
        self._check_unused(request_id)
        async for out in self._pick().generate(prompt, sampling_params, request_id, priority, cache_salt):
            yield out

    async def abort(self, request_id: Union[str, list[str]]) -> None:
        for r in self._live():
            await r.abort(request_id)

    async def abort_all(self) -> None:
        for r in self._live():
            await r.abort_all()

    # ------------------------------------------------------------------ metrics, lifecycle
    def get_metrics(self) -> list[Metric]:
        """Every replica's metrics (a dead one's last snapshot) with the label engine = its index."""
        out = []
        for i, r in enumerate(self.replicas):
            for m in r.get_metrics():
                out.append(dataclasses.replace(m, labels={**m.labels, "engine": str(i)}))
        return out

    async def refresh_metrics(self, max_age: float = 0.0) -> None:
        for r in self._live():
            await r.refresh_metrics(max_age)

    async def check_health(self) -> None:
        for i, r in enumerate(self.replicas):
            if not r.is_running:
                raise EngineDeadError(f"data-parallel replica {i} has stopped")

    def shutdown(self, timeout: float = 30.0) -> None:
        errors = []
        for r in self.replicas:  # every replica, whatever one of them raises
            try:
                r.shutdown(timeout)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            raise errors[0]


__all__ = ["DPAsyncLLM", "check_data_parallel", "replica_args", "replica_device"]
