"""The tensor-parallel group of one rank (vLLM's GroupCoordinator) and how it is set up.

A model is built with a GroupCoordinator and passes it to its parallel layers (no global state):
``all_reduce`` after a RowParallelLinear and the vocabulary-parallel embedding, ``all_gather`` of
the vocabulary-parallel logits, ``broadcast`` of the previous step's sampled ids (async
scheduling), ``all_reduce_min`` to agree on the number of KV blocks. World size 1 (the default,
``GroupCoordinator.single()``) makes every collective a no-op without torch.distributed.

Backends (``backend``):
  "nccl"  CUDA tensors through torch.distributed (NCCL); the collectives are captured by CUDA graphs.
  "gloo"  CPU tensors through torch.distributed (gloo over TCP on 127.0.0.1).
  "shm"   CPU tensors through pagedllm's shared-memory communicator (cpu_shm_communicator.py), no
          torch.distributed at all; the CPU default: gloo's all-reduce of a decode step's hidden
          rows measured 2.5-12 ms on the 2-core dev VM against microseconds here (bench/tp_comm.py).
Every rank sees the same bits after an all-reduce with "shm" (sums in rank order) and "nccl"
(NCCL's reductions are deterministic for a fixed communicator); with gloo as well.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Optional

import torch

#: torch.distributed backends pagedllm's tensor parallelism uses, per device type
BACKENDS = {"cuda": ("nccl",), "cpu": ("shm", "gloo")}


def default_backend(device: torch.device) -> str:
    """"nccl" on CUDA; on the CPU "shm", or PAGEDLLM_CPU_TP_BACKEND ("gloo" or "shm")."""
    if device.type == "cuda":
        return "nccl"
    backend = os.environ.get("PAGEDLLM_CPU_TP_BACKEND", "shm")
    if backend not in BACKENDS["cpu"]:
        raise ValueError(f"PAGEDLLM_CPU_TP_BACKEND={backend!r} is not supported: use one of {list(BACKENDS['cpu'])}")
    return backend


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for torch.distributed's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GroupCoordinator:
    """One rank's view of a group of `world_size` ranks (tensor parallelism on one host).

    rank / world_size: this rank and the group size; device: where this rank computes.
    Build with single() (world 1), or init() in every rank's process (or, for a pipeline
    stage's group, distributed/pipeline.py's init_model_parallel: a torch.distributed subgroup
    whose members have the global ranks `ranks`).
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, backend: str = "none",
                 shm=None, process_group=None, ranks: Optional[list[int]] = None):
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.device = device
        self.backend = backend
        self.shm = shm  # CpuShmCommunicator ("shm")
        self.process_group = process_group  # torch.distributed group ("nccl", "gloo")
        #: global ranks of a subgroup's members (None: the group is the whole world)
        self.ranks = ranks

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "GroupCoordinator":
        return cls(0, 1, torch.device(device))

    @classmethod
    def init(cls, rank: int, world_size: int, device: torch.device, backend: str, *,
             port: Optional[int] = None, shm_handle: Optional[tuple[str, int]] = None,
             timeout_s: float = 600.0, master_addr: str = "127.0.0.1") -> "GroupCoordinator":
        """This process's rank of a new group. "shm": rank 0 creates the region (shm_handle None),
        the others attach to rank 0's handle(); "nccl" / "gloo": torch.distributed's default group
        through a TCP rendezvous on master_addr:port (rank 0's host) (every rank blocks until all have joined, at
        most timeout_s). ValueError for a backend that does not suit the device."""
        if backend not in BACKENDS.get(device.type, ()):
            raise ValueError(f"tensor-parallel backend {backend!r} does not run on {device.type}: use one of "
                             f"{list(BACKENDS.get(device.type, ()))}")
        if backend == "shm":
            from pagedllm.distributed.cpu_shm_communicator import CpuShmCommunicator

            name, buffer_bytes = shm_handle if shm_handle is not None else (None, None)
            kwargs = {} if buffer_bytes is None else {"buffer_bytes": buffer_bytes}
            return cls(rank, world_size, device, backend, shm=CpuShmCommunicator(rank, world_size, name, **kwargs))
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process; pagedllm's tensor "
                               "parallelism starts its own group (shut the other one down first)")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
        return cls(rank, world_size, device, backend, process_group=dist.group.WORLD)

    # ---- collectives ----------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (x contiguous on this rank's device); returns x. (An
        empty x is empty on every rank — the shapes agree — so no rank communicates.)"""
        if self.world_size == 1 or x.numel() == 0:
            return x
        if self.shm is not None:
            return self.shm.all_reduce(x)
        import torch.distributed as dist

        dist.all_reduce(x, group=self.process_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along `dim`, in rank order (same shape on every rank)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if x.numel() == 0:
            shape = list(x.shape)
            shape[dim % x.dim()] *= self.world_size
            return x.new_empty(shape)
        if self.shm is not None:
            stacked = self.shm.all_gather(x)
        else:
            import torch.distributed as dist

            flat = torch.empty(self.world_size * x.numel(), dtype=x.dtype, device=x.device)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.13
            gather(flat, x.view(-1), group=self.process_group)
            stacked = flat.view(self.world_size, *x.shape)
        dim = dim % x.dim()
        # [world, ..., d, ...] -> [..., world * d, ...]
        return stacked.movedim(0, dim).reshape(*x.shape[:dim], self.world_size * x.shape[dim], *x.shape[dim + 1:])

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x of rank `src` into x on every rank (same shape and dtype everywhere); returns x."""
        if self.world_size == 1:
            return x
        if self.shm is not None:
            x.copy_(self.shm.all_gather(x)[src])
            return x
        import torch.distributed as dist

        dist.broadcast(x, src=src if self.ranks is None else self.ranks[src], group=self.process_group)
        return x

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's integer `value`."""
        if self.world_size == 1:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device if self.shm is None else "cpu")
        if self.shm is not None:
            return int(self.shm.all_gather(t).min())
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.process_group)
        return int(t.item())

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        if self.shm is not None:
            self.shm.barrier()
            return
        import torch.distributed as dist

        dist.barrier(group=self.process_group)

    # ---- lifecycle ------------------------------------------------------------------------
    def abort(self) -> None:
        """Release the other ranks from a collective that will never complete (a rank died):
        their shm collectives raise RuntimeError; an NCCL communicator is aborted."""
        if self.shm is not None:
            self.shm.abort()
        elif self.backend == "nccl" and self.process_group is not None:
            try:
                import torch.distributed as dist

                dist.distributed_c10d._abort_process_group(self.process_group)  # noqa: SLF001
            except Exception:  # noqa: BLE001 (best effort: the process is being torn down)
                pass

    def destroy(self) -> None:
        """Leave the group (rank 0 unlinks the shared-memory region; the world group's owner ends
        torch.distributed, a subgroup goes with it)."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.process_group is not None:
            import torch.distributed as dist

            if self.ranks is None and dist.is_initialized():
                dist.destroy_process_group()
            self.process_group = None
