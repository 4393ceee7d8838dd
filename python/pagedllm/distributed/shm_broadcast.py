"""A single-writer, many-reader queue of byte messages in shared memory (vLLM's shm_broadcast
MessageQueue): how each step's flat arrays reach the tensor-parallel worker processes with one
memcpy in and one out, no pickle and no socket.

Region (POSIX shared memory, created by the writer, attached by name by the readers):
    line 0                        int64 closed flag
    lines 1 .. num_slots          per slot: int64 seq (the message it holds), int64 nbytes
    next num_readers lines        per reader: int64 the last seq it finished copying out
    then num_slots areas of slot_bytes bytes
Writer, message seq (1, 2, ...): waits until every reader has acked seq - num_slots (its slot is
free), copies the parts back to back into slot seq % num_slots, stores nbytes, then seq (a reader
trusts the data once it sees the seq), then releases each reader's semaphore. A message longer
than slot_bytes goes through each reader's pipe instead (nbytes = -1 in the slot), sent after the
seq is published (a reader drains its pipe once it saw the message, so a payload larger than the
pipe's buffer cannot block the writer for good).
Reader: polls its next slot's seq for up to spin_s seconds (a step follows the last within
microseconds under load), then blocks on its semaphore (idle engines burn no core); copies the
message out into a bytearray it owns and acks.

Stores are ordered by the program order of one thread and x86's TSO; a lock acquire/release
between the data and the flag (a full barrier in CPython's C code) orders them elsewhere too.
"""

from __future__ import annotations

import threading
import time
from multiprocessing import shared_memory
from typing import Callable, Optional, Sequence

import numpy as np

from pagedllm.distributed.cpu_shm_communicator import attach_shared_memory

_LINE = 64
_fence_lock = threading.Lock()


def _fence() -> None:
    with _fence_lock:
        pass


class QueueClosed(RuntimeError):
    """The writer closed the queue (or a reader's wait was abandoned)."""


class MessageQueue:
    """Writer end: MessageQueue(num_readers, slot_bytes, ctx) in the driver; readers: the object
    returned by reader(i) passed to worker i's process (picklable under spawn)."""

    def __init__(self, num_readers: int, slot_bytes: int, ctx, num_slots: int = 4):
        self.num_readers, self.slot_bytes, self.num_slots = int(num_readers), int(slot_bytes), int(num_slots)
        self._shm = attach_shared_memory(None, _region_bytes(num_readers, slot_bytes, num_slots))
        self._layout()
        self._words[:] = 0
        self._sems = [ctx.Semaphore(0) for _ in range(num_readers)]
        pipes = [ctx.Pipe(duplex=False) for _ in range(num_readers)]
        self._pipe_out = [w for _, w in pipes]
        self._pipe_in = [r for r, _ in pipes]
        self._seq = 0

    def _layout(self) -> None:
        header_words = (1 + self.num_slots + self.num_readers) * (_LINE // 8)
        self._words = np.frombuffer(self._shm.buf, dtype=np.int64, count=header_words)
        self._data = np.frombuffer(self._shm.buf, dtype=np.uint8, offset=header_words * 8)

    def _slot_seq(self, slot: int) -> int:
        return 8 * (1 + slot)

    def _ack(self, reader: int) -> int:
        return 8 * (1 + self.num_slots + reader)

    def reader(self, index: int) -> "MessageQueueReader":
        return MessageQueueReader(self._shm.name, self.num_readers, self.slot_bytes, self.num_slots, index,
                                  self._sems[index], self._pipe_in[index])

    def put(self, parts: Sequence[np.ndarray], alive: Optional[Callable[[], None]] = None) -> None:
        """Publish one message: the parts' bytes back to back. alive(): raises when a reader died
        (checked while waiting for a free slot)."""
        nbytes = sum(p.nbytes for p in parts)
        seq = self._seq + 1
        slot = seq % self.num_slots
        acks = [self._ack(r) for r in range(self.num_readers)]
        waited = 0
        while min(int(self._words[a]) for a in acks) < seq - self.num_slots:
            waited += 1
            if alive is not None and waited % 64 == 0:
                alive()
            time.sleep(0 if waited < 1000 else 1e-4)
        w = self._slot_seq(slot)
        overflow = nbytes > self.slot_bytes
        if not overflow:
            base = slot * self.slot_bytes
            offset = 0
            for p in parts:
                raw = np.ascontiguousarray(p).view(np.uint8).reshape(-1)
                self._data[base + offset: base + offset + raw.size] = raw
                offset += raw.size
        self._words[w + 1] = -1 if overflow else nbytes
        _fence()
        self._words[w] = seq
        self._seq = seq
        for sem in self._sems:
            sem.release()
        if overflow:  # after the seq: a reader takes the pipe's bytes only once it saw the message
            payload = b"".join(np.ascontiguousarray(p).tobytes() for p in parts)
            for out in self._pipe_out:
                out.send_bytes(payload)

    def close(self) -> None:
        """Mark the queue closed (readers' get() raises QueueClosed) and unlink the region."""
        if self._shm is None:
            return
        self._words[0] = 1
        for sem in self._sems:
            sem.release()
        self._words = self._data = None
        self._shm.close()
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        self._shm = None


class MessageQueueReader:
    """One reader's end (see MessageQueue). spin_s: how long get() polls before it blocks."""

    def __init__(self, name: str, num_readers: int, slot_bytes: int, num_slots: int, index: int, sem, pipe_in,
                 spin_s: float = 2e-3):
        self.name, self.num_readers, self.slot_bytes, self.num_slots = name, num_readers, slot_bytes, num_slots
        self.index, self.spin_s = index, spin_s
        self._sem, self._pipe_in = sem, pipe_in
        self._shm: Optional[shared_memory.SharedMemory] = None
        self._seq = 0

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_shm"] = None
        return state

    def _attach(self) -> None:
        self._shm = attach_shared_memory(self.name, 0)
        MessageQueue._layout(self)  # type: ignore[arg-type]

    def get(self) -> bytearray:
        """The next message (a copy this reader owns). Raises QueueClosed once the writer closed."""
        if self._shm is None:
            self._attach()
        seq = self._seq + 1
        slot = seq % self.num_slots
        w = 8 * (1 + slot)
        deadline = time.perf_counter() + self.spin_s
        token = False  # this message's semaphore token (the writer releases one per message)
        while int(self._words[w]) != seq:
            if self._words[0]:
                raise QueueClosed("the message queue was closed")
            if not token and time.perf_counter() > deadline:
                token = self._sem.acquire(timeout=0.5)  # block instead of spinning
        if not token:
            self._sem.acquire()  # released right after the seq was stored: at once
        _fence()
        nbytes = int(self._words[w + 1])
        if nbytes < 0:
            message = bytearray(self._pipe_in.recv_bytes())
        else:
            base = slot * self.slot_bytes
            message = bytearray(self._data[base: base + nbytes])
        self._words[8 * (1 + self.num_slots + self.index)] = seq
        self._seq = seq
        return message

    def close(self) -> None:
        if self._shm is not None:
            self._words = self._data = None
            self._shm.close()
            self._shm = None


def _region_bytes(num_readers: int, slot_bytes: int, num_slots: int) -> int:
    return (1 + num_slots + num_readers) * _LINE + num_slots * slot_bytes
