"""Pipeline parallelism: the decoder layers split into contiguous stages (vLLM's
``pipeline_parallel_size``; the schedule is GPipe's inter-layer split, Huang et al. 2019, sec. 2).

Rank layout (vLLM's): ``tensor_parallel_size`` x ``pipeline_parallel_size`` ranks, tensor
parallelism innermost — global rank = stage * tp + tp_rank. Stage 0 holds the embedding and,
beside the scheduler and the sampler that live in the driver's process, the final norm and the
LM head; stage s runs layers pp_layer_range(L, s, P). At each stage boundary every TP rank sends
its (replicated) residual stream [T, hidden] to the same TP rank of the next stage; the last stage
sends the stream's rows to sample back to stage 0, which computes their logits. (A deliberate
change from vLLM, whose last stage owns the LM head and samples: here the sampler, its grammar
matchers, penalties and beam state stay in the driver, and the last stage sends hidden rows —
hidden/vocab of the logits' bytes.)

Transport: torch.distributed point-to-point (gloo on CPUs, NCCL on GPUs) on a world group of
every rank; each stage's tensor-parallel group is a subgroup of it (``dist.new_group``).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from pagedllm.distributed.parallel_state import GroupCoordinator

#: PAGEDLLM_PP_LAYER_PARTITION="a,b,..." gives stage i exactly the i-th count of layers (vLLM's
#: VLLM_PP_LAYER_PARTITION); the counts must sum to the model's layers
PARTITION_ENV = "PAGEDLLM_PP_LAYER_PARTITION"


def pp_partition(num_layers: int, pp_size: int) -> list[int]:
    """Layers per stage: PAGEDLLM_PP_LAYER_PARTITION when set, else an even split whose remainder
    goes to the last stages (stage 0 also runs the embedding and the LM head). ValueError when a
    stage would get no layer or the counts do not add up."""
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} is larger than the model's {num_layers} decoder layers: "
                         "every stage needs at least one")
    text = os.environ.get(PARTITION_ENV, "").strip()
    if text:
        try:
            counts = [int(c) for c in text.split(",")]
        except ValueError:
            raise ValueError(f"{PARTITION_ENV}={text!r} must be comma-separated integers") from None
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"{PARTITION_ENV}={text!r} must give {pp_size} positive counts that sum to the model's "
                             f"{num_layers} layers")
        return counts
    base, extra = divmod(num_layers, pp_size)
    return [base + (1 if s >= pp_size - extra else 0) for s in range(pp_size)]


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers [start, end) of stage pp_rank."""
    counts = pp_partition(num_layers, pp_size)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


class PipelineGroup:
    """One rank's view of the pipeline: its stage (rank) of world_size stages, its TP rank among
    tp_size, and the world group (every rank) that carries the stage-to-stage tensors and the
    world-wide agreements (the KV pool's block count). single() is one stage, no communication."""

    def __init__(self, rank: int, world_size: int, tp_rank: int, tp_size: int, device: torch.device,
                 world: Optional[GroupCoordinator] = None, partition: Optional[list[int]] = None):
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.tp_rank = int(tp_rank)
        self.tp_size = int(tp_size)
        self.device = device
        self.world = world
        #: layers per stage as the driver decided them (None: pp_partition here, from this process's
        #: environment — every rank of an "mp" group shares the driver's)
        self.partition = None if partition is None else [int(c) for c in partition]

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "PipelineGroup":
        return cls(0, 1, 0, 1, torch.device(device))

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """This stage's decoder layers [start, end) of num_layers."""
        if self.world_size == 1:
            return 0, num_layers
        counts = self.partition or pp_partition(num_layers, self.world_size)
        if len(counts) != self.world_size or sum(counts) != num_layers:
            raise ValueError(f"layer partition {counts} does not split {num_layers} layers into {self.world_size} stages")
        start = sum(counts[:self.rank])
        return start, start + counts[self.rank]

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def _peer(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    def isend(self, x: torch.Tensor, stage: int):
        """Start sending x (on this rank's device) to the same TP rank of `stage`; returns the
        work (wait() before x may change; the work holds x)."""
        import torch.distributed as dist

        return dist.isend(x.contiguous(), dst=self._peer(stage))

    def irecv(self, shape: tuple[int, ...], dtype: torch.dtype, stage: int) -> tuple[torch.Tensor, object]:
        """(buffer, work): a tensor of `shape` / `dtype` from the same TP rank of `stage`, there
        once work.wait() returns."""
        import torch.distributed as dist

        x = torch.empty(shape, dtype=dtype, device=self.device)
        return x, dist.irecv(x, src=self._peer(stage))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, stage: int) -> torch.Tensor:
        """A tensor of `shape` / `dtype` from the same TP rank of `stage` (blocks until it arrives)."""
        x, work = self.irecv(shape, dtype, stage)
        work.wait()
        return x

    def all_reduce_min(self, value: int) -> int:
        """The smallest `value` of every rank of every stage."""
        return int(value) if self.world is None else self.world.all_reduce_min(value)

    def abort(self) -> None:
        if self.world is not None:
            self.world.abort()

    def destroy(self) -> None:
        if self.world is not None:
            self.world.destroy()
            self.world = None


def init_model_parallel(rank: int, tp_size: int, pp_size: int, device: torch.device, backend: str, *,
                        port: Optional[int] = None, shm_handle: Optional[tuple[str, int]] = None,
                        timeout_s: float = 600.0, master_addr: str = "127.0.0.1",
                        partition: Optional[list[int]] = None) -> tuple[GroupCoordinator, PipelineGroup]:
    """This process's tensor-parallel group and pipeline view, as global rank `rank` of
    tp_size x pp_size. pp_size 1: GroupCoordinator.init (any backend) and a one-stage pipeline.
    pp_size > 1: torch.distributed's world group ("nccl" on CUDA, "gloo" on the CPU: `backend`
    must be one of those) through master_addr:port (rank 0's host), and each stage's TP group as
    a subgroup. partition: the layers per stage (the driver's pp_partition, carried to every rank)."""
    if pp_size == 1:
        return (GroupCoordinator.init(rank, tp_size, device, backend, port=port, shm_handle=shm_handle,
                                      timeout_s=timeout_s, master_addr=master_addr), PipelineGroup.single(device))
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"pipeline parallelism runs on torch.distributed: backend {backend!r} must be 'nccl' or 'gloo'")
    import torch.distributed as dist

    world = GroupCoordinator.init(rank, tp_size * pp_size, device, backend, port=port, timeout_s=timeout_s,
                                  master_addr=master_addr)  # torch.distributed's default (world) group
    stage, tp_rank = divmod(rank, tp_size)
    tp_group = GroupCoordinator.single(device)
    if tp_size > 1:
        for s in range(pp_size):  # every rank creates every subgroup, in the same order
            ranks = [s * tp_size + i for i in range(tp_size)]
            group = dist.new_group(ranks, backend=backend)
            if s == stage:
                tp_group = GroupCoordinator(tp_rank, tp_size, device, backend, process_group=group, ranks=ranks)
    return tp_group, PipelineGroup(stage, pp_size, tp_rank, tp_size, device, world, partition)
