"""The CPU tensor-parallel communicator: pagedllm._C.ShmCommunicator (cpp/include/pagedllm/
cpu_comm.h) over a POSIX shared-memory region (multiprocessing.shared_memory), created by rank 0
and attached by name by the other ranks of the host.

All-reduce and all-gather of torch CPU tensors (float32 / bfloat16 for the sum; any dtype for the
gather); every rank gets the same bits. Measured against gloo in bench/tp_comm.py. ``abort()``
makes every rank's current and later collective raise RuntimeError: how a rank that died
releases the others.
"""

from __future__ import annotations

from multiprocessing import shared_memory
from typing import Optional

import numpy as np
import torch

from pagedllm import _C
from pagedllm.ops import _view

#: Bytes each rank stages per round (two buffers per rank): a decode step's hidden rows fit one
#: round; a prefill chunk of 8192 x 4096 bfloat16 takes 32.
DEFAULT_BUFFER_BYTES = 2 << 20


def attach_shared_memory(name: Optional[str], size: int) -> shared_memory.SharedMemory:
    """A new region of `size` bytes (name None) or the existing region `name`. Processes started by
    multiprocessing share their parent's resource tracker, which holds each name once: the
    creator's unlink() is the one that removes it (and a crashed creator's tracker removes it)."""
    if name is None:
        return shared_memory.SharedMemory(create=True, size=size)
    return shared_memory.SharedMemory(name=name)


class CpuShmCommunicator:
    """One rank's end. Rank 0 creates the region (``name=None``), the others attach to
    ``handle()``'s name. Keep the object alive while the communicator is used; ``close()``
    unmaps (and rank 0 unlinks) it."""

    def __init__(self, rank: int, world_size: int, name: Optional[str] = None,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES):
        size = int(_C.ShmCommunicator.region_bytes(world_size, buffer_bytes))
        self.owner = name is None
        self._shm = attach_shared_memory(name, size)
        if self.owner:  # a fresh region must be zero (ftruncate gives zeros; be explicit)
            np.frombuffer(self._shm.buf, dtype=np.uint8)[:] = 0
        self._array = np.frombuffer(self._shm.buf, dtype=np.uint8)
        self.rank, self.world_size, self.buffer_bytes = rank, world_size, buffer_bytes
        self._comm = _C.ShmCommunicator(self._array.ctypes.data, size, rank, world_size, buffer_bytes)

    def handle(self) -> tuple[str, int]:
        """(region name, buffer_bytes): what another rank passes to attach."""
        return self._shm.name, self.buffer_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks into x (contiguous CPU float32 / bfloat16), in place; returns x."""
        self._comm.all_reduce(_view(x))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world_size, *x.shape]: every rank's x (contiguous CPU tensor), in rank order."""
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype)
        self._comm.all_gather(_view(out), _view(x.contiguous()))
        return out

    def barrier(self) -> None:
        self._comm.barrier()

    def abort(self) -> None:
        self._comm.abort()

    @property
    def aborted(self) -> bool:
        return bool(self._comm.aborted)

    def close(self) -> None:
        if getattr(self, "_shm", None) is None:
            return
        self._comm = None
        self._array = None  # the last export of the mapping: it can close now
        self._shm.close()
        if self.owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
        self._shm = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass
