"""Process groups and collectives for tensor parallelism (parallel_state.GroupCoordinator), the CPU
shared-memory communicator and the shared-memory message queue that hands each step to the
worker processes (shm_broadcast.MessageQueue)."""

from pagedllm.distributed.parallel_state import GroupCoordinator, default_backend

__all__ = ["GroupCoordinator", "default_backend"]
