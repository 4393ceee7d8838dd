"""Llama-family decoder (Llama 2/3/3.x, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3) over a flat
token batch with a paged KV cache.

Per layer: RMSNorm -> fused QKV projection (+ bias for Qwen2) -> [q/k RMSNorm per head for Qwen3]
-> RoPE -> paged attention (writes the KV cache) -> O projection -> residual -> RMSNorm -> fused
gate_up projection -> SiLU(gate) * up (SwiGLU; Shazeer 2020) -> down projection -> residual.
Logits are computed only for the rows that are sampled.

Where pagedllm.ops has the fused layer ops for the device and dtype (ops.layer_ops_supported: CPU
float32/bfloat16, CUDA float32/bfloat16/float16) the elementwise steps are single kernels, as in
vLLM's Llama: the residual stream is carried beside the hidden state and each RMSNorm adds it in
place (fused_add_rms_norm), SiLU(gate) * up is one kernel, and RoPE rotates q and k in place (CPU)
or writes the rotated query out and the rotated key and the value straight into the paged KV
cache (CUDA: rotary_embedding_and_cache, replacing reshape_and_cache). Both paths round where the
PyTorch modules do. On CUDA the model runner also permutes each qkv weight's query and key rows once
(pair_rotary_rows) so that the qkv GEMV's rope epilogue rotates in registers, and each gate_up
weight's rows (pair_gate_up_rows) so that the gate_up GEMV writes SiLU(gate) * up itself.

The projections are the parallel linear layers of model_executor/layers/linear.py (qkv and
gate_up column-parallel, o and down row-parallel), the embedding and LM head vocabulary-parallel
(layers/vocab_parallel_embedding.py); how each computes is its linear method
(layers/linear_method.py, layers/cpu_linear_methods.py). With tensor parallelism (tp_group of
world size N) each rank holds num_attention_heads / N query heads and their KV heads, 1 / N of the
MLP and of the vocabulary; the hidden state is replicated and summed after o and down.

On CUDA in bfloat16/float16, steps of at most `gemv_max_tokens` tokens run every projection and
the LM head through the GEMV (UnquantizedLinearMethod), which can also take the layer's
element-wise work: the qkv GEMV's rotary + KV-cache epilogue (gemv_rope_applies), the gate_up
GEMV's SiLU epilogue (pair_gate_up_rows), and with PAGEDLLM_GEMV_FUSE=1 or 2 (one rank only; off
by default: measured slower on the H200) the norms as prologues and the residual adds as
epilogues — per layer [norm+qkv] -> rotary/cache -> attention -> [o+residual] -> [norm+gate_up] ->
(silu) -> [down+residual], with forward()'s roundings (the norms up to one ulp on near ties). On
the CPU in bfloat16, pack_weights() (called by the model runner) switches the projections to
AmxLinearMethod (steps of at most 128 tokens through pagedllm.ops.amx_linear, larger ones through
oneDNN's packed weight) or, without AMX, to PackedLinearMethod; float32 uses F.linear. Every path
accumulates in fp32 and rounds once, so results agree with F.linear within the dtype's rounding.
When every projection takes the AMX kernel (one rank), steps of at most CPU_DECODER_MAX_TOKENS
tokens run all their layers in one native call (pagedllm._C.CpuDecoderStack,
cpp/src/cpu_decoder.cpp): the same kernels in the same order, bit-identical results, without ~12
interpreted calls per layer (PAGEDLLM_CPU_NATIVE_DECODER=0 keeps the Python layers). Under tensor
parallelism it steps aside: its layers have no all-reduce.

Numerics follow Hugging Face transformers' modeling_llama / modeling_qwen2 / modeling_qwen3
(RMSNorm in float32, weight multiplied in the model dtype), so fp32 logits agree with HF to
rounding. Weights come from HF checkpoints: q/k/v and gate/up are concatenated on load.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import _C, ops
from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.distributed.pipeline import PipelineGroup
from pagedllm.model_executor.config import ModelConfig
from pagedllm.model_executor.layers.attention import Attention, AttentionMetadata
from pagedllm.model_executor.layers.cpu_linear_methods import AmxLinearMethod, PackedLinearMethod, can_pack_linear
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import (LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear, _materialize, default_weight_loader)
from pagedllm.model_executor.layers.linear_method import (GEMV_CROSSOVER_TOKENS, UnquantizedLinearMethod,
                                                          gemv_max_tokens)
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_executor.quantization.kv_cache import checkpoint_kv_scale, scale_value

__all__ = ["LlamaForCausalLM", "DecoderLayer", "GEMV_CROSSOVER_TOKENS", "gemv_max_tokens", "qk_head_rows"]


#: GEMV fusion level for such steps (LlamaForCausalLM._gemv_fusion): 0 = none, 1 = norms and
#: residual adds in the GEMVs, 2 = also SiLU-and-mul in the down GEMV. Off: on the H200 both fused
#: levels measured slower than separate kernels with PDL (batch-1 decode 4.67 / 4.64 vs 4.49 ms per
#: token; docs/history/gpu_engine_notes.md "GEMV fusions").
GEMV_FUSE_DEFAULT = 0


def gemv_rope_applies(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether GEMV-sized steps fold the rotary embedding and the KV-cache write into the qkv
    GEMV (ops.GemvRope): CUDA bf16/fp16 with the fused layer ops, head_dim a multiple of 32, no
    q/k norm between the projection and the rotation; PAGEDLLM_GEMV_ROPE=0 turns it off."""
    if os.environ.get("PAGEDLLM_GEMV_ROPE", "1") == "0":
        return False
    return (gemv_max_tokens(device, dtype) > 0 and ops.layer_ops_supported(device, dtype)
            and cfg.head_dim % 32 == 0 and not cfg.qk_norm)


