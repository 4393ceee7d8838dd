"""ModelRunner: owns the model weights and the paged KV caches, and executes one scheduler step.

execute_model(SchedulerOutput) -> ModelRunnerOutput:
  1. copy-on-write orders first (pagedllm.ops.copy_blocks over every layer's caches);
  2. the step's flat buffers are wrapped zero-copy (torch.from_numpy) and moved to the device;
  3. the model runs over all T tokens; logits are computed only for the sampled rows
     (logits_indices, R of them) and for prompt-logprob rows when a request asked for them.

KV pool size: kv_cache_memory_bytes (default 4 GiB on CPU; on CUDA gpu_memory_utilization of the
device's memory minus what is already allocated) / bytes per block, where a block holds
block_size tokens of K and V for every layer: 2 * L * block_size * Hkv * D * dtype bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import torch

from pagedllm import ops
from pagedllm.model_executor.attention import AttentionMetadata
from pagedllm.model_executor.config import ModelConfig
from pagedllm.model_executor.loader import load_safetensors
from pagedllm.model_executor.models import LlamaForCausalLM

logger = logging.getLogger("pagedllm")

DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


@dataclasses.dataclass
class ModelRunnerOutput:
    """logits: float32 [R, vocab] for the sampled rows, in logits_indices order.
    prompt_logits: request_id -> (first_position, float32 [num_rows, vocab]) where row i scores the
    prompt token at position first_position + i + 1."""

    logits: torch.Tensor
    prompt_logits: dict[str, tuple[int, torch.Tensor]]


class ModelRunner:
    """Loads `model_path` (a HF folder) with `model_config`, allocates the KV caches and runs steps."""

    def __init__(
        self,
        model_path: str | Path,
        model_config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        num_blocks: int | None = None,
    ):
        self.config = model_config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        start = time.perf_counter()
        self.model = LlamaForCausalLM(model_config, dtype, device, max_positions=max_model_len)
        self.model.load_weights(load_safetensors(model_path))
        self.model.eval()
        if self.model.pack_weights():
            logger.info("projections pre-packed for oneDNN (bfloat16 on CPU)")
        logger.info("loaded %s (%s, %s) in %.1f s", model_path, model_config.architecture, dtype,
                    time.perf_counter() - start)
        elem = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_block = (2 * model_config.num_hidden_layers * block_size
                                * model_config.num_key_value_heads * model_config.head_dim * elem)
        if num_blocks is None:
            budget = self._kv_budget(kv_cache_memory_bytes, gpu_memory_utilization)
            num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes leaves room for 0 KV blocks (one block of {block_size} tokens "
                f"needs {self.bytes_per_block} bytes)"
            )
        self.num_blocks = int(num_blocks)
        self.kv_caches = [
            ops.allocate_kv_cache(self.num_blocks, block_size, model_config.num_key_value_heads,
                                  model_config.head_dim, dtype, device)
            for _ in range(model_config.num_hidden_layers)
        ]
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s on %s)",
                    self.num_blocks, block_size, self.num_blocks * block_size,
                    self.num_blocks * self.bytes_per_block / 2**30, dtype, device)

    def _kv_budget(self, kv_cache_memory_bytes: int | None, gpu_memory_utilization: float) -> int:
        if kv_cache_memory_bytes is not None:
            if kv_cache_memory_bytes <= 0:
                raise ValueError(f"kv_cache_memory_bytes must be > 0, got {kv_cache_memory_bytes}")
            return int(kv_cache_memory_bytes)
        if self.device.type == "cuda":
            if not 0 < gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free - torch.cuda.memory_reserved(self.device)
            # activations of a step: leave 10% of the budget for them
            budget = total * gpu_memory_utilization - used_by_others - torch.cuda.memory_allocated(self.device)
            return int(max(budget * 0.9, 0))
        return DEFAULT_CPU_KV_CACHE_BYTES

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute_model(self, sched) -> ModelRunnerOutput:
        """Run one SchedulerOutput (see engine contract); returns the logits to sample from."""
        copy_orders = sched.copy_orders
        if len(copy_orders):
            keys = [k for k, _ in self.kv_caches]
            values = [v for _, v in self.kv_caches]
            ops.copy_blocks(keys, values, self._tensor(np.ascontiguousarray(copy_orders)))
        num_sampled = int(sched.num_sampled)
        rows = [self._tensor(sched.logits_indices)]
        prompt_rows = list(getattr(sched, "prompt_logprob_rows", None) or [])
        for _, first_row, num_rows, _ in prompt_rows:
            rows.append(torch.arange(first_row, first_row + num_rows, dtype=torch.int64, device=self.device))
        logits_indices = rows[0] if len(rows) == 1 else torch.cat(rows)
        vocab = self.config.vocab_size
        if sched.num_tokens == 0:
            return ModelRunnerOutput(torch.empty(0, vocab), {})
        meta = AttentionMetadata(
            slot_mapping=self._tensor(sched.slot_mapping),
            block_tables=self._tensor(sched.block_tables),
            seq_lens=self._tensor(sched.seq_lens),
            query_start_loc=self._tensor(sched.query_start_loc),
            decode_only=int(sched.max_query_len) == 1,
        )
        logits = self.model(self._tensor(sched.input_ids), self._tensor(sched.positions), self.kv_caches,
                            meta, logits_indices)
        prompt_logits: dict[str, tuple[int, torch.Tensor]] = {}
        offset = num_sampled
        for request_id, _, num_rows, first_position in prompt_rows:
            prompt_logits[request_id] = (int(first_position), logits[offset:offset + num_rows])
            offset += num_rows
        return ModelRunnerOutput(logits[:num_sampled], prompt_logits)

    def shutdown(self) -> None:
        """Drop the weights and the KV caches (memory is returned when no one else holds them)."""
        self.kv_caches = []
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
