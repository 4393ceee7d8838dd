"""CUDA graphs for speculative verification steps: steps whose sequences have at most q = k + 1
query tokens each (decodes, and decodes with up to k drafts), as vLLM captures "uniform decode"
graphs of query length 1 + num_speculative_tokens.

One graph per batch size of a small ladder (1, 2, 4, 8, 16, ... up to max_seqs) captures the whole
forward over S + 1 sequence slots and T = S * q + 1 token rows, writing the float32 logits of every
row into one shared buffer. A step of n <= S sequences and t <= n * q tokens fills its own rows; the
remaining T - t >= S - n + 1 rows go to S - n + 1 padding sequences of at least one token each
(slot -1: nothing written; a context of their own rows over block 0: a harmless read), so the
varlen attention kernel (cuda/paged_prefill.cu: grid from T and S only, each CTA finds its
sequence on the device) sees fixed shapes. The step's inputs reach the device in one host-to-device
copy of one pinned byte buffer; after the replay the logits of sched.logits_indices are gathered.

Steps with a longer query (prompt chunks), prompt logprobs or placeholder tokens (async scheduling)
run eagerly. Graph capture: CUDA Programming Guide, "CUDA Graphs"; torch.cuda.graph.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm import _C
from pagedllm.model_executor.layers.attention import AttentionMetadata

# (name, dtype, rows: "T" tokens, "S" = S + 1 sequence slots, "Q" = S + 2, columns: None = width)
_FIELDS = (("positions", torch.int64, "T", 1), ("slot_mapping", torch.int64, "T", 1),
           ("input_ids", torch.int32, "T", 1), ("seq_lens", torch.int32, "S", 1),
           ("query_start_loc", torch.int32, "Q", 1), ("block_tables", torch.int32, "S", None))


def verify_sizes(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to max_seqs (included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_seqs] + list(range(16, max_seqs, 16))
    return sorted(set(sizes + [max_seqs]))


def max_batch(max_model_len: int, q: int) -> int:
    """The largest size whose longest padding sequence (size * (q - 1) + 1 rows, at capture: every
    row a padding row) fits max_model_len."""
    return (int(max_model_len) - 1) // (q - 1)


def _rows(kind: str, size: int, q: int) -> int:
    return {"T": size * q + 1, "S": size + 1, "Q": size + 2}[kind]


def _views(buf: torch.Tensor, size: int, q: int, width: int) -> dict[str, torch.Tensor]:
    views, offset = {}, 0
    for name, dtype, kind, cols in _FIELDS:
        rows, cols = _rows(kind, size, q), width if cols is None else cols
        nbytes = rows * cols * torch.empty((), dtype=dtype).element_size()
        v = buf[offset:offset + nbytes].view(dtype)
        views[name] = v.view(rows, cols) if cols != 1 else v
        offset += nbytes
    return views


def _buffer_bytes(size: int, q: int, width: int) -> int:
    return _rows("T", size, q) * (8 + 8 + 4) + _rows("S", size, q) * (4 + 4 * width) + _rows("Q", size, q) * 4


def logits_bytes(max_seqs: int, q: int, vocab_size: int) -> int:
    """The shared float32 logits buffer of a VerifyGraphRunner (for the KV budget)."""
    return _rows("T", max_seqs, q) * vocab_size * 4


class VerifyGraphRunner:
    """Captured verification graphs (module docstring) for one model and its KV caches.

    query_len: q = 1 + num_speculative_tokens; max_seqs: the largest batch captured, capped by
    max_batch(max_model_len, q) (the last padding sequence must stay inside max_model_len: its
    positions index the RoPE tables and its block-table row).
    """

    def __init__(self, model, kv_caches, query_len: int, max_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, max_model_len: int, pool=None):
        if query_len < 2:
            raise ValueError(f"query_len must be >= 2 (1 + num_speculative_tokens), got {query_len}")
        max_seqs = min(max_seqs, max_batch(max_model_len, query_len))
        if max_seqs < 1:
            raise ValueError(f"max_model_len={max_model_len} is too short for verification graphs of {query_len} tokens")
        self.model = model
        self.kv_caches = kv_caches
        self.q = int(query_len)
        self.device = device
        self.sizes = verify_sizes(max_seqs)
        self.max_size = self.sizes[-1]
        self.width = int(max_blocks_per_seq)
        self.num_replays = 0
        nbytes = _buffer_bytes(self.max_size, self.q, self.width)
        self._dev_buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._host_buf = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        self._dev = {s: _views(self._dev_buf, s, self.q, self.width) for s in self.sizes}
        self._host = {s: {k: v.numpy() for k, v in _views(self._host_buf, s, self.q, self.width).items()}
                      for s in self.sizes}
        self._copied = torch.cuda.Event()
        self._logits = torch.empty((_rows("T", self.max_size, self.q), model.config.vocab_size), dtype=torch.float32,
                                   device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all(pool)

    def _forward(self, size: int) -> None:
        d = self._dev[size]
        meta = AttentionMetadata(slot_mapping=d["slot_mapping"], block_tables=d["block_tables"],
                                 seq_lens=d["seq_lens"], query_start_loc=d["query_start_loc"], decode_only=False)
        state = self.model.embed(d["input_ids"], d["positions"])
        state = self.model.forward_layers(state, d["positions"], self.kv_caches, meta, 0, len(self.model.layers))
        self.model.logits(state, None, out=self._logits[:_rows("T", size, self.q)])

    @torch.inference_mode()
    def _capture_all(self, pool) -> None:
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._fill(size, None)  # every row a padding row
                for name, v in self._host[size].items():
                    self._dev[size][name].copy_(torch.from_numpy(v))
                self._forward(size)  # warm-up outside capture (cuBLAS workspaces, lazy init)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._forward(size)
                self._graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def can_run(self, sched) -> bool:
        """A step of sequences with 1..q query tokens each and no placeholders (the caller also
        requires no prompt logprob rows, as for the decode graphs)."""
        n = int(sched.num_seqs)
        return (0 < n <= self.max_size and 1 < int(sched.max_query_len) <= self.q
                and not int(sched.num_placeholders))

    def _fill(self, size: int, sched) -> None:
        """The host inputs of graph `size`: the step's rows (none for sched None), then padding."""
        h = self._host[size]
        n = 0 if sched is None else int(sched.num_seqs)
        t = 0 if sched is None else int(sched.num_tokens)
        T = _rows("T", size, self.q)
        if sched is not None:
            h["input_ids"][:t] = sched.input_ids
            h["positions"][:t] = sched.positions
            h["slot_mapping"][:t] = sched.slot_mapping
            h["seq_lens"][:n] = sched.seq_lens
            h["query_start_loc"][: n + 1] = sched.query_start_loc
            h["block_tables"][:n] = sched.block_tables
        # padding sequences n .. size: one token each, the last one the rest (>= 1: T - t >= size - n + 1)
        pads = size + 1 - n
        lens = np.ones(pads, dtype=np.int32)
        lens[-1] = T - t - (pads - 1)
        h["input_ids"][t:] = 0
        h["slot_mapping"][t:] = -1
        h["positions"][t:] = np.concatenate([np.arange(m) for m in lens])
        h["seq_lens"][n:] = lens
        h["query_start_loc"][n + 1:] = t + np.cumsum(lens)
        h["block_tables"][n:] = 0

    @torch.inference_mode()
    def run(self, sched) -> torch.Tensor:
        """Replay for a step that can_run; float32 logits [R, vocab] of sched.logits_indices."""
        n = int(sched.num_seqs)
        size = self.sizes[int(np.searchsorted(self.sizes, n))]
        if np.asarray(sched.block_tables).shape[1] != self.width:
            raise ValueError(f"block_tables width {np.asarray(sched.block_tables).shape[1]} differs from the "
                             f"captured {self.width}")
        self._copied.synchronize()  # the previous step's input copy has left the host buffer
        self._fill(size, sched)
        stream = torch.cuda.current_stream(self.device)
        _C.cuda_copy_async(self._dev_buf.data_ptr(), self._host_buf.data_ptr(),
                           _buffer_bytes(size, self.q, self.width), stream.cuda_stream)
        self._copied.record(stream)
        self._graphs[size].replay()
        self.num_replays += 1
        idx = torch.from_numpy(np.ascontiguousarray(sched.logits_indices, dtype=np.int64)).to(self.device)
        return self._logits.index_select(0, idx)


__all__ = ["VerifyGraphRunner", "logits_bytes", "max_batch", "verify_sizes"]
