"""Paged attention for one decoder layer, over a flat (unpadded) token batch.

`AttentionMetadata` is built once per step from the scheduler's batch buffers and passed
explicitly through the model (no global context). `Attention.forward` writes this step's keys and
values into the layer's paged KV cache (``pagedllm.ops.reshape_and_cache``) and attends:
``paged_attention`` (decode kernel) when every sequence has exactly one query token, else
``paged_prefill_attention`` (variable-length causal chunks over the paged context; decode rows may
be mixed in). PagedAttention: Kwon et al. 2023, "Efficient Memory Management for Large Language
Model Serving with PagedAttention", section 4.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from pagedllm import ops

#: Decode steps let the CUDA decode kernel load each context (all but the step's own token, which
#: the kernel before writes) before waiting for that kernel (ops.paged_attention's
#: early_context_loads); PAGEDLLM_EARLY_CONTEXT_LOADS=0 turns it off (read once, for A/B runs).
EARLY_CONTEXT_LOADS = os.environ.get("PAGEDLLM_EARLY_CONTEXT_LOADS", "1") != "0"


@dataclasses.dataclass
class AttentionMetadata:
    """One step's attention inputs (device tensors).

    slot_mapping int64 [T] (cache slot of each token; < 0 skips), block_tables int32 [S, M],
    seq_lens int32 [S] (context length including this step's tokens), query_start_loc int32 [S+1],
    decode_only: every sequence has one query token this step (T == S).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    decode_only: bool


class Attention:
    """Scaled dot-product attention of q [T, Hq, D] against the paged cache (GQA: Hq % Hkv == 0).

    FP8 caches (set_kv_cache_dtype): k_scale / v_scale are this layer's float32 [1] scales on the
    cache's device (model_executor/quantization/kv_cache.py), passed to every cache kernel; with
    calculate_kv_scales set, the next call with tokens computes them from its keys and values
    (calibrate) and clears the flag."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int = 0):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window or None
        #: CUDA: the decode split-K scratch (ops.paged_attention's workspace), shared by the layers
        self.workspace: torch.Tensor | None = None
        #: decode split-K override (ops.paged_attention's split_k; None: the kernel's cost model),
        #: for benchmarks (bench/batch1_graph.py)
        self.split_k: int | None = None
        #: FP8 caches: the cache dtype and this layer's scales (None: a 16/32-bit cache)
        self.kv_cache_dtype: torch.dtype | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        #: compute the scales from the next batch with tokens (calculate_kv_scales)
        self.calculate_kv_scales = False

    def set_kv_cache_dtype(self, dtype: torch.dtype | None, device: torch.device, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> None:
        """An FP8 cache dtype (torch.float8_e4m3fn / float8_e5m2) with its scales, or None for a
        cache in the model's dtype."""
        fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        self.kv_cache_dtype = dtype if fp8 else None
        self.k_scale = torch.tensor([k_scale], dtype=torch.float32, device=device) if fp8 else None
        self.v_scale = torch.tensor([v_scale], dtype=torch.float32, device=device) if fp8 else None

    @property
    def scales(self) -> dict:
        """The scale keyword arguments of the pagedllm.ops cache kernels."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def calibrate(self, k: torch.Tensor, v: torch.Tensor, key_bound: float = 1.0) -> None:
        """calculate_kv_scales: k_scale = key_bound * max|k| / K_SCALE_CONSTANT, v_scale = max|v| /
        V_SCALE_CONSTANT (in place: captured CUDA graphs read the new values), once, from a batch
        with tokens. key_bound: sqrt(2) when k is taken before the rotary embedding."""
        from pagedllm.model_executor.quantization.kv_cache import K_SCALE_CONSTANT, V_SCALE_CONSTANT

        if not self.calculate_kv_scales or self.k_scale is None or k.numel() == 0:
            return
        tiny = torch.finfo(torch.float32).tiny
        self.k_scale.copy_((k.abs().amax().float() * key_bound / K_SCALE_CONSTANT).clamp_min(tiny).reshape(1))
        self.v_scale.copy_((v.abs().amax().float() / V_SCALE_CONSTANT).clamp_min(tiny).reshape(1))
        self.calculate_kv_scales = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] -> out [T, Hq, D] (same dtype)."""
        key_cache, value_cache = kv_cache
        self.calibrate(k, v)
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, **self.scales)
        return self.attend(q, kv_cache, meta)

    def attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Attention only: this step's keys and values are already in the cache (written by
        ops.rotary_embedding_and_cache). q [T, Hq, D] contiguous -> out [T, Hq, D]."""
        key_cache, value_cache = kv_cache
        out = torch.empty_like(q)
        if meta.decode_only:
            # the step wrote each sequence's last token only: the rest of the context may load early
            ops.paged_attention(
                out, q, key_cache, value_cache, meta.block_tables, meta.seq_lens, self.scale,
                sliding_window=self.sliding_window, split_k=self.split_k, workspace=self.workspace,
                early_context_loads=EARLY_CONTEXT_LOADS, **self.scales,
            )
        else:
            ops.paged_prefill_attention(
                out, q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                self.scale, sliding_window=self.sliding_window, **self.scales,
            )
        return out
