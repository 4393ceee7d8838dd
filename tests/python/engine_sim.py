"""A simulated model that drives pagedllm._C.EngineCore through its step buffers only.

SimModel.step(out) does what a real model runner does with a SchedulerOutput, with a fake KV
cache: it applies out.copy_orders, writes every input token (with its position) into the KV store
at out.slot_mapping, and computes each sampled row's next token from the context it reads back
through out.block_tables and out.seq_lens -- never from request state. A wrong position, slot,
block table, copy order or chunk boundary therefore changes the tokens (and trips the position
check), so runs with different pools, budgets and preemptions must produce identical outputs.

The next token is a hash of the context's token ids and of the sequence's index within its
request (the per-sequence sampler state a real engine keeps, learnt from out.new_seqs), taken
modulo `vocab_size`. With repeat_period P, three times in four (by the hash) it is instead the
token P positions back, so that outputs repeat themselves and n-gram drafts are often accepted.

Speculative decoding: a sampled row may end before its sequence's last token (the k + 1 rows of a
verification read the context up to their own position, drafts included).
"""

from __future__ import annotations

import numpy as np

POS_BITS = 20  # KV store value = token_id << POS_BITS | position


class SimModel:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, vocab_size: int, seed: int = 0,
                 context: str = "full", repeat_period: int = 0):
        """context="full": each sampled row reads its whole context back (the tests);
        "last": only the row's last token (a lighter model for benchmarks)."""
        assert context in ("full", "last")
        self.context = context
        self.repeat_period = repeat_period
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)
        rng = np.random.default_rng(seed)
        self.weights = rng.integers(1, 2**31 - 1, size=max_model_len + 1, dtype=np.int64)
        self.index_of: dict[int, int] = {}  # seq id -> CompletionOutput.index (from new_seqs)

    def register(self, out) -> None:
        """Learn the new sequences' indices (a cancelled step's new_seqs are not announced again)."""
        for seq_id, _request_id, index in out.new_seqs:
            self.index_of[int(seq_id)] = int(index)

    def step(self, out, check_context=None) -> np.ndarray:
        """Run one step on `out`; return int32 [out.num_sampled] next tokens.

        check_context(seq_id, context_token_ids) is called for each sampled row when given, so a
        test can compare what the model read back with what it expects."""
        self.register(out)
        bs = self.block_size
        for src, dst in out.copy_orders.tolist():
            self.kv[dst * bs:(dst + 1) * bs] = self.kv[src * bs:(src + 1) * bs]
        positions = out.positions
        self.kv[out.slot_mapping] = (out.input_ids.astype(np.int64) << POS_BITS) | positions
        r = out.num_sampled
        if r == 0:
            return np.zeros(0, dtype=np.int32)
        li = out.logits_indices
        qsl = out.query_start_loc
        row = np.searchsorted(qsl, li, side="right") - 1
        ctx_len = positions[li] + 1
        if out.num_draft_tokens:  # verification rows end at their own position
            assert (ctx_len <= out.seq_lens[row]).all(), "sampled row past its sequence's end"
        else:
            assert np.array_equal(ctx_len, out.seq_lens[row]), "sampled row is not its sequence's last token"
        if self.context == "last":
            p = ctx_len - 1
            v = self.kv[out.block_tables[row, p // bs].astype(np.int64) * bs + p % bs]
            assert np.array_equal(v & ((1 << POS_BITS) - 1), p), "KV slot holds another position"
            idx = np.array([self.index_of[int(s)] for s in out.sample_seq_ids.tolist()], dtype=np.int64)
            return (((v >> POS_BITS) * 2654435761 + p + idx * 1_000_003) % self.vocab_size).astype(np.int32)
        starts = np.cumsum(ctx_len) - ctx_len
        owner = np.repeat(np.arange(r), ctx_len)
        pos = np.arange(int(ctx_len.sum()), dtype=np.int64) - np.repeat(starts, ctx_len)
        blocks = out.block_tables[row[owner], pos // bs].astype(np.int64)
        values = self.kv[blocks * bs + pos % bs]
        assert (values >= 0).all(), "context reads a slot nobody wrote"
        assert np.array_equal(values & ((1 << POS_BITS) - 1), pos), "KV slot holds another position"
        tokens = values >> POS_BITS
        h = np.add.reduceat((tokens + 1) * self.weights[pos], starts)
        seq_ids = out.sample_seq_ids
        index = np.array([self.index_of[int(s)] for s in seq_ids.tolist()], dtype=np.int64)
        h = h ^ (h >> 17)
        nxt = (h + index * 1_000_003) % self.vocab_size
        if self.repeat_period:
            P = self.repeat_period
            back = tokens[np.maximum(starts + ctx_len - P, starts)]
            nxt = np.where((ctx_len >= P) & (h % 4 != 0), back, nxt)
        if check_context is not None:
            for k in range(r):
                check_context(int(seq_ids[k]), tokens[starts[k]:starts[k] + ctx_len[k]])
        return nxt.astype(np.int32)
