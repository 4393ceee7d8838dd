"""The Executor: what the engine calls to run a step's forward pass, on one device or several.

    executor = make_executor(config)              # executor/__init__.py
    run = executor.execute_model(sched, greedy_vocab, prev_sampled)   # ModelRunnerOutput (rank 0's)
    executor.shutdown()                           # frees the weights and KV caches, stops workers

Under pipeline parallelism the engine keeps up to executor.pipeline_depth steps in flight:
handle = executor.submit(sched) ... run = executor.collect(handle), in submission order.

Implementations: UniprocExecutor (one ModelRunner in this process) and MultiprocExecutor
(tensor parallelism: rank 0 in this process, ranks 1..N-1 in worker processes). The engine's
scheduler, KV manager, sampler and detokenizer stay in this process either way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from pagedllm.model_executor.config import ModelConfig
from pagedllm.worker.model_runner import ModelRunner, ModelRunnerOutput


@dataclasses.dataclass
class ExecutorConfig:
    """What every rank needs to build its ModelRunner (picklable: it reaches worker processes)."""

    model_path: Path
    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    block_size: int
    max_model_len: int
    kv_cache_memory_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    num_blocks: Optional[int] = None
    load_format: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enforce_eager: bool = False
    seed: int = 0
    async_scheduling: bool = False
    #: vLLM's quantization= name (model_executor/quantization), None for the checkpoint's weights
    quantization: Optional[str] = None
    #: the GGUF file the model came from (quantization="gguf" reads its quantized tensors), else None
    gguf_file: Optional[Path] = None
    tensor_parallel_size: int = 1
    #: pipeline stages (distributed/pipeline.py); the executor runs tensor x pipeline ranks
    pipeline_parallel_size: int = 1
    #: layers per stage, decided once in the driver (pp_partition: PAGEDLLM_PP_LAYER_PARTITION is
    #: read there, so Ray actors on other hosts get the same split); None with one stage
    pipeline_partition: Optional[list[int]] = None
    #: "mp" (or None) under tensor parallelism; "uni" for one rank
    distributed_executor_backend: Optional[str] = None
    #: speculative decoding: verification steps of queries up to this many tokens (1 + k) of up to
    #: verify_max_seqs sequences run in CUDA graphs (pagedllm.worker.cuda_graph_verify)
    verify_query_len: int = 1
    verify_max_seqs: int = 0
    #: a draft model's KV bytes per block (its cache uses the same block ids) and its weights' bytes
    #: (reserved on a GPU before the KV budget), so that both fit
    kv_extra_bytes_per_block: int = 0
    reserved_bytes: int = 0
    #: vLLM's kv_cache_dtype ("auto", "fp8", "fp8_e4m3", "fp8_e5m2") and calculate_kv_scales
    #: (model_executor/quantization/kv_cache.py)
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False

    def runner_kwargs(self) -> dict:
        return dict(dtype=self.dtype, block_size=self.block_size, max_model_len=self.max_model_len,
                    kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                    gpu_memory_utilization=self.gpu_memory_utilization, num_blocks=self.num_blocks,
                    load_format=self.load_format, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens, enforce_eager=self.enforce_eager,
                    seed=self.seed, async_scheduling=self.async_scheduling, quantization=self.quantization,
                    gguf_file=self.gguf_file, verify_query_len=self.verify_query_len,
                    verify_max_seqs=self.verify_max_seqs, kv_extra_bytes_per_block=self.kv_extra_bytes_per_block,
                    reserved_bytes=self.reserved_bytes, kv_cache_dtype=self.kv_cache_dtype,
                    calculate_kv_scales=self.calculate_kv_scales)


class Executor:
    """The interface (module docstring). driver_runner: the ModelRunner in this process (rank 0)."""

    driver_runner: Optional[ModelRunner]

    @property
    def num_blocks(self) -> int:
        return self.driver_runner.num_blocks

    @property
    def num_graph_replays(self) -> int:
        return 0 if self.driver_runner is None else self.driver_runner.num_graph_replays

    def argmax_applies(self, num_sampled: int) -> bool:
        return self.driver_runner.argmax_applies(num_sampled)

    def execute_model(self, sched, greedy_vocab: int = 0,
                      prev_sampled: Optional[torch.Tensor] = None) -> ModelRunnerOutput:
        raise NotImplementedError

    #: steps the engine may keep in flight (submit ... collect): pipeline_parallel_size, else 1
    pipeline_depth: int = 1

    def submit(self, sched, prev_sampled: Optional[torch.Tensor] = None):
        """Start a step (pipeline parallelism: stage 0's part, the later stages running behind it);
        returns a handle for collect(). Steps are collected in the order they were submitted."""
        return self.execute_model(sched, prev_sampled=prev_sampled)

    def collect(self, handle) -> ModelRunnerOutput:
        """The output of a submitted step (waits for it)."""
        return handle

    def check_health(self) -> None:
        """Raise RuntimeError when a rank has stopped."""

    def shutdown(self) -> None:
        raise NotImplementedError
