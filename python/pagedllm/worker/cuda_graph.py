"""CUDA graphs for decode steps (one query token per sequence), as vLLM's CUDAGraphRunner.

At start-up, one graph per batch size of a ladder (1, 2, 4, 8, then multiples of 16 up to
max_num_seqs, max_num_seqs itself last) captures the whole model forward — embeddings, every
layer's reshape_and_cache and paged_attention, the final norm and the LM head — over static input
buffers, writing one shared float32 logits buffer [max_num_seqs, vocab]; the graphs share one
memory pool (captured largest first). A decode step of n <= max
sequences copies its batch buffers into the first n rows of the next larger size's buffers (pinned
host staging, one async copy per field), pads the rest (slot -1: nothing written; seq_len 1 over
block 0: a harmless read) and replays; the logits of the real rows are returned.

The paged-attention launcher chooses its flash-decoding split from the block-table width, which
is fixed (ceil(max_model_len / block_size)), so a captured launch stays valid for any step.
Graph capture: CUDA Programming Guide, "CUDA Graphs"; torch.cuda.graph.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagedllm.model_executor.attention import AttentionMetadata

logger = logging.getLogger("pagedllm")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch-size ladder: 1, 2, 4, 8, 16, 32, 48, ... (multiples of 16) up to max_num_seqs,
    which is always included. Ascending."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphRunner:
    """Captured decode graphs for one model and its KV caches.

    model: LlamaForCausalLM (forward(input_ids, positions, kv_caches, meta, logits_indices)).
    kv_caches: the per-layer (key_cache, value_cache) the graphs read and write (kept alive here).
    max_num_seqs: the largest batch; max_blocks_per_seq: the block-table width the scheduler uses.
    """

    def __init__(self, model, kv_caches, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        self.max_blocks_per_seq = int(max_blocks_per_seq)
        self.num_replays = 0
        n, m = self.max_size, self.max_blocks_per_seq
        self._dev = {
            "input_ids": torch.zeros(n, dtype=torch.int32, device=device),
            "positions": torch.zeros(n, dtype=torch.int64, device=device),
            "slot_mapping": torch.full((n,), -1, dtype=torch.int64, device=device),
            "seq_lens": torch.ones(n, dtype=torch.int32, device=device),
            "block_tables": torch.zeros((n, m), dtype=torch.int32, device=device),
        }
        self._host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in self._dev.items()}
        self._rows = torch.arange(n + 1, dtype=torch.int64, device=device)
        self._query_start_loc = self._rows.to(torch.int32)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # One float32 logits buffer for every graph (each graph copies its rows in): a graph's own
        # output would stay allocated per graph (sum of the ladder x vocab x 4 bytes).
        self._logits = torch.empty((n, model.config.vocab_size), dtype=torch.float32, device=device)
        self._capture_all()

    def _forward(self, size: int) -> torch.Tensor:
        d = self._dev
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"][:size], block_tables=d["block_tables"][:size],
            seq_lens=d["seq_lens"][:size], query_start_loc=self._query_start_loc[: size + 1],
            decode_only=True,
        )
        return self.model(d["input_ids"][:size], d["positions"][:size], self.kv_caches, meta, self._rows[:size])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # warm-up outside capture (cuBLAS workspaces, lazy init)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._logits[:size].copy_(self._forward(size))
                self._graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def can_run(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.max_size

    def graph_size(self, num_seqs: int) -> int:
        """The smallest captured batch size >= num_seqs."""
        return self.sizes[int(np.searchsorted(self.sizes, num_seqs))]

    @torch.inference_mode()
    def run(self, sched) -> torch.Tensor:
        """Replay for a decode-only SchedulerOutput (num_tokens == num_seqs <= max_num_seqs); returns
        float32 logits [R, vocab] for sched.logits_indices (a row may repeat)."""
        n = int(sched.num_seqs)
        size = self.graph_size(n)
        h, d = self._host, self._dev
        h["input_ids"].numpy()[:n] = sched.input_ids[:n]
        h["positions"].numpy()[:n] = sched.positions[:n]
        h["slot_mapping"].numpy()[:n] = sched.slot_mapping[:n]
        h["seq_lens"].numpy()[:n] = sched.seq_lens[:n]
        bt = np.asarray(sched.block_tables)
        if bt.shape[1] != self.max_blocks_per_seq:
            raise ValueError(f"block_tables width {bt.shape[1]} differs from the captured {self.max_blocks_per_seq}")
        h["block_tables"].numpy()[:n] = bt[:n]
        if n < size:  # padding rows: write nothing, attend to one token of block 0
            h["slot_mapping"].numpy()[n:size] = -1
            h["seq_lens"].numpy()[n:size] = 1
            h["block_tables"].numpy()[n:size] = 0
            h["input_ids"].numpy()[n:size] = 0
            h["positions"].numpy()[n:size] = 0
        for key in d:
            d[key][:size].copy_(h[key][:size], non_blocking=True)
        self._graphs[size].replay()
        self.num_replays += 1
        logits = self._logits
        idx = np.asarray(sched.logits_indices)
        if len(idx) == n and np.array_equal(idx, np.arange(n)):
            return logits[:n]
        return logits.index_select(0, torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)).to(self.device))
