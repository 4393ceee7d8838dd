"""ModelRunner: owns the model weights and the paged KV caches, and executes one scheduler step.

execute_model(SchedulerOutput) -> ModelRunnerOutput:
  1. copy-on-write orders first (pagedllm.ops.copy_blocks over every layer's caches);
  2. the step's flat buffers are wrapped zero-copy (torch.from_numpy) and moved to the device;
  3. placeholder tokens (async scheduling: SchedulerOutput.prev_sample_rows >= 0) get their ids
     from the previous step's sampled ids, still on the device (ops.fill_placeholder_ids);
  4. the model runs over all T tokens; logits are computed only for the sampled rows
     (logits_indices, R of them) and for prompt-logprob rows when a request asked for them.
Under tensor parallelism every rank runs execute_model on the same step (its SchedulerOutput, or
the flat arrays of it that reach a worker process: executor/step_message.py); the previous
step's sampled ids reach the other ranks by a broadcast from rank 0.

KV pool size: kv_cache_memory_bytes (default 4 GiB on CPU), else on CUDA (as vLLM's
determine_num_available_blocks): a profiling forward pass of max_num_batched_tokens tokens with
logits for max_num_seqs rows measures the activation peak; the pool gets
    total * gpu_memory_utilization - (memory used by other processes) - weights - activation peak
    - sampler workspace (3 x the logits of max_num_seqs rows)
    - CUDA graphs (256 MiB + 3 x the float32 logits of max_num_seqs rows + the hand-over states of
      segmented graphs),
divided by the bytes of a block (block_size tokens of K and V for every layer:
2 * L * block_size * Hkv * D * dtype bytes).

CUDA graphs (pagedllm.worker.cuda_graph): on CUDA without enforce_eager, decode-only steps of up
to max_num_seqs sequences replay a graph captured at start-up for the next larger batch size of a
ladder (1, 2, 4, 8, then multiples of 16); ``num_graph_replays`` counts them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from pagedllm import ops
from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.distributed.pipeline import PipelineGroup
from pagedllm.model_executor.layers.attention import AttentionMetadata
from pagedllm.model_executor.config import ModelConfig
from pagedllm.model_executor.dummy import LOAD_FORMATS, init_dummy_weights
from pagedllm.model_executor.loader import load_safetensors
from pagedllm.model_executor.models import LlamaForCausalLM
from pagedllm.model_executor.quantization import get_quantization_config
from pagedllm.model_executor.quantization.kv_cache import resolve_kv_cache_dtype
from pagedllm.worker.cpu_memory import tune_glibc_malloc
from pagedllm.worker.cuda_graph import DecodeGraphRunner, boundary_state_bytes, capture_sizes
from pagedllm.worker.cuda_graph_verify import VerifyGraphRunner, logits_bytes as verify_logits_bytes
from pagedllm.worker.cuda_graph_verify import max_batch as verify_max_batch

logger = logging.getLogger("pagedllm")

DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


@dataclasses.dataclass
class StageHandle:
    """A step stage 0 submitted under pipeline parallelism and has not collected: rows (the
    last stage's residual stream at the step's logits rows, [R, hidden]) arrive through work."""

    step_id: int
    rows: torch.Tensor
    work: object
    num_sampled: int
    prompt_rows: list


@dataclasses.dataclass
class ModelRunnerOutput:
    """logits: float32 [R, vocab] for the sampled rows, in logits_indices order (None when the
    model picked the greedy ids itself: sampled_ids, int64 [R]).
    prompt_logits: request_id -> (first_position, float32 [num_rows, vocab]) where row i scores the
    prompt token at position first_position + i + 1."""

    logits: Optional[torch.Tensor]
    prompt_logits: dict[str, tuple[int, torch.Tensor]]
    sampled_ids: Optional[torch.Tensor] = None


class ModelRunner:
    """Loads `model_path` (a HF folder) with `model_config`, allocates the KV caches and runs steps.

    tp_group: this rank's tensor-parallel group (default: one rank). Every rank of a group runs
    the same steps in the same order (the collectives inside the model pair up): the ranks' KV
    pools hold their own heads of the same block ids (num_blocks is the smallest any rank can
    afford), and every rank computes the same logits (rank 0's are sampled)."""

    def __init__(
        self,
        model_path: str | Path,
        model_config: ModelConfig,
        *,
        async_scheduling: bool = False,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        num_blocks: int | None = None,
        load_format: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        enforce_eager: bool = False,
        seed: int = 0,
        tp_group: Optional[GroupCoordinator] = None,
        pp_group: Optional[PipelineGroup] = None,
        quantization: Optional[str] = None,
        gguf_file: Optional[Path] = None,
        verify_query_len: int = 1,
        verify_max_seqs: int = 0,
        kv_extra_bytes_per_block: int = 0,
        reserved_bytes: int = 0,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
    ):
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r} is not supported: use one of {list(LOAD_FORMATS)}")
        #: the KV caches' torch dtype (the model's, or FP8: model_executor/quantization/kv_cache.py)
        self.cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, device, model_config.head_dim,
                                                  calculate_kv_scales)
        self.config = model_config
        self.async_scheduling = async_scheduling
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.phase_seconds: dict[str, float] = {}
        self.graphs: DecodeGraphRunner | None = None
        #: speculative verification steps in CUDA graphs (queries of up to verify_query_len tokens)
        self.verify_graphs: VerifyGraphRunner | None = None
        self.verify_query_len = int(verify_query_len)
        self.verify_max_seqs = min(int(verify_max_seqs), max_num_seqs,
                                   verify_max_batch(max_model_len, max(2, self.verify_query_len)))
        self.tp = tp_group if tp_group is not None else GroupCoordinator.single(device)
        #: this rank's pipeline stage (distributed/pipeline.py; one stage by default)
        self.pp = pp_group if pp_group is not None else PipelineGroup.single(device)
        self._sends: list = []  # pipeline sends of the last submitted step (their works)
        ranks = self.tp.world_size * self.pp.world_size
        if device.type == "cpu":
            tune_glibc_malloc()
        start = time.perf_counter()
        self.model = LlamaForCausalLM(model_config, dtype, device, max_positions=max_model_len, tp_group=self.tp,
                                      pp_group=self.pp)
        quant = get_quantization_config(quantization, model_config.quantization, device, gguf_file,
                                        model_config.quantization_config, dtype)
        if load_format == "dummy":
            if quant is not None and quant.from_checkpoint:
                raise ValueError(f"load_format='dummy' cannot make {quant.name} checkpoint tensors: use a 16/32-bit "
                                 "model or an online method")
            init_dummy_weights(self.model, seed + self.tp.rank + self.tp.world_size * self.pp.rank)
        else:  # under tensor / pipeline parallelism each rank reads only its slices / layers
            self.model.load_weights(load_safetensors(model_path, lazy=ranks > 1), quant)
        self.model.eval()
        #: bytes of this rank's weights as loaded (before any CPU packing)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if quant is not None:
            before = sum(p.weight.numel() * p.weight.element_size() for p in self.model.projections())
            after = self.model.quantize_weights(quant)
            self.weight_bytes += after - before
            logger.info("quantization %s: decoder projections %.3f GiB (in %s) -> %.3f GiB; all weights now %.3f GiB",
                        quant.describe(), before / 2**30, str(dtype).removeprefix("torch."), after / 2**30,
                        self.weight_bytes / 2**30)
        if self.model.pack_weights():
            packed = self.model.lm_head if self.model.lm_head is not None else self.model.projections()[0]
            kind = type(packed.quant_method).__name__
            logger.info("projections pre-packed (bfloat16 on CPU): %s", {
                "AmxLinearMethod": "AMX kernel for steps of <= 128 tokens, oneDNN above",
                "PackedLinearMethod": "oneDNN"}.get(kind, kind))
        if self.model.pair_rotary_rows():
            logger.info("qkv rows in the paired rotary order: the qkv GEMV rotates in registers")
        if self.model.pair_gate_up_rows():
            logger.info("gate_up rows in the paired gate/up order: the gate_up GEMV writes SiLU(gate) * up")
        self._synchronize()
        self.phase_seconds["load_weights"] = time.perf_counter() - start
        logger.info("loaded %s (%s, %s, load_format=%s) in %.1f s%s", model_path, model_config.architecture, dtype,
                    load_format, self.phase_seconds["load_weights"], self._rank_note())
        scales_from = self.model.set_kv_cache_dtype(self.cache_dtype)
        elem = torch.empty((), dtype=self.cache_dtype).element_size()
        #: this rank's KV heads (all of them on one rank; a share, or one replicated head, under TP)
        self.num_kv_heads = self.model.num_kv_heads_per_rank
        #: this stage's decoder layers (all of them without pipeline parallelism)
        self.num_layers = len(self.model.layers)
        self.bytes_per_block = (2 * self.num_layers * block_size
                                * self.num_kv_heads * model_config.head_dim * elem)
        # (no CUDA graphs across pipeline stages: a step's forward waits on another process)
        use_graphs = device.type == "cuda" and not enforce_eager and self.pp.world_size == 1
        if num_blocks is None:
            # a draft model's KV blocks (same block ids, its own tensors) share the budget; its weights
            # (loaded later) are reserved on a GPU
            self.reserved_bytes = int(reserved_bytes)
            budget = self._kv_budget(kv_cache_memory_bytes, gpu_memory_utilization, use_graphs)
            num_blocks = budget // (self.bytes_per_block + int(kv_extra_bytes_per_block))
        num_blocks = self.tp.all_reduce_min(num_blocks)  # block ids mean the same on every rank
        num_blocks = self.pp.all_reduce_min(num_blocks)  # (and on every stage)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes leaves room for 0 KV blocks (one block of {block_size} tokens "
                f"needs {self.bytes_per_block} bytes)"
            )
        self.num_blocks = int(num_blocks)
        start = time.perf_counter()
        self.kv_caches = [
            ops.allocate_kv_cache(self.num_blocks, block_size, self.num_kv_heads, model_config.head_dim,
                                  self.cache_dtype, device)
            for _ in range(self.num_layers)
        ]
        self._synchronize()
        self.phase_seconds["allocate_kv_cache"] = time.perf_counter() - start
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s on %s) in %.2f s%s",
                    self.num_blocks, block_size, self.num_blocks * block_size,
                    self.num_blocks * self.bytes_per_block / 2**30, self.cache_dtype, device,
                    self.phase_seconds["allocate_kv_cache"], self._rank_note())
        if self.cache_dtype != dtype:
            model_elem = torch.empty((), dtype=dtype).element_size()
            logger.info("KV cache dtype %s (kv_cache_dtype=%r): %d bytes per element against %d in %s, %dx the "
                        "tokens in the same memory; k/v scales: %s", str(self.cache_dtype).removeprefix("torch."),
                        kv_cache_dtype, elem, model_elem, str(dtype).removeprefix("torch."), model_elem // elem,
                        "from the first batch (calculate_kv_scales)" if calculate_kv_scales else scales_from)
        if use_graphs:
            start = time.perf_counter()
            self.graphs = DecodeGraphRunner(self.model, self.kv_caches, max_num_seqs,
                                            self._max_blocks_per_seq(), device, placeholders=async_scheduling)
            self.phase_seconds["capture_cuda_graphs"] = time.perf_counter() - start
            logger.info("captured %d CUDA graphs for decode batches %s in %.1f s", len(self.graphs.sizes),
                        self.graphs.sizes, self.phase_seconds["capture_cuda_graphs"])
            if self.verify_query_len > 1 and self.verify_max_seqs > 0:
                start = time.perf_counter()
                self.verify_graphs = VerifyGraphRunner(self.model, self.kv_caches, self.verify_query_len,
                                                       self.verify_max_seqs, self._max_blocks_per_seq(), device,
                                                       max_model_len)
                logger.info("captured %d CUDA graphs for speculative verification (queries of <= %d tokens) of "
                            "batches %s in %.1f s", len(self.verify_graphs.sizes), self.verify_query_len,
                            self.verify_graphs.sizes, time.perf_counter() - start)
        #: calculate_kv_scales: the first batch with tokens runs eagerly (not in a CUDA graph, which
        #: would write the cache at the initial scales) and sets the layers' scales
        self._kv_scales_pending = bool(calculate_kv_scales)
        if calculate_kv_scales:  # after the profile run and the captures: the first real batch sets them
            self.model.enable_kv_scale_calculation()

    def _rank_note(self) -> str:
        notes = []
        if self.pp.world_size > 1:
            notes.append(f"pipeline stage {self.pp.rank}/{self.pp.world_size}: layers [{self.model.start_layer}, "
                         f"{self.model.end_layer})" + (" + embedding, norm, LM head" if self.pp.is_first else ""))
        if self.tp.world_size > 1:
            notes.append(f"tensor-parallel rank {self.tp.rank}/{self.tp.world_size}: "
                         f"{self.model.num_heads_per_rank} query / {self.model.num_kv_heads_per_rank} KV heads")
        if not notes:
            return ""
        return f" [{'; '.join(notes)}; weights {self.weight_bytes / 2**30:.3f} GiB]"

    @property
    def num_graph_replays(self) -> int:
        return ((0 if self.graphs is None else self.graphs.num_replays)
                + (0 if self.verify_graphs is None else self.verify_graphs.num_replays))

    def _max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _kv_budget(self, kv_cache_memory_bytes: int | None, gpu_memory_utilization: float,
                   use_graphs: bool = False) -> int:
        if kv_cache_memory_bytes is not None:
            if kv_cache_memory_bytes <= 0:
                raise ValueError(f"kv_cache_memory_bytes must be > 0, got {kv_cache_memory_bytes}")
            return int(kv_cache_memory_bytes)
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        start = time.perf_counter()
        activation_peak = self._profile_activation_peak()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        rows = min(self.max_num_seqs, self.max_num_batched_tokens)
        sampler = 3 * rows * self.config.vocab_size * 4
        # graphs: the shared logits buffer and the largest graph's pool (its bf16 and fp32 logits)
        graph_margin = 0
        if use_graphs:  # + the hand-over states of segmented graphs (pagedllm.worker.cuda_graph)
            graph_margin = (256 << 20) + 3 * self.max_num_seqs * self.config.vocab_size * 4 + boundary_state_bytes(
                capture_sizes(self.max_num_seqs), self.config.num_hidden_layers, self.config.hidden_size, self.dtype,
                segmented=not self.async_scheduling)
            if self.verify_query_len > 1 and self.verify_max_seqs > 0:  # their logits (and bf16 ones in the pool)
                graph_margin += 2 * verify_logits_bytes(self.verify_max_seqs, self.verify_query_len,
                                                        self.config.vocab_size)
        budget = (total * gpu_memory_utilization - used_by_others - weights - activation_peak - sampler - graph_margin
                  - getattr(self, "reserved_bytes", 0))
        self.phase_seconds["profile_run"] = time.perf_counter() - start
        logger.info("memory profile (%.2f s): total %.2f GiB x %.2f, other processes %.2f GiB, weights %.2f GiB, "
                    "activation peak %.2f GiB (%d tokens), sampler %.2f GiB, graphs %.2f GiB -> KV %.2f GiB",
                    self.phase_seconds["profile_run"], total / 2**30, gpu_memory_utilization,
                    used_by_others / 2**30, weights / 2**30, activation_peak / 2**30, self.max_num_batched_tokens,
                    sampler / 2**30, graph_margin / 2**30, max(budget, 0) / 2**30)
        if budget < self.bytes_per_block:
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization} leaves {budget / 2**30:.2f} GiB for the KV cache, "
                f"less than one block ({self.bytes_per_block} bytes): raise it or lower max_num_batched_tokens")
        return int(budget)

    @torch.inference_mode()
    def _profile_activation_peak(self) -> int:
        """Peak bytes a step of max_num_batched_tokens prefill tokens (logits for max_num_seqs rows)
        allocates beyond the weights, measured by one forward pass over a scratch one-layer cache."""
        cfg, dev, bs = self.config, self.device, self.block_size
        tokens = self.max_num_batched_tokens
        seq_len = min(tokens, self.max_model_len)
        num_seqs = -(-tokens // seq_len)
        lens = [seq_len] * (num_seqs - 1) + [tokens - seq_len * (num_seqs - 1)]
        blocks_per_seq = self._max_blocks_per_seq()
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        scratch = ops.allocate_kv_cache(num_seqs * blocks_per_seq, bs, self.num_kv_heads, cfg.head_dim,
                                        self.cache_dtype, dev)
        scratch_caches = [scratch] * len(self.model.layers)
        scratch_bytes = torch.cuda.memory_allocated(dev) - base
        tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=dev).view(num_seqs, blocks_per_seq)
        positions = torch.cat([torch.arange(n, dtype=torch.int64, device=dev) for n in lens])
        slots = torch.cat([i * blocks_per_seq * bs + torch.arange(n, device=dev) for i, n in enumerate(lens)])
        qsl = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device=dev)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                                 seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                                 query_start_loc=qsl, decode_only=False)
        rows = min(self.max_num_seqs, tokens)
        logits_indices = torch.linspace(0, tokens - 1, rows, device=dev).long()
        ids = torch.randint(0, cfg.vocab_size, (tokens,), device=dev)
        if self.pp.world_size == 1:
            logits = self.model(ids, positions, scratch_caches, meta, logits_indices)
        else:  # this stage's part, with its own input instead of the previous stage's
            m = self.model
            state = (m.embed(ids, positions) if self.pp.is_first
                     else (torch.randn(tokens, cfg.hidden_size, dtype=self.dtype, device=dev), None,
                           m.rope_state(positions)))
            stream = m.residual_stream(m.forward_layers(state, positions, scratch_caches, meta, 0, len(m.layers)))
            logits = m.compute_logits(stream.index_select(0, logits_indices)) if self.pp.is_first else stream
        del logits, scratch_caches
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base - scratch_bytes
        del scratch, tables, positions, slots, meta, ids
        torch.cuda.empty_cache()
        return int(peak)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def argmax_applies(self, num_sampled: int) -> bool:  # (never under tensor parallelism)
        """Whether execute_model can return the greedy ids of num_sampled rows itself (greedy_vocab)."""
        return self.model.argmax_applies(num_sampled)

    @torch.inference_mode()
    def execute_model(self, sched, greedy_vocab: int = 0, prev_sampled: Optional[torch.Tensor] = None
                      ) -> ModelRunnerOutput:
        """Run one SchedulerOutput (see engine contract); returns the logits to sample from.
        greedy_vocab > 0 (the sampler's argmax_suffices): where the model can, it returns the
        argmax over the first greedy_vocab logits of each sampled row instead (sampled_ids), the
        logits never written. prev_sampled: int64 [R'] on the device, the previous step's sampled
        ids (required when sched.num_placeholders > 0; ValueError without; on tensor-parallel ranks
        other than 0 a buffer of that shape that receives rank 0's ids). Under pipeline
        parallelism: collect_step(submit_step(...)) (stages after the first return no logits)."""
        if self.pp.world_size > 1:
            return self.collect_step(self.submit_step(sched, prev_sampled))
        prev_sampled, prompt_rows = self._begin_step(sched, prev_sampled)
        num_placeholders = int(sched.num_placeholders)
        num_sampled = int(sched.num_sampled)
        if (self.graphs is not None and not self._kv_scales_pending and sched.num_tokens > 0
                and int(sched.max_query_len) == 1
                and not prompt_rows and self.graphs.can_run(int(sched.num_seqs))):
            return ModelRunnerOutput(self.graphs.run(sched, prev_sampled if num_placeholders else None), {})
        if (self.verify_graphs is not None and not self._kv_scales_pending and sched.num_tokens > 0
                and not prompt_rows and self.verify_graphs.can_run(sched)):
            return ModelRunnerOutput(self.verify_graphs.run(sched), {})
        if sched.num_tokens == 0:
            return ModelRunnerOutput(torch.empty(0, self.config.vocab_size), {})
        logits_indices = self._logits_indices(sched, prompt_rows)
        meta = self._metadata(sched)
        input_ids = self._input_ids(sched, prev_sampled if num_placeholders else None)
        if greedy_vocab > 0 and not prompt_rows and self.argmax_applies(num_sampled):
            ids = self.model(input_ids, self._tensor(sched.positions), self.kv_caches, meta,
                             logits_indices, greedy_vocab=greedy_vocab)
            return ModelRunnerOutput(None, {}, ids)
        logits = self.model(input_ids, self._tensor(sched.positions), self.kv_caches, meta, logits_indices)
        return self._output(logits, num_sampled, prompt_rows)

    def _begin_step(self, sched, prev_sampled: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], list]:
        """Every rank's start of a step: the placeholder ids (rank 0's, broadcast over the first
        stage's TP group), the copy-on-write block copies, the KV-scale calibration state.
        Returns (prev_sampled, prompt_logprob_rows)."""
        num_placeholders = int(sched.num_placeholders)
        if num_placeholders and prev_sampled is None:
            raise ValueError(f"step {sched.step_id} has {num_placeholders} placeholder tokens but no prev_sampled ids")
        if num_placeholders and self.tp.world_size > 1 and self.pp.is_first:  # rank 0's (the others pass a buffer)
            prev_sampled = self.tp.broadcast(prev_sampled.to(self.device), src=0)
        copy_orders = sched.copy_orders
        if len(copy_orders):
            keys = [k for k, _ in self.kv_caches]
            values = [v for _, v in self.kv_caches]
            ops.copy_blocks(keys, values, self._tensor(np.ascontiguousarray(copy_orders)))
        if self._kv_scales_pending:  # calculate_kv_scales: the layers calibrate in the eager forward
            self._kv_scales_pending = any(layer.attn.calculate_kv_scales for layer in self.model.layers)
        return prev_sampled, list(getattr(sched, "prompt_logprob_rows", None) or [])

    def _logits_indices(self, sched, prompt_rows: list) -> torch.Tensor:
        """int64 [R]: the sampled rows, then each prompt-logprob request's rows."""
        rows = [self._tensor(sched.logits_indices)]
        for _, first_row, num_rows, _ in prompt_rows:
            rows.append(torch.arange(first_row, first_row + num_rows, dtype=torch.int64, device=self.device))
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _metadata(self, sched) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._tensor(sched.slot_mapping),
            block_tables=self._tensor(sched.block_tables),
            seq_lens=self._tensor(sched.seq_lens),
            query_start_loc=self._tensor(sched.query_start_loc),
            decode_only=int(sched.max_query_len) == 1,
        )

    @staticmethod
    def _output(logits: torch.Tensor, num_sampled: int, prompt_rows: list) -> ModelRunnerOutput:
        """logits of the sampled rows, then of each prompt-logprob request's rows -> the output."""
        prompt_logits: dict[str, tuple[int, torch.Tensor]] = {}
        offset = num_sampled
        for request_id, _, num_rows, first_position in prompt_rows:
            prompt_logits[request_id] = (int(first_position), logits[offset:offset + num_rows])
            offset += num_rows
        return ModelRunnerOutput(logits[:num_sampled], prompt_logits)

    # ---- pipeline parallelism (distributed/pipeline.py) --------------------------------------
    @torch.inference_mode()
    def submit_step(self, sched, prev_sampled: Optional[torch.Tensor] = None) -> Optional["StageHandle"]:
        """This pipeline stage's part of a step, without waiting for the later stages: stage 0
        embeds, the others receive the previous stage's residual stream [T, hidden]; each runs its
        layers and sends the stream on — the last stage only its rows to sample, back to stage 0.
        Stage 0 returns a StageHandle for collect_step (those rows' receive already posted); the
        other stages, and a step without tokens, return None. Steps must be submitted in the same
        order on every rank (the scheduler's), and stage 0 collects them in that order."""
        for work in self._sends:  # the previous step's sends: their buffers may be reused now
            work.wait()
        self._sends.clear()
        prev_sampled, prompt_rows = self._begin_step(sched, prev_sampled)
        if sched.num_tokens == 0:
            return None
        m, pp = self.model, self.pp
        logits_indices = self._logits_indices(sched, prompt_rows)
        meta = self._metadata(sched)
        positions = self._tensor(sched.positions)
        if pp.is_first:
            state = m.embed(self._input_ids(sched, prev_sampled if int(sched.num_placeholders) else None), positions)
        else:
            stream = pp.recv((int(sched.num_tokens), self.config.hidden_size), self.dtype, pp.rank - 1)
            state = (stream, None, m.rope_state(positions))
        stream = m.residual_stream(m.forward_layers(state, positions, self.kv_caches, meta, 0, len(m.layers)))
        if not pp.is_last:
            self._sends.append(pp.isend(stream, pp.rank + 1))
        else:
            self._sends.append(pp.isend(stream.index_select(0, logits_indices), 0))
        if not pp.is_first:
            return None
        rows, work = pp.irecv((int(logits_indices.shape[0]), self.config.hidden_size), self.dtype, pp.world_size - 1)
        return StageHandle(int(sched.step_id), rows, work, int(sched.num_sampled), prompt_rows)

    @torch.inference_mode()
    def collect_step(self, handle: Optional["StageHandle"]) -> ModelRunnerOutput:
        """Stage 0: wait for a submitted step's rows from the last stage and compute their float32
        logits (vocabulary-parallel over the stage's TP group: its ranks collect together).
        handle None (a later stage, an empty step): no logits."""
        if handle is None:
            return ModelRunnerOutput(torch.empty(0, self.config.vocab_size), {})
        handle.work.wait()
        return self._output(self.model.compute_logits(handle.rows), handle.num_sampled, handle.prompt_rows)

    def _input_ids(self, sched, prev_sampled: Optional[torch.Tensor]) -> torch.Tensor:
        """The step's token ids on the device, placeholders filled from prev_sampled."""
        if prev_sampled is None:
            return self._tensor(sched.input_ids)
        ids = self._tensor(sched.input_ids.copy() if self.device.type == "cpu" else sched.input_ids)
        return ops.fill_placeholder_ids(ids, self._tensor(sched.prev_sample_rows), prev_sampled.to(self.device))

    def shutdown(self) -> None:
        """Drop the weights and the KV caches (memory is returned when no one else holds them)."""
        self.graphs = None
        self.verify_graphs = None
        self.kv_caches = []
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
