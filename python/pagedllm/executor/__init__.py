"""Executors: run each step's forward pass on one device (UniprocExecutor) or on the ranks of a
tensor- and/or pipeline-parallel group: worker processes of this host (MultiprocExecutor, "mp") or
Ray actors on a cluster's hosts (RayExecutor, "ray"); see abstract.py."""

from __future__ import annotations

from pagedllm.executor.abstract import Executor, ExecutorConfig

#: distributed_executor_backend values (vLLM's names) pagedllm runs
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


def make_executor(config: ExecutorConfig) -> Executor:
    """The executor for config.tensor_parallel_size x config.pipeline_parallel_size ranks and
    config.distributed_executor_backend (None: "uni" for one rank, "mp" for more). ValueError for
    a backend it cannot run."""
    backend = config.distributed_executor_backend
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    if backend is None:
        backend = "uni" if ranks == 1 else "mp"
    if backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend={backend!r} is not supported: use one of "
                         f"{list(EXECUTOR_BACKENDS)} (None picks 'uni' for one rank, 'mp' for more)")
    if backend == "uni" or ranks == 1:  # "mp" / "ray" with one rank: rank 0 runs in this process anyway
        if ranks != 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size="
                             f"{config.tensor_parallel_size} x pipeline_parallel_size={config.pipeline_parallel_size} "
                             "needs more: use 'mp'")
        from pagedllm.executor.uniproc_executor import UniprocExecutor

        return UniprocExecutor(config)
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from pagedllm.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config)


__all__ = ["EXECUTOR_BACKENDS", "Executor", "ExecutorConfig", "make_executor"]
