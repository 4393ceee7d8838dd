"""CUDA graphs for decode steps (one query token per sequence), as vLLM's CUDAGraphRunner.

At start-up, one graph per batch size of a ladder (1, 2, 4, 8, then multiples of 16 up to
max_num_seqs, max_num_seqs itself last) captures the whole model forward — embeddings, every
layer's reshape_and_cache and paged_attention, the final norm and the LM head — over static input
buffers, writing one shared float32 logits buffer [max_num_seqs, vocab]; the graphs share one
memory pool (captured largest first). A decode step of n <= max sequences fills the first n rows
of the next larger size's inputs in pinned host memory, pads the rest (slot -1: nothing written;
seq_len 1 over block 0: a harmless read), copies them with ONE host-to-device copy (a size's
inputs are the first bytes of one byte buffer: positions and slot_mapping int64, then input_ids,
seq_lens, prev_rows and block_tables int32) and replays; the logits of the real rows are returned.

Segments (without async scheduling): launching a graph costs the host about 1 us per kernel node,
and the GPU starts only once the launch is submitted — for a 32-layer model (~330 nodes) ~0.3 ms
per decode step in which the GPU idles (bench/batch1_breakdown.py on the H200). So each size's
forward is captured as a few graphs in sequence (layers [0, 1), [1, 4), [4, L) for L >= 8, see
`segment_bounds`): the first, small one starts the GPU while the host submits the others. Segments
are replayed in capture order on one stream. Their hand-over states (hidden and residual, [size,
hidden_size] each) stay allocated per size up to PER_SIZE_HANDOVER_MAX; larger sizes copy them
through one shared pair of buffers and keep nothing of their own (`boundary_state_bytes`, counted
in the KV budget: ~86 MB for Llama-3-8B with max_num_seqs 1024).

Async scheduling (placeholders=True): each size's inputs also carry prev_rows (int32, -1 pads),
and the first segment starts with ops.fill_placeholder_ids over a static int64 buffer that run()
fills with the previous step's sampled ids by one device-to-device copy: a placeholder token's id
never visits the host.

The paged-attention launcher chooses its flash-decoding split from the block-table width, which
is fixed (ceil(max_model_len / block_size)), so a captured launch stays valid for any step.
Graph capture: CUDA Programming Guide, "CUDA Graphs"; torch.cuda.graph.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagedllm import _C, ops
from pagedllm.model_executor.layers.attention import AttentionMetadata

logger = logging.getLogger("pagedllm")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch-size ladder: 1, 2, 4, 8, 16, 32, 48, ... (multiples of 16) up to max_num_seqs,
    which is always included. Ascending."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


#: Batch sizes up to this keep their segments' hand-over states (hidden, residual) allocated per
#: size; larger sizes copy them through one shared pair of [max_size, hidden_size] buffers (two
#: small copies per boundary, against ~16 KB per row and boundary of per-size memory).
PER_SIZE_HANDOVER_MAX = 256


def segment_bounds(num_layers: int, segmented: bool = True) -> list[int]:
    """Layer boundaries of a decode graph's segments: [0, 1, 4, L] for L >= 8 layers (one small
    graph to start the GPU, a second to cover the third's launch), else [0, L] (one graph).
    segmented=False (async scheduling: a step is launched while the GPU still runs the previous
    one, so nothing waits for the launch): [0, L]."""
    return [0, 1, 4, num_layers] if num_layers >= 8 and segmented else [0, num_layers]


def boundary_state_bytes(sizes: list[int], num_layers: int, hidden_size: int, dtype: torch.dtype,
                         segmented: bool = True) -> int:
    """Bytes the segments' hand-over states keep allocated (hidden and residual per boundary)."""
    boundaries = len(segment_bounds(num_layers, segmented)) - 2
    if boundaries == 0 or not sizes:
        return 0
    row = 2 * hidden_size * torch.empty((), dtype=dtype).element_size()
    per_size = sum(boundaries * s * row for s in sizes if s <= PER_SIZE_HANDOVER_MAX)
    return per_size + (max(sizes) * row if max(sizes) > PER_SIZE_HANDOVER_MAX else 0)


# the per-size input buffer: (name, dtype, columns) in byte order (int64 fields first: aligned)
_FIELDS = (("positions", torch.int64, 1), ("slot_mapping", torch.int64, 1), ("input_ids", torch.int32, 1),
           ("seq_lens", torch.int32, 1), ("prev_rows", torch.int32, 1), ("block_tables", torch.int32, None))