#: The decode attention's split-K scratch shared by a model's layers on CUDA (ops.paged_attention's
#: workspace): 16 MiB covers small batches (batch 1 of Llama-3-8B needs 133 KB); a call that needs
#: more allocates its own, as without it.
ATTN_WORKSPACE_BYTES = 16 << 20


def qk_head_rows(order: torch.Tensor, num_heads: int, num_kv_heads: int, out_features: int) -> torch.Tensor:
    """int64 [out_features]: the row map of a fused qkv projection (num_heads query heads, then
    num_kv_heads key and value heads) that applies `order` (a permutation of one head's rows,
    int64 [head_dim]) within every query and key head and leaves the value rows where they are:
    w.index_select(0, rows) puts each q / k head's rows in that order."""
    head_dim = order.numel()
    rows = torch.arange(out_features)
    heads = num_heads + num_kv_heads
    rows[: heads * head_dim] = (torch.arange(heads).unsqueeze(1) * head_dim + order.unsqueeze(0)).reshape(-1)
    return rows


class DecoderLayer(nn.Module):
    """One decoder layer over this rank's heads and intermediate features (tp: the tensor-parallel
    group; attention heads and the MLP split across ranks, the hidden state replicated)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 tp: Optional[GroupCoordinator] = None):
        super().__init__()
        tp = tp if tp is not None else GroupCoordinator.single(device)
        self.head_dim = cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias, dtype, device, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False, dtype, device,
                                        tp)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
        window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else 0
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias,
                                                       dtype, device, tp)
        self.intermediate_size = self.gate_up_proj.output_size_per_partition // 2  # this rank's
        self.fused = ops.layer_ops_supported(device, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, dtype, device, tp)
        #: int32 arrival counters of the qkv GEMV's rope epilogue (shared by the layers; set by
        #: LlamaForCausalLM where it applies), None: a separate rotary kernel
        self.rope_counters: torch.Tensor | None = None
        #: qkv_proj's query and key rows are in ops.rotary_paired_order (LlamaForCausalLM.
        #: pair_rotary_rows): the rope epilogue rotates in registers, the rotary kernel reads that order
        self.rope_paired_rows = False
        #: GemvConfig overrides of the qkv GEMV with the rope epilogue and of the gate_up GEMV with
        #: the SiLU epilogue (ops.gemv's config; None: automatic), for benchmarks (bench/batch1_graph.py)
        self.qkv_gemv_config: dict | None = None
        self.gate_up_gemv_config: dict | None = None
        #: gate_up_proj's rows are in ops.gate_up_paired_order (LlamaForCausalLM.pair_gate_up_rows):
        #: the GEMV writes SiLU(gate) * up (silu_paired_rows), silu_and_mul reads that order (CUDA only)
        self.gate_up_paired_rows = False

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) [T, hidden_size] -> (this layer's MLP output, the residual stream
        before it); residual None for the first layer. The stream after the layer is their sum,
        added by the next norm (HF's `hidden = residual + hidden`, same rounding)."""
        T = hidden.shape[0]
        gemv = self.qkv_proj.fusions_apply(T)  # a GEMV-sized step: epilogues can be fused
        # fp8 projections of larger steps take their input quantized by the norm (no separate kernel)
        fp8_qkv = _takes_fp8_rows(self.qkv_proj, T) and self.input_layernorm.fp8_applies(hidden)
        fp8_mlp = _takes_fp8_rows(self.gate_up_proj, T) and self.post_attention_layernorm.fp8_applies(hidden)
        if residual is None:
            residual = hidden
            h = self.input_layernorm(hidden, fp8=fp8_qkv)
        else:
            h, residual = self.input_layernorm.add_and_norm(hidden, residual, fp8=fp8_qkv)
        if gemv and self.rope_counters is not None and cos_sin is None and not self.attn.calculate_kv_scales:
            attn = self._qkv_rope_attention(h, positions, rotary, kv_cache, meta)
        else:
            qkv = self.qkv_proj(h)
            attn = self._attention(qkv, positions, cos_sin, rotary, kv_cache, meta)
        hidden = self.o_proj(attn)
        h, residual = self.post_attention_layernorm.add_and_norm(hidden, residual, fp8=fp8_mlp)
        if self.gate_up_paired_rows and gemv:  # SiLU(gate) * up in the GEMV's epilogue: no kernel
            act = self.gate_up_proj(h, silu_paired_rows=True, config=self.gate_up_gemv_config)
        elif self.fused:
            act = ops.silu_and_mul(torch.empty((T, self.intermediate_size), dtype=residual.dtype,
                                               device=residual.device),
                                   self.gate_up_proj(h), paired_rows=self.gate_up_paired_rows)
        else:
            gate, up = self.gate_up_proj(h).split([self.intermediate_size, self.intermediate_size], dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act), residual

    def forward_gemv_fused(self, stream: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                           kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                           silu_in_down: bool) -> None:
        """The layer for a CUDA step of at most gemv_max_tokens tokens with the norms and residual
        adds fused into the GEMVs: `stream` [T, hidden_size] is the residual stream (after the
        previous layer's residual add), updated in place. qkv = gemv(rms_norm(stream)); stream +=
        gemv(attention); gate_up = gemv(rms_norm(stream)); stream += gemv(SiLU(gate) * up) — with
        paired gate/up rows the SiLU is the gate_up GEMV's epilogue, else with silu_in_down the
        down GEMV's prologue, else one silu_and_mul kernel. Same roundings as forward() (the norms
        up to one ulp on near ties: ops.gemv)."""
        T = stream.shape[0]
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        qkv = self.qkv_proj(stream, norm_weight=n1.weight, eps=n1.eps)
        attn = self._attention(qkv, positions, None, rotary, kv_cache, meta)
        self.o_proj(attn, out=stream, residual=stream)
        if self.gate_up_paired_rows:
            act = self.gate_up_proj(stream, norm_weight=n2.weight, eps=n2.eps, silu_paired_rows=True,
                                    config=self.gate_up_gemv_config)
            self.down_proj(act, out=stream, residual=stream)
            return
        gate_up = self.gate_up_proj(stream, norm_weight=n2.weight, eps=n2.eps)
        if silu_in_down:
            act = gate_up
        else:
            act = ops.silu_and_mul(torch.empty((T, self.intermediate_size), dtype=stream.dtype, device=stream.device),
                                   gate_up)
        self.down_proj(act, out=stream, residual=stream, silu_and_mul=silu_in_down)

    def _qkv_rope_attention(self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                            kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """A GEMV-sized CUDA step: the qkv GEMV with the rotary + KV-cache write in its epilogue
        (ops.GemvRope; no rotary kernel), then paged attention. h [T, hidden] -> [T, q_size]."""
        T = h.shape[0]
        query = torch.empty((T, self.num_heads, self.head_dim), dtype=h.dtype, device=h.device)
        key_cache, value_cache = kv_cache
        self.qkv_proj(h, rope=ops.GemvRope(
            self.num_heads, self.num_kv_heads, positions, rotary.cos, rotary.sin, query, key_cache, value_cache,
            meta.slot_mapping, None if self.rope_paired_rows else self.rope_counters, self.rope_paired_rows,
            **self.attn.scales), config=self.qkv_gemv_config)
        return self.attn.attend(query, kv_cache, meta).view(T, self.q_size)

    def _attention(self, qkv: torch.Tensor, positions: torch.Tensor,
                   cos_sin: tuple[torch.Tensor, torch.Tensor] | None, rotary: RotaryEmbedding,
                   kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """qkv [T, q_size + 2 kv_size] -> attention output [T, q_size] (rotary, KV cache write,
        paged attention)."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.rope_paired_rows and (cos_sin is not None or not q.is_cuda):
            raise RuntimeError("paired rotary rows are read by the CUDA rotary kernels only")
        if cos_sin is not None:
            q = rotary.apply(q, *cos_sin)
            k = rotary.apply(k, *cos_sin)
            attn = self.attn.forward(q, k, v.contiguous(), kv_cache, meta)
        elif q.is_cuda:
            # fused (CUDA): the rotated query to a new tensor, the rotated key and v into the cache
            query = torch.empty((T, self.num_heads, self.head_dim), dtype=qkv.dtype, device=qkv.device)
            key_cache, value_cache = kv_cache
            self.attn.calibrate(k, v, key_bound=2**0.5)  # k before its rotation (quantization/kv_cache.py)
            ops.rotary_embedding_and_cache(positions, q, k, v, rotary.cos, rotary.sin, query, key_cache,
                                           value_cache, meta.slot_mapping, paired_rows=self.rope_paired_rows,
                                           **self.attn.scales)
            attn = self.attn.attend(query, kv_cache, meta)
        else:
            # fused (CPU): rotate q and k in place; the CPU kernels read q, k, v as views of qkv
            ops.rotary_embedding(positions, q, k, rotary.cos_sin_cache)
            attn = self.attn.forward(q, k, v, kv_cache, meta)
        return attn.view(T, self.q_size)


_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _takes_fp8_rows(proj: LinearBase, tokens: int) -> bool:
    """Whether `proj`'s linear method wants per-token FP8 input for a step of `tokens` rows
    (quantization/fp8.py's takes_fp8_rows)."""
    takes = getattr(proj.quant_method, "takes_fp8_rows", None)
    return takes is not None and takes(proj, tokens)


class LlamaForCausalLM(nn.Module):
    """The whole decoder. forward(input_ids int [T], positions int64 [T], kv_caches (one (k, v) per
    layer), meta, logits_indices int64 [R]) -> float32 logits [R, vocab_size].

    tp_group: this rank's tensor-parallel group (default: one rank). Each rank holds its heads
    (KV caches of num_kv_heads_per_rank heads), its share of the MLP and of the vocabulary; every
    rank computes the same replicated hidden state and the same gathered logits.

    pp_group: this rank's pipeline stage (distributed/pipeline.py; default: one stage). A stage
    holds the decoder layers [start_layer, end_layer) only (self.layers[i] is layer start_layer + i,
    and kv_caches hold those layers'); the first stage also holds the embedding, the final norm
    and the LM head, which the other stages lack (None). forward() needs the whole model; a stage
    runs embed / forward_layers / residual_stream / compute_logits (worker/model_runner.py)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int | None = None,
                 tp_group: Optional[GroupCoordinator] = None, pp_group: Optional[PipelineGroup] = None):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.device = device
        self.tp = tp_group if tp_group is not None else GroupCoordinator.single(device)
        self.pp = pp_group if pp_group is not None else PipelineGroup.single(device)
        self.start_layer, self.end_layer = self.pp.layer_range(cfg.num_hidden_layers)
        first = self.pp.is_first
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device,
                                                   self.tp) if first else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device, self.tp)
                                    for i in range(self.start_layer, self.end_layer))
        qkv = self.layers[0].qkv_proj if self.layers else None
        #: heads of this rank (the KV cache holds num_kv_heads_per_rank heads)
        self.num_heads_per_rank = qkv.num_heads if qkv is not None else cfg.num_attention_heads
        self.num_kv_heads_per_rank = qkv.num_kv_heads if qkv is not None else cfg.num_key_value_heads
        if device.type == "cuda":  # one decode split-K scratch for every layer (they run in turn)
            workspace = torch.empty(ATTN_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            for layer in self.layers:
                layer.attn.workspace = workspace
        if gemv_rope_applies(cfg, device, dtype):  # the layers run in turn: one set of counters
            counters = torch.zeros(self.num_heads_per_rank + 2 * self.num_kv_heads_per_rank, dtype=torch.int32,
                                   device=device)
            for layer in self.layers:
                layer.rope_counters = counters
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device) if first else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, device, self.tp,
                                      tied_to=self.embed_tokens if cfg.tie_word_embeddings else None) if first else None
        #: GemvConfig override of the LM head's GEMV (None: automatic), for benchmarks
        self.lm_head_gemv_config: dict | None = None
        self.fused = ops.layer_ops_supported(device, dtype)
        self.gemv_max_tokens = gemv_max_tokens(device, dtype)
        self._fusion_fits: dict[int, tuple[bool, bool]] = {}
        self._native_applies = False  # set by pack_weights(): every projection takes the AMX kernel
        self._quantized = False  # set by quantize_weights(): a projection has a quantized method
        self._native: _C.CpuDecoderStack | None = None
        self._native_key: tuple | None = None
        #: FP8 KV-cache scales the checkpoint holds: (layer, "k" | "v") -> scale (load_weights)
        self.checkpoint_kv_scales: dict[tuple[int, str], float] = {}
        self.rotary = RotaryEmbedding(
            cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings, dtype, device
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """This rank's LM head rows [vocab_per_rank, hidden] (the embedding's when tied)."""
        return self.lm_head.weight

    def rope_state(self, positions: torch.Tensor):
        """The RoPE (cos, sin) tables of the PyTorch path, or None (the fused ops rotate themselves)."""
        return None if self.fused else self.rotary.cos_sin(positions)

    @staticmethod
    def residual_stream(state: tuple) -> torch.Tensor:
        """The residual stream [T, hidden] after the layers that made `state` (what the next layer's,
        or the final, norm reads): hidden + residual with HF's rounding, or hidden itself under GEMV
        fusion. A stage hands it to the next, which starts from the state (stream, None, tables)."""
        hidden, residual, _ = state
        return hidden if residual is None else residual + hidden

    def projections(self) -> list[LinearBase]:
        """Every decoder layer's linear layers (qkv, o, gate_up, down per layer)."""
        return [getattr(layer, name) for layer in self.layers for name in _PROJECTIONS]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        greedy_vocab: int = 0,
    ) -> torch.Tensor:
        """float32 logits [R, vocab_size] of rows logits_indices; with greedy_vocab > 0 (where
        argmax_applies(R)) the int64 [R] argmax over each row's first greedy_vocab logits instead."""
        state = self.embed(input_ids, positions)
        state = self.forward_layers(state, positions, kv_caches, meta, 0, len(self.layers))
        if greedy_vocab > 0:
            return self.greedy_ids(state, logits_indices, greedy_vocab)
        return self.logits(state, logits_indices)

    # forward in three pieces, so that a decode CUDA graph can be captured as several segments
    # (pagedllm.worker.cuda_graph): state = (hidden [T, hidden_size], residual [T, hidden_size] or
    # None, the RoPE (cos, sin) tables of the PyTorch path or None). With GEMV fusion (one level
    # for every piece of a step: it depends on T only) hidden is the residual stream, updated in
    # place by the o and down GEMVs, and residual stays None; otherwise residual is None only
    # before the first layer.
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple:
        """input_ids int [T] -> the state before layer 0."""
        return self.embed_tokens(input_ids), None, self.rope_state(positions)

    def forward_layers(self, state: tuple, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       meta: AttentionMetadata, start: int, end: int) -> tuple:
        """Layers [start, end) over `state`; kv_caches holds every layer's (k, v)."""
        hidden, residual, cos_sin = state
        native = self._native_stack(kv_caches, hidden.shape[0])
        if native is not None and start < end:
            has_residual = residual is not None
            if not has_residual:
                residual = torch.empty_like(hidden)
            v = ops._view
            native.forward(start, end, v(hidden), v(residual), has_residual, v(positions), v(meta.slot_mapping),
                           v(meta.block_tables), v(meta.seq_lens), v(meta.query_start_loc), meta.decode_only)
            return hidden, residual, cos_sin
        fusion = self._gemv_fusion(hidden.shape[0])
        for i in range(start, end):
            if fusion:
                self.layers[i].forward_gemv_fused(hidden, positions, self.rotary, kv_caches[i], meta, fusion >= 2)
            else:
                hidden, residual = self.layers[i](hidden, residual, positions, cos_sin, self.rotary, kv_caches[i],
                                                  meta)
        return hidden, residual, cos_sin

    def _native_stack(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], tokens: int) -> "_C.CpuDecoderStack | None":
        """The native CPU decoder stack (pagedllm/cpu_decoder.h) for a step of `tokens` tokens, or
        None where the Python layers run: it needs every projection packed for AMX
        (pack_weights), the fused layer ops, 1 to CPU_DECODER_MAX_TOKENS tokens and
        PAGEDLLM_CPU_NATIVE_DECODER not "0". Built on first use for these KV caches (it holds views
        of the weights and caches; rebuilt when a cache's address, shape, strides or dtype change, and
        dropped by pack_weights)."""
        # both limits: above AmxLinearMethod.MAX_TOKENS the Python path takes oneDNN, whose sums differ
        limit = min(_C.CPU_DECODER_MAX_TOKENS, AmxLinearMethod.MAX_TOKENS)
        if not (self._native_applies and 0 < tokens <= limit and len(kv_caches) == len(self.layers)):
            return None
        if any(layer.attn.calculate_kv_scales for layer in self.layers):  # the Python layers calibrate
            return None
        if os.environ.get("PAGEDLLM_CPU_NATIVE_DECODER", "1") == "0":
            return None
        key = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for kv in kv_caches for t in kv)
        if self._native is None or self._native_key != key:
            self._native = self._build_native_stack(kv_caches)
            self._native_key = key
        return self._native

    def _build_native_stack(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> "_C.CpuDecoderStack":
        cfg = self.config
        conf = _C.CpuDecoderConfig()
        conf.hidden_size, conf.intermediate_size = cfg.hidden_size, cfg.intermediate_size
        conf.num_heads, conf.num_kv_heads, conf.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        conf.rms_norm_eps = float(self.layers[0].input_layernorm.eps) if self.layers else cfg.rms_norm_eps
        conf.scale = float(self.layers[0].attn.scale) if self.layers else cfg.head_dim**-0.5
        v = ops._view
        layers = []
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
            n = _C.CpuDecoderLayer()
            n.input_norm, n.post_norm = v(layer.input_layernorm.weight), v(layer.post_attention_layernorm.weight)
            n.qkv, n.qkv_bias = layer.qkv_proj._packed_view, layer.qkv_proj._bias_view
            n.o = layer.o_proj._packed_view
            n.gate_up, n.gate_up_bias = layer.gate_up_proj._packed_view, layer.gate_up_proj._bias_view
            n.down, n.down_bias = layer.down_proj._packed_view, layer.down_proj._bias_view
            if layer.qk_norm:
                n.q_norm, n.k_norm = v(layer.q_norm.weight), v(layer.k_norm.weight)
            n.key_cache, n.value_cache = v(key_cache), v(value_cache)
            if layer.attn.k_scale is not None:  # an FP8 cache (read at each call: calibration updates in place)
                n.k_scale, n.v_scale = v(layer.attn.k_scale), v(layer.attn.v_scale)
            n.sliding_window = layer.attn.sliding_window or 0
            layers.append(n)
        return _C.CpuDecoderStack(conf, layers, v(self.rotary.cos_sin_cache))

    def set_kv_cache_dtype(self, dtype: torch.dtype) -> str:
        """The KV caches' dtype: the model's, or FP8 (torch.float8_e4m3fn / float8_e5m2) with each
        layer's scales from the checkpoint (load_weights; a per-head scale vector becomes its largest
        entry over all heads, which never saturates more) or 1.0. Returns where the scales came from, for the start-up log."""
        fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        found = self.checkpoint_kv_scales
        for i, layer in enumerate(self.layers, start=self.start_layer):
            layer.attn.set_kv_cache_dtype(dtype if fp8 else None, self.device, found.get((i, "k"), 1.0),
                                          found.get((i, "v"), 1.0))
        self._native = None  # rebuilt with the scales
        if not fp8:
            return "none"
        mine = sum(self.start_layer <= layer < self.end_layer for layer, _ in found)
        return (f"checkpoint ({mine} of {2 * len(self.layers)} k/v scales; the others 1.0)" if found
                else "1.0 (the checkpoint has none)")

    def enable_kv_scale_calculation(self) -> None:
        """calculate_kv_scales: every layer with an FP8 cache computes its scales from the next batch
        with tokens (Attention.calibrate)."""
        for layer in self.layers:
            if layer.attn.k_scale is not None:
                layer.attn.calculate_kv_scales = True

    def logits(self, state: tuple, logits_indices: torch.Tensor | None, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The state after the last layer -> float32 logits [R, vocab_size] of rows logits_indices,
        written into `out` (float32 [R, vocab_size], e.g. a CUDA graph's shared buffer) when given;
        returns them. logits_indices None: every row in order, without a gather — the state's
        tensors are then overwritten (the fused final norm works in place on them)."""
        hidden, residual, _ = state
        pick = (lambda t: t) if logits_indices is None else (lambda t: t.index_select(0, logits_indices))
        if self.layers and self._gemv_fusion(hidden.shape[0]):  # the final norm in the LM head's GEMV
            head = self.lm_head
            return self._store(head.quant_method.apply(head, pick(hidden), norm_weight=self.norm.weight,
                                                       eps=self.norm.eps).float(), out)
        if residual is None:  # no layers
            return self._store(self.compute_logits(pick(hidden)), out)
        normed, _ = self.norm.add_and_norm(pick(hidden), pick(residual))
        return self._lm_head(normed, out)

    @staticmethod
    def _store(logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return logits if out is None else out.copy_(logits)

    def argmax_applies(self, rows: int) -> bool:
        """Whether greedy_ids (the LM head and the argmax in one AMX pass) runs for `rows` rows."""
        return (self.lm_head is not None and isinstance(self.lm_head.quant_method, AmxLinearMethod)
                and 0 < rows <= AmxLinearMethod.MAX_TOKENS and bool(self.layers) and self.tp.world_size == 1
                and self.pp.world_size == 1)

    def greedy_ids(self, state: tuple, logits_indices: torch.Tensor, vocab: int) -> torch.Tensor:
        """int64 [R]: the argmax over the first `vocab` columns of logits(state, logits_indices),
        the smallest column on ties (as argmax_rows), without writing the logits; needs
        argmax_applies(R)."""
        hidden, residual, _ = state
        normed, _ = self.norm.add_and_norm(hidden.index_select(0, logits_indices),
                                           residual.index_select(0, logits_indices))
        return self.lm_head.quant_method.argmax(self.lm_head, normed, vocab)

    def _gemv_fusion(self, tokens: int) -> int:
        """For a step of `tokens` tokens: 0 (no GEMV fusion), 1 (norms and residual adds fused into
        the GEMVs: DecoderLayer.forward_gemv_fused) or 2 (also SiLU-and-mul into the down GEMV).
        Needs the fused CUDA layer ops, a GEMV-sized step and prologues that fit the device's shared
        memory, and one rank (the residual adds need the all-reduced sums); the level is
        PAGEDLLM_GEMV_FUSE (default GEMV_FUSE_DEFAULT, 0 turns it off)."""
        if not (self.fused and self._lm_head_unpacked() and 0 < tokens <= self.gemv_max_tokens
                and self.tp.world_size == 1 and self._projections_unquantized()):
            return 0
        env = os.environ.get("PAGEDLLM_GEMV_FUSE")
        level = max(0, min(2, int(env) if env not in (None, "") else GEMV_FUSE_DEFAULT))
        if tokens not in self._fusion_fits:  # (hidden fits, intermediate fits) on this device
            cfg = self.config
            self._fusion_fits[tokens] = (ops.gemv_fusion_fits(tokens, cfg.hidden_size, self.dtype),
                                         ops.gemv_fusion_fits(tokens, cfg.intermediate_size, self.dtype))
        hidden_fits, inter_fits = self._fusion_fits[tokens]
        if not hidden_fits:
            return 0
        return 1 if level == 2 and not inter_fits else level

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden_size] (the residual stream, pre final norm) -> float32 logits [R, vocab_size]."""
        return self._lm_head(self.norm(hidden))

    def _lm_head(self, normed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """normed [R, hidden] -> float32 logits [R, vocab] (into `out` when given; the GEMV and
        the AMX kernel write float32 themselves: no .float() kernel)."""
        return self.lm_head.compute_logits(normed, out, config=self.lm_head_gemv_config)

    def _projections_unquantized(self) -> bool:
        """Whether every decoder projection computes 16/32-bit weights (UnquantizedLinearMethod: the
        GEMV and its epilogues); quantize_weights gives some of them (perhaps not all: a GGUF file
        may keep a layer in F16) other methods."""
        return not self._quantized

    def _lm_head_unpacked(self) -> bool:
        """Whether the LM head computes its plain weight (True on a stage without one)."""
        return self.lm_head is None or isinstance(self.lm_head.quant_method, UnquantizedLinearMethod)

    def pair_rotary_rows(self) -> bool:
        """Where the qkv GEMV's rope epilogue applies (gemv_rope_applies) with full rotary
        (rotary_dim == head_dim, head_dim % 16 == 0) and PAGEDLLM_ROPE_PAIRED is not "0": permute
        the query and key rows of every layer's qkv weight (and bias) into ops.rotary_paired_order,
        so that the epilogue rotates each CTA's own rows in registers (GemvRope.paired_rows: no
        arrival counters, no cross-CTA step) and larger steps' rotary_embedding_and_cache reads that
        order (paired_rows). The rotated query and the KV cache keep the standard order; decode
        steps (the GEMV) give the unpermuted model's outputs bit for bit, and prefill (F.linear on
        the permuted rows) did too in every test on the H200, which cuBLAS does not promise (a row
        moved to another output tile could be summed in another order). Call after the weights
        are loaded (the model runner does); load_weights keeps the order. Returns whether the rows
        are paired now (idempotent)."""
        if any(layer.rope_paired_rows for layer in self.layers):
            return True
        cfg = self.config
        if (not self.layers or self.layers[0].rope_counters is None or not self._projections_unquantized()
                or cfg.head_dim % 16
                or 2 * self.rotary.cos.shape[1] != cfg.head_dim or os.environ.get("PAGEDLLM_ROPE_PAIRED", "1") == "0"):
            return False
        self._permute_qk_rows(ops.rotary_paired_order(cfg.head_dim))
        for layer in self.layers:
            layer.rope_paired_rows = True
        return True

    def pair_gate_up_rows(self) -> bool:
        """Where the GEMV runs the projections (CUDA bf16/fp16 with the fused layer ops),
        intermediate_size % 8 == 0 and PAGEDLLM_GATE_UP_PAIRED is not "0": permute every layer's
        gate_up weight (and bias) rows into ops.gate_up_paired_order, so that GEMV-sized steps get
        SiLU(gate) * up straight from the gate_up GEMV (silu_paired_rows: no silu_and_mul kernel,
        bit for bit as before) and larger steps' silu_and_mul reads that order (paired_rows; F.linear
        on the permuted rows, equal to the unpermuted product where cuBLAS sums each row alike, as
        pair_rotary_rows notes). Call after the weights are loaded (the model runner does);
        load_weights keeps the order. Returns whether the rows are paired now (idempotent)."""
        if any(layer.gate_up_paired_rows for layer in self.layers):
            return True
        inter = self.layers[0].intermediate_size if self.layers else 0  # this rank's
        if (not self.layers or not self.fused or self.gemv_max_tokens == 0 or not self._lm_head_unpacked()
                or not self._projections_unquantized()
                or inter % 8 or os.environ.get("PAGEDLLM_GATE_UP_PAIRED", "1") == "0"):
            return False
        self._permute_rows("gate_up_proj", ops.gate_up_paired_order(inter))
        for layer in self.layers:
            layer.gate_up_paired_rows = True
        return True

    def _unpair_gate_up_rows(self) -> bool:
        """Undo pair_gate_up_rows; returns whether the rows were paired."""
        if not any(layer.gate_up_paired_rows for layer in self.layers):
            return False
        self._permute_rows("gate_up_proj", torch.argsort(ops.gate_up_paired_order(self.layers[0].intermediate_size)))
        for layer in self.layers:
            layer.gate_up_paired_rows = False
        return True

    def _unpair_rotary_rows(self) -> bool:
        """Undo pair_rotary_rows; returns whether the rows were paired."""
        if not any(layer.rope_paired_rows for layer in self.layers):
            return False
        self._permute_qk_rows(torch.argsort(ops.rotary_paired_order(self.config.head_dim)))
        for layer in self.layers:
            layer.rope_paired_rows = False
        return True

    def _permute_qk_rows(self, order: torch.Tensor) -> None:
        """Every layer's qkv rows of each query and key head h: rows h * D + order (values untouched)."""
        self._permute_rows("qkv_proj", qk_head_rows(order, self.num_heads_per_rank, self.num_kv_heads_per_rank,
                                                    self.layers[0].qkv_proj.weight.shape[0]))

    def _permute_rows(self, name: str, rows: torch.Tensor) -> None:
        """Every layer's projection `name` (weight and bias): row i <- row rows[i] (int64 [out_features])."""
        for layer in self.layers:
            getattr(layer, name).permute_rows(rows)

    def pack_weights(self) -> bool:
        """After load_weights: on CPU in bfloat16, switch every projection (and the LM head) to
        AmxLinearMethod (pagedllm's AMX kernel for decode batches, oneDNN for prefill) where the
        machine has AMX, the shapes allow (multiples of 32) and all projections take at most
        AmxLinearMethod.MAX_WEIGHT_BYTES (they are then held twice), else to PackedLinearMethod
        (oneDNN blocked layout, same results as F.linear). Returns whether the weights are packed
        (idempotent)."""
        if not can_pack_linear(self.dtype, self.device):
            return False
        if self.lm_head is not None and not self._lm_head_unpacked():
            return True
        if self.lm_head is None and any(isinstance(p.quant_method, (AmxLinearMethod, PackedLinearMethod))
                                        for p in self.projections()):
            return True  # (a pipeline stage without the head: packed already)
        plain = [p for p in self.projections() if isinstance(p.quant_method, UnquantizedLinearMethod)]
        # (quantized projections keep theirs)
        weights = [p.weight for p in plain] + ([self.lm_head_weight] if self.lm_head is not None else [])
        small = sum(w.numel() * w.element_size() for w in weights) <= AmxLinearMethod.MAX_WEIGHT_BYTES

        def method(weight: torch.Tensor):
            return AmxLinearMethod() if small and AmxLinearMethod.applies(weight) else PackedLinearMethod()

        for proj in plain:
            proj.set_quant_method(method(proj.weight))
        # the head keeps its plain weight: the embedding's table when tied
        if self.lm_head is not None:
            self.lm_head.set_quant_method(method(self.lm_head_weight), keep_weight=True)
        self._native_applies = self.fused and self.tp.world_size == 1 and all(
            isinstance(p.quant_method, AmxLinearMethod) for p in self.projections())
        self._native = self._native_key = None
        return True

    def quantize_weights(self, config) -> int:
        """After load_weights: every decoder projection computes through config's linear method
        (model_executor/quantization; the LM head and the embedding keep the model dtype).
        Returns the projections' weight bytes now. Call before pack_weights (which then packs the
        LM head only) and instead of the GEMV row pairings (quantized projections take no GEMV
        epilogues)."""
        for i, layer in enumerate(self.layers, start=self.start_layer):
            for name in _PROJECTIONS:
                proj = getattr(layer, name)
                method = config.linear_method(proj, f"layers.{i}.{name}")
                if method is not None:
                    proj.set_quant_method(method)
                    self._quantized = True
        return sum(p.quant_method.weight_bytes(p) for p in self.projections())

    # ---- weights ---------------------------------------------------------------------------
    _STACKED = {  # HF name piece -> (our param piece, shard index)
        "self_attn.q_proj": ("qkv_proj", 0),
        "self_attn.k_proj": ("qkv_proj", 1),
        "self_attn.v_proj": ("qkv_proj", 2),
        "mlp.gate_proj": ("gate_up_proj", 0),
        "mlp.up_proj": ("gate_up_proj", 1),
    }
    _RENAMES = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj", "self_attn.q_norm": "q_norm",
                "self_attn.k_norm": "k_norm"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], quant_config=None) -> None:
        """Copy HF-named tensors into the model (casting to its dtype). Raises ValueError on an
        unknown or missing tensor or a shape mismatch, naming it. quant_config: a
        QuantizationConfig whose weights come in the checkpoint (from_checkpoint): its tensors go to
        it, and the decoder projections' 16/32-bit weights are not expected."""
        paired = self._unpair_rotary_rows()  # checkpoints hold the standard order
        try:
            gate_up_paired = self._unpair_gate_up_rows()
            try:
                self._load_weights(weights, quant_config)
            finally:
                if gate_up_paired:
                    self.pair_gate_up_rows()
        finally:
            if paired:
                self.pair_rotary_rows()

    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], quant_config=None) -> None:
        """Each tensor (a torch.Tensor or a loader.CheckpointTensor, read lazily) goes through its
        parameter's owner's weight_loader, which copies this rank's slice; norms are copied whole."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        self.checkpoint_kv_scales = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name.startswith("model."):
                name = name[len("model."):]
            scale_of = checkpoint_kv_scale(name)
            if scale_of is not None:  # FP8 KV-cache scales: kept for set_kv_cache_dtype
                layer, which = scale_of
                for part in which:
                    self.checkpoint_kv_scales[(layer, part)] = scale_value(name, _materialize(tensor))
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            local = self._stage_name(name)
            if local is None:
                continue  # another pipeline stage's
            if quant_config is not None and quant_config.is_checkpoint_tensor(name):
                quant_config.take_checkpoint_tensor(name, tensor)  # (global layer names)
                continue
            dest, shard = self._map(local)
            if dest not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
            param = params[dest]
            owner = self.get_submodule(dest.rpartition(".")[0])
            try:
                if hasattr(owner, "weight_loader"):
                    owner.weight_loader(param, tensor, shard)
                else:  # replicated (norms): the whole tensor
                    default_weight_loader(param, tensor)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc
            loaded.add(dest if shard is None else f"{dest}#{shard}")
        expected: set[str] = set()
        for dest in params:
            if dest == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if (quant_config is not None and quant_config.from_checkpoint and dest.endswith(".weight")
                    and dest.rsplit(".", 2)[-2] in _PROJECTIONS):
                continue  # the method's tensors stand for it
            if ".qkv_proj." in dest:
                expected |= {f"{dest}#{i}" for i in range(3)}
            elif ".gate_up_proj." in dest:
                expected |= {f"{dest}#{i}" for i in range(2)}
            else:
                expected.add(dest)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:4]}")

    def _stage_name(self, name: str) -> Optional[str]:
        """A checkpoint name (layers numbered globally) as this stage's parameter name (its own
        layers numbered from 0), or None for a tensor another pipeline stage holds."""
        if self.pp.world_size == 1:
            return name
        head, dot, rest = name.partition(".")
        if head == "layers":
            index, _, leaf = rest.partition(".")
            if index.isdigit():
                k = int(index)
                return f"layers.{k - self.start_layer}.{leaf}" if self.start_layer <= k < self.end_layer else None
        if head in ("embed_tokens", "norm", "lm_head") and not self.pp.is_first:
            return None
        return name

    def _map(self, name: str) -> tuple[str, int | None]:
        for hf, (ours, shard) in self._STACKED.items():
            if f".{hf}." in f".{name}":
                return name.replace(hf, ours), shard
        for hf, ours in self._RENAMES.items():
            if f".{hf}." in f".{name}":
                return name.replace(hf, ours), None
        return name, None

