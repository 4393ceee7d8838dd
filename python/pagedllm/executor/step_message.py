"""One scheduler step as flat bytes, for the tensor-parallel workers (executor/multiproc_executor.py).

encode_step(sched, prev_num_sampled) turns a SchedulerOutput into parts (numpy arrays) for
MessageQueue.put; decode_step(message) turns the received bytes back into a StepView, which has the
SchedulerOutput attributes ModelRunner.execute_model and the decode graphs read (numpy views
into the message). Layout (T tokens, S sequences, W block-table width, R sampled rows, C copies,
P prompt-logprob row ranges), int64 fields first so every array is aligned:

    header           int64 [16]  KIND, step_id, T, S, R, max_query_len, num_placeholders,
                                 prev_num_sampled, W, C, P, U (rest 0)
    positions        int64 [T]
    slot_mapping     int64 [T]
    logits_indices   int64 [R]
    copy_orders      int64 [C, 2]
    input_ids        int32 [T]
    prev_sample_rows int32 [T]
    seq_lens         int32 [S]
    query_start_loc  int32 [S + 1]
    block_tables     int32 [S, U]  the first U = SchedulerOutput.max_row_blocks columns (every later
                                   column is 0: rebuilt as zeros, so a long max_model_len costs
                                   nothing until sequences are long)
    prompt_rows      int32 [P, 3]  (first_row, num_rows, first_position); request ids stay in the driver

A shutdown is a header alone with KIND = SHUTDOWN. Under pipeline parallelism a COLLECT header
(KIND = COLLECT, step_id) tells stage 0's ranks to finish their oldest submitted step (the last
stage's rows -> the vocabulary-parallel logits), in the driver's order.
"""

from __future__ import annotations

import dataclasses

import numpy as np

STEP, SHUTDOWN, COLLECT = 1, 2, 3
_HEADER = 16


@dataclasses.dataclass
class StepView:
    """The parts of a SchedulerOutput a model runner reads (see the module docstring)."""

    step_id: int
    num_tokens: int
    num_seqs: int
    num_sampled: int
    max_query_len: int
    num_placeholders: int
    prev_num_sampled: int
    positions: np.ndarray
    slot_mapping: np.ndarray
    logits_indices: np.ndarray
    copy_orders: np.ndarray
    input_ids: np.ndarray
    prev_sample_rows: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    block_tables: np.ndarray
    prompt_logprob_rows: list


def shutdown_message() -> list[np.ndarray]:
    header = np.zeros(_HEADER, dtype=np.int64)
    header[0] = SHUTDOWN
    return [header]


def collect_message(step_id: int) -> list[np.ndarray]:
    header = np.zeros(_HEADER, dtype=np.int64)
    header[0], header[1] = COLLECT, int(step_id)
    return [header]


def encode_step(sched, prev_num_sampled: int = 0) -> list[np.ndarray]:
    """Parts of the message of SchedulerOutput `sched` (prev_num_sampled: rows of the previous
    step's sampled ids the placeholders read, 0 without placeholders)."""
    T, S, R = int(sched.num_tokens), int(sched.num_seqs), int(sched.num_sampled)
    tables = np.asarray(sched.block_tables)
    copies = np.asarray(sched.copy_orders, dtype=np.int64).reshape(-1, 2)
    prompt = [(int(first_row), int(num_rows), int(first_position))
              for _, first_row, num_rows, first_position in (getattr(sched, "prompt_logprob_rows", None) or [])]
    W = tables.shape[1] if tables.ndim == 2 else 0
    U = min(W, int(getattr(sched, "max_row_blocks", W)))
    header = np.zeros(_HEADER, dtype=np.int64)
    header[:12] = (STEP, int(sched.step_id), T, S, R, int(sched.max_query_len), int(sched.num_placeholders),
                   int(prev_num_sampled), W, copies.shape[0], len(prompt), U)
    return [header, sched.positions[:T], sched.slot_mapping[:T], sched.logits_indices[:R], copies,
            sched.input_ids[:T], sched.prev_sample_rows[:T], sched.seq_lens[:S], sched.query_start_loc[: S + 1],
            tables[:S, :U], np.asarray(prompt, dtype=np.int32).reshape(-1, 3)]


def message_kind(message) -> int:
    return int(np.frombuffer(message, dtype=np.int64, count=1)[0])


def decode_step(message: bytearray) -> StepView:
    """The StepView of a STEP message (views into `message`, which must stay alive and writable)."""
    header = np.frombuffer(message, dtype=np.int64, count=_HEADER)
    kind, step_id, T, S, R, max_q, num_ph, prev_n, W, C, P, U = (int(x) for x in header[:12])
    if kind != STEP:
        raise ValueError(f"not a step message (kind {kind})")
    offset = _HEADER * 8

    def take(dtype, count: int, shape=None) -> np.ndarray:
        nonlocal offset
        a = np.frombuffer(message, dtype=dtype, count=count, offset=offset)
        offset += a.nbytes
        return a if shape is None else a.reshape(shape)

    positions, slot_mapping = take(np.int64, T), take(np.int64, T)
    logits_indices, copy_orders = take(np.int64, R), take(np.int64, 2 * C, (C, 2))
    input_ids, prev_rows = take(np.int32, T), take(np.int32, T)
    seq_lens, qsl = take(np.int32, S), take(np.int32, S + 1)
    used = take(np.int32, S * U, (S, U))
    tables = used if U == W else np.zeros((S, W), dtype=np.int32)
    if U != W:
        tables[:, :U] = used
    prompt = take(np.int32, 3 * P, (P, 3))
    return StepView(step_id=step_id, num_tokens=T, num_seqs=S, num_sampled=R, max_query_len=max_q,
                    num_placeholders=num_ph, prev_num_sampled=prev_n, positions=positions, slot_mapping=slot_mapping,
                    logits_indices=logits_indices, copy_orders=copy_orders, input_ids=input_ids,
                    prev_sample_rows=prev_rows, seq_lens=seq_lens, query_start_loc=qsl, block_tables=tables,
                    prompt_logprob_rows=[("", int(a), int(b), int(c)) for a, b, c in prompt])


#: The largest slot of the step queue: bigger messages (very long block tables) go by pipe, and the
#: shared memory stays small (a container's /dev/shm is often 64 MiB).
MAX_SLOT_BYTES = 4 << 20


def max_step_bytes(max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int) -> int:
    """The slot size for steps of these limits: an upper bound of a message without copy orders or
    prompt-logprob rows (those are few), at most MAX_SLOT_BYTES (a larger message still goes
    through, by pipe)."""
    T, S = max_num_batched_tokens, max_num_seqs
    bound = _HEADER * 8 + T * (8 + 8 + 4 + 4 + 8) + S * (8 + 4 + 4 + 4 * max_blocks_per_seq) + 4 + 4096
    return min(bound, MAX_SLOT_BYTES)