_PAD = {"positions": 0, "slot_mapping": -1, "input_ids": 0, "seq_lens": 1, "prev_rows": -1, "block_tables": 0}


def _field_views(buf: torch.Tensor, size: int, width: int) -> dict[str, torch.Tensor]:
    """Typed views of one size's byte buffer (see _FIELDS): [size] or [size, width]."""
    views, offset = {}, 0
    for name, dtype, cols in _FIELDS:
        cols = width if cols is None else cols
        nbytes = size * cols * torch.empty((), dtype=dtype).element_size()
        v = buf[offset:offset + nbytes].view(dtype)
        views[name] = v.view(size, cols) if name == "block_tables" else v
        offset += nbytes
    return views


def _buffer_bytes(size: int, width: int) -> int:
    return size * (8 + 8 + 4 + 4 + 4 + 4 * width)


class DecodeGraphRunner:
    """Captured decode graphs for one model and its KV caches.

    model: LlamaForCausalLM (embed / forward_layers / logits, see its forward).
    kv_caches: the per-layer (key_cache, value_cache) the graphs read and write (kept alive here).
    max_num_seqs: the largest batch; max_blocks_per_seq: the block-table width the scheduler uses.
    placeholders: capture the fill of placeholder token ids (async scheduling; see above).
    """

    def __init__(self, model, kv_caches, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 placeholders: bool = False):
        self.model = model
        self.placeholders = placeholders
        self.kv_caches = kv_caches
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        self.max_blocks_per_seq = int(max_blocks_per_seq)
        self.bounds = segment_bounds(len(model.layers), segmented=not placeholders)
        self.num_replays = 0
        m = self.max_blocks_per_seq
        # One device byte buffer and one pinned host buffer of the largest size; size s's graphs
        # read typed views of the first _buffer_bytes(s) bytes (only one size runs at a time, and
        # each step rewrites its whole prefix, padding included).
        self._dev_buf = torch.zeros(_buffer_bytes(self.max_size, m), dtype=torch.uint8, device=device)
        self._dev = {s: _field_views(self._dev_buf, s, m) for s in self.sizes}
        self._host_buf = torch.zeros(_buffer_bytes(self.max_size, m), dtype=torch.uint8, pin_memory=True)
        self._host = {s: {k: v.numpy() for k, v in _field_views(self._host_buf, s, m).items()} for s in self.sizes}
        self._copied = torch.cuda.Event()  # the last input copy (the host buffer is rewritten after it)
        self._rows = torch.arange(self.max_size + 1, dtype=torch.int64, device=device)
        self._prev_sampled = torch.zeros(self.max_size, dtype=torch.int64, device=device)
        self._query_start_loc = self._rows.to(torch.int32)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._boundary_states: dict[int, list[tuple]] = {}  # keeps the segments' hand-over tensors alive
        # One float32 logits buffer for every graph (each graph copies its rows in): a graph's own
        # output would stay allocated per graph (sum of the ladder x vocab x 4 bytes).
        self._logits = torch.empty((self.max_size, model.config.vocab_size), dtype=torch.float32, device=device)
        self._handover = None  # the shared hand-over pair of sizes > PER_SIZE_HANDOVER_MAX
        if len(self.bounds) > 2 and self.max_size > PER_SIZE_HANDOVER_MAX:
            shape = (self.max_size, model.config.hidden_size)
            self._handover = (torch.empty(shape, dtype=model.dtype, device=device),
                              torch.empty(shape, dtype=model.dtype, device=device))
        self._capture_all()

    def _meta(self, size: int) -> AttentionMetadata:
        d = self._dev[size]
        return AttentionMetadata(
            slot_mapping=d["slot_mapping"], block_tables=d["block_tables"], seq_lens=d["seq_lens"],
            query_start_loc=self._query_start_loc[: size + 1], decode_only=True,
        )

    def _segment(self, size: int, k: int, state, meta: AttentionMetadata):
        """Segment k of size `size`: (embeddings +) layers [bounds[k], bounds[k+1]) (+ logits)."""
        d, bounds = self._dev[size], self.bounds
        shared = self._handover is not None and size > PER_SIZE_HANDOVER_MAX
        if k == 0:
            if self.placeholders:
                ops.fill_placeholder_ids(d["input_ids"], d["prev_rows"], self._prev_sampled)
            state = self.model.embed(d["input_ids"], d["positions"])
        elif shared:  # (residual None = GEMV fusion, whose steps have <= 8 tokens: not reached today)
            state = (self._handover[0][:size], None if state[1] is None else self._handover[1][:size], state[2])
        state = self.model.forward_layers(state, d["positions"], self.kv_caches, meta, bounds[k], bounds[k + 1])
        if k == len(bounds) - 2:
            self.model.logits(state, None, out=self._logits[:size])  # every row; the state is done
        elif shared:
            self._handover[0][:size].copy_(state[0])
            if state[1] is not None:
                self._handover[1][:size].copy_(state[1])
        return state

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                meta = self._meta(size)
                d = self._dev[size]  # every row a padding row for the warm-up (writes nothing)
                for key, value in _PAD.items():
                    d[key].fill_(value)
                state = None
                for k in range(len(self.bounds) - 1):  # warm-up outside capture (cuBLAS workspaces, lazy init)
                    state = self._segment(size, k, state, meta)
                graphs, states, state = [], [], None
                shared = self._handover is not None and size > PER_SIZE_HANDOVER_MAX
                for k in range(len(self.bounds) - 1):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        state = self._segment(size, k, state, meta)
                    graphs.append(graph)
                    # What a later segment of this size reads must stay allocated: the hand-over
                    # state (only the RoPE tables for shared sizes, which read the shared pair);
                    # nothing after the last segment.
                    if k < len(self.bounds) - 2:
                        states.append((None, None, state[2]) if shared else state)
                self._graphs[size] = graphs
                self._boundary_states[size] = states
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def can_run(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.max_size

    def graph_size(self, num_seqs: int) -> int:
        """The smallest captured batch size >= num_seqs."""
        return self.sizes[int(np.searchsorted(self.sizes, num_seqs))]

    def replay(self, size: int) -> None:
        """Replay every segment of batch size `size` over its current inputs (no input copy)."""
        for graph in self._graphs[size]:
            graph.replay()

    @torch.inference_mode()
    def run(self, sched, prev_sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Replay for a decode-only SchedulerOutput (num_tokens == num_seqs <= max_num_seqs); returns
        float32 logits [R, vocab] for sched.logits_indices (a row may repeat). prev_sampled: the
        previous step's sampled ids (int64 [R'] on the device) when the step has placeholders
        (graphs captured with placeholders=True; ValueError otherwise)."""
        if prev_sampled is not None and not self.placeholders:
            raise ValueError("these decode graphs were captured without placeholder support (async scheduling off)")
        n = int(sched.num_seqs)
        size = self.graph_size(n)
        bt = np.asarray(sched.block_tables)
        if bt.shape[1] != self.max_blocks_per_seq:
            raise ValueError(f"block_tables width {bt.shape[1]} differs from the captured {self.max_blocks_per_seq}")
        self._copied.synchronize()  # the previous step's input copy has left the host buffer
        h = self._host[size]
        h["input_ids"][:n] = sched.input_ids[:n]
        h["positions"][:n] = sched.positions[:n]
        h["slot_mapping"][:n] = sched.slot_mapping[:n]
        h["seq_lens"][:n] = sched.seq_lens[:n]
        h["prev_rows"][:n] = sched.prev_sample_rows[:n] if prev_sampled is not None else -1
        h["block_tables"][:n] = bt[:n]
        if n < size:  # padding rows: write nothing, attend to one token of block 0
            for key, value in _PAD.items():
                h[key][n:size] = value
        stream = torch.cuda.current_stream(self.device)  # one raw async copy of this size's prefix
        nbytes = _buffer_bytes(size, self.max_blocks_per_seq)
        _C.cuda_copy_async(self._dev_buf.data_ptr(), self._host_buf.data_ptr(), nbytes, stream.cuda_stream)
        self._copied.record(stream)
        if prev_sampled is not None:
            self._prev_sampled[: prev_sampled.shape[0]].copy_(prev_sampled)
        self.replay(size)
        self.num_replays += 1
        logits = self._logits
        idx = np.asarray(sched.logits_indices)
        if len(idx) == n and np.array_equal(idx, np.arange(n)):
            return logits[:n]
        return logits.index_select(0, torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)).to(self.device))
