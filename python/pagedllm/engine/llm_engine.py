"""LLMEngine: one engine step = native schedule -> model runner -> sampler -> native update ->
detokenization and stop strings -> RequestOutputs.

    out = core.schedule()                       # flat batch buffers (C++), zero-copy numpy views
    logits = executor.execute_model(out)        # embeddings ... paged attention ... logits rows
    ids = sampler(logits, out.sample_seq_ids)   # next tokens (+ logprobs)
    result = core.update_from_output(out, ids)  # append, EOS/stop ids/max_tokens, free finished
    core.release(out)
    text / stop strings per sequence            # a stop string -> core.finish_sequence(seq, str)

Async output processing (async_output_processing=True, as vLLM's async output processor): the
last item — detokenization and building RequestOutputs — of step N runs in step N + 1, after
step N + 1's forward pass is launched and before its sampler waits for the GPU, so the host work
hides behind the GPU work. step() then returns the outputs of the previous step; the sampler
still sees every token of step N before it samples step N + 1. It applies only while no
unfinished request has stop strings (they are matched during detokenization and can end a
sequence before the next step is scheduled); such steps are processed at once.

Async scheduling (async_scheduling=True; "auto": on CUDA; vLLM's --async-scheduling): step N + 1
is scheduled and launched BEFORE step N's sampled tokens reach the host. The native scheduler
gives each sequence that step N samples a placeholder decode in step N + 1 (pagedllm/scheduler.h,
"Async scheduling"); the model runner fills the placeholder ids from step N's sampled ids on the
device. Then the host waits for step N's ids, applies them (update_from_output, detokenization,
stop strings) and launches step N + 1's sampling — all while the device runs step N + 1:

    sched = core.schedule()                         # N + 1, with placeholders for N's samples
    run = executor.execute_model(sched, prev_sampled=pending.device_ids)   # launched, not waited
    ids = pending.result()                          # N's ids (copied behind N's sampling)
    core.update_from_output(pending_sched, ids); outputs of N; stop strings; core.release(...)
    pending = sampler.sample_async(run.logits, sched.sample_seq_ids)      # N + 1's, on the device

A sequence that step N ends (EOS, a stop id or string) has a wasted row in step N + 1, which the
engine does not sample and the scheduler ignores. Sampling sees every earlier token (penalties,
min_tokens): step N + 1 is sampled after step N's update. step() returns step N's outputs.

The executor (pagedllm.executor) runs the forward pass on one device, or under tensor parallelism
(tensor_parallel_size > 1) on rank 0 here while worker processes run the other ranks on the same
step; sampling, the scheduler and detokenization stay here either way.

The LLM class (offline API) and AsyncLLM (server) both drive this object from one thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
from typing import Any, Optional

import numpy as np
import torch

from pagedllm import _C, ops
from pagedllm.metrics import Counter, HistogramData, Metric, metrics_from_stats
from pagedllm.model_executor.config import ModelConfig, resolve_dtype
from pagedllm.model_executor.loader import gguf_source, resolve_model
from pagedllm.output_processor import OutputProcessor, RequestSetupError
from pagedllm.outputs import RequestOutput
from pagedllm.sample import Sampler, compute_prompt_logprobs
from pagedllm.sample.sampler import PendingSample
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, truncate_prompt_ids
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.executor import EXECUTOR_BACKENDS, ExecutorConfig, make_executor
from pagedllm.distributed.pipeline import pp_partition
from pagedllm.model_executor.layers.linear import partition_heads
from pagedllm.model_executor.quantization import get_quantization_config, required_dtype
from pagedllm.model_executor.quantization.kv_cache import resolve_kv_cache_dtype

logger = logging.getLogger("pagedllm")

_ITERATION_TOKEN_BOUNDS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_ITERATION_SEQ_BOUNDS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


@dataclasses.dataclass
class EngineArgs:
    """Engine settings (names and defaults of vLLM's LLM(...) arguments)."""

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: Any = "auto"
    max_model_len: Optional[int] = None
    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    #: pipeline stages (vLLM's name; distributed/pipeline.py): the decoder layers split into this many
    #: contiguous stages of tensor_parallel_size ranks each
    pipeline_parallel_size: int = 1
    #: engine replicas behind one API server (vLLM's name; engine/data_parallel.py): an LLMEngine is
    #: one replica, so only `pagedllm serve --data-parallel-size D` takes D > 1
    data_parallel_size: int = 1
    #: how ranks run under tensor / pipeline parallelism (vLLM's name): "mp" (worker processes of this
    #: host), "ray" (Ray actors, executor/ray_executor.py), "uni" (one rank)
    distributed_executor_backend: Optional[str] = None
    #: weight quantization (vLLM's name): None, or "int8" (online, CPU); model_executor/quantization
    quantization: Optional[str] = None
    device: str = "auto"
    num_gpu_blocks_override: Optional[int] = None
    load_format: str = "auto"
    #: True: deferred output processing (see the module docstring); "auto": True on CUDA
    async_output_processing: Any = False
    #: True: schedule step N + 1 before step N's tokens are known (module docstring); "auto": on CUDA.
    #: With speculative_config, steps that speculate are not pipelined (pagedllm/scheduler.h)
    async_scheduling: Any = "auto"
    #: vLLM's speculative_config (dict or JSON text): n-gram speculative decoding
    #: (pagedllm.spec_decode.config; docs/speculative_decoding.md)
    speculative_config: Any = None
    #: the KV cache's dtype (vLLM's names): "auto" (the model's), "fp8" = "fp8_e4m3", "fp8_e5m2";
    #: calculate_kv_scales: FP8 scales from the first batch (docs/fp8_kv_cache.md)
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False


class LLMEngine:
    """Owns the native EngineCore, the ModelRunner (weights + KV cache), the Sampler and the
    tokenizer. Not thread-safe: one thread calls add_request / abort_request / step."""

    def __init__(self, args: EngineArgs):
        tp = args.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        pp = args.pipeline_parallel_size
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be an int >= 1, got {pp!r}")
        if args.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"distributed_executor_backend={args.distributed_executor_backend!r} is not supported: use "
                             f"one of {list(EXECUTOR_BACKENDS)}")
        if args.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {args.scheduling_policy!r}")
        if args.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={args.data_parallel_size!r}: an engine is one replica; serve "
                             "replicas with `pagedllm serve --data-parallel-size D` (engine/data_parallel.py)")
        if args.block_size not in ops.SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size={args.block_size} is not supported: use one of {list(ops.SUPPORTED_BLOCK_SIZES)}")
        aop = _tri_state("async_output_processing", args.async_output_processing)
        sched_async = _tri_state("async_scheduling", args.async_scheduling)
        self.args = args
        self.device = _resolve_device(args.device)
        #: the checked speculative_config, or None
        self.speculative_config = SpeculativeConfig.from_user(args.speculative_config, self.device.type)
        drafting = self.speculative_config is not None and self.speculative_config.method == "draft_model"
        if drafting and sched_async is True:
            raise ValueError("speculative_config with a draft model does not work with async_scheduling=True: "
                             "leave it at 'auto' or False")
        self.async_scheduling = self.device.type == "cuda" and not drafting if sched_async == "auto" else sched_async
        if pp > 1:  # stages keep different steps in flight instead (placeholders would wait on the last stage)
            if sched_async is True:
                raise ValueError("async_scheduling=True does not work with pipeline_parallel_size > 1 (the engine "
                                 "keeps one step per stage in flight instead): leave it at 'auto' or False")
            self.async_scheduling = False
        self.model_path = resolve_model(args.model)
        self.model_name = args.model or "HuggingFaceTB/SmolLM2-135M-Instruct"
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        cfg = self.model_config
        if cfg.head_dim not in ops.SUPPORTED_HEAD_SIZES:
            raise ValueError(f"head_dim={cfg.head_dim} is not supported by the attention kernels: "
                             f"{list(ops.SUPPORTED_HEAD_SIZES)}")
        if tp > 1:  # before any process starts
            _check_tensor_parallel(cfg, tp, self.device, args.distributed_executor_backend)
        if pp > 1:
            _check_pipeline_parallel(cfg, tp, pp, self.device, self.speculative_config,
                                     args.distributed_executor_backend)
        self.dtype = resolve_dtype(args.dtype, cfg.dtype, self.device)
        needed = required_dtype(args.quantization, cfg.quantization, self.device)
        if needed is not None and args.dtype in (None, "auto") and self.dtype != needed:
            logger.info("dtype auto: %s (the checkpoint's is %s) for quantization's CUDA kernels",
                        str(needed).removeprefix("torch."), str(self.dtype).removeprefix("torch."))
            self.dtype = needed
        self.gguf_file = gguf_source(args.model)
        get_quantization_config(args.quantization, cfg.quantization, self.device, self.gguf_file,
                                cfg.quantization_config, self.dtype)  # ValueError before any load
        #: the KV caches' torch dtype (ValueError before any load)
        self.cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype, self.device, cfg.head_dim,
                                                  bool(args.calculate_kv_scales))
        self.max_model_len = _max_model_len(args.max_model_len, cfg)
        self.max_num_batched_tokens = _batched_tokens(args, self.max_model_len)
        self.draft = _DraftSpec.check(self.speculative_config, cfg, self.dtype, self.device, self.max_model_len,
                                      args.block_size, tp) if drafting else None
        # The tokenizer (mostly Python imports) loads in a thread while the weights (native copies
        # that release the GIL) load here: start-up is about the longer of the two.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenizer") as pool:
            tokenizer = pool.submit(_load_tokenizer, args.tokenizer or self.model_path, cfg.vocab_size,
                                    args.load_format == "dummy")
            self.executor = make_executor(ExecutorConfig(
                self.model_path, cfg, dtype=self.dtype, device=self.device, block_size=args.block_size,
                max_model_len=self.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization, num_blocks=args.num_gpu_blocks_override,
                load_format=args.load_format, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens, enforce_eager=args.enforce_eager, seed=args.seed,
                async_scheduling=self.async_scheduling, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                pipeline_partition=pp_partition(cfg.num_hidden_layers, pp) if pp > 1 else None,
                quantization=args.quantization,
                gguf_file=self.gguf_file, distributed_executor_backend=args.distributed_executor_backend,
                kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=bool(args.calculate_kv_scales),
                **self._verify_graph_args(),
                **({} if self.draft is None else self.draft.executor_args()),
            ))
            #: rank 0's ModelRunner (in this process)
            self.runner = self.executor.driver_runner
            try:
                self.tokenizer = tokenizer.result()
            except BaseException:
                self.executor.shutdown()  # no worker process outlives a failed start
                raise
        #: the draft model's proposer (speculative_config method "draft_model"), else None
        self.proposer = None
        if self.draft is not None:
            try:
                self.proposer = self.draft.build(self.executor.num_blocks, args)
            except BaseException:
                self.executor.shutdown()
                raise
        self.eos_token_ids = _eos_token_ids(self.model_path, cfg, self.tokenizer)
        self.generation_defaults = _generation_defaults(self.model_path)
        ec = _C.EngineConfig()
        ec.num_blocks = self.executor.num_blocks
        ec.block_size = args.block_size
        ec.max_num_seqs = args.max_num_seqs
        ec.max_num_batched_tokens = self.max_num_batched_tokens
        ec.max_model_len = self.max_model_len
        ec.enable_prefix_caching = args.enable_prefix_caching
        ec.enable_chunked_prefill = args.enable_chunked_prefill
        ec.scheduling_policy = args.scheduling_policy
        ec.async_scheduling = self.async_scheduling
        if self.speculative_config is not None:
            ec.speculative = self.speculative_config.native()
            logger.info("speculative decoding: %s", self.speculative_config)
        self.core = _C.EngineCore(ec)
        self.sampler = Sampler(cfg.vocab_size, seed=args.seed)
        self.output_processor = OutputProcessor(self.tokenizer, self.sampler, self.eos_token_ids)
        self.histograms = {
            "iteration_tokens_total": HistogramData(_ITERATION_TOKEN_BOUNDS),
            "iteration_num_seqs": HistogramData(_ITERATION_SEQ_BOUNDS),
        }
        if pp > 1:  # steps in flight when one is submitted (itself included): >= 2 = stages busy at once
            self.histograms["pipeline_steps_in_flight"] = HistogramData(list(range(1, pp + 1)))
        self._ids = itertools.count()
        self.async_output_processing = self.device.type == "cuda" if aop == "auto" else bool(aop)
        self._pending = None  # (UpdateResult, sample_seq_ids, SamplerOutput) of a deferred step
        self._ready: list[RequestOutput] = []  # outputs of a deferred step, returned by the next step()
        self._inflight: Optional[_InFlight] = None  # async scheduling: the launched, not yet updated step
        #: pipeline parallelism: (SchedulerOutput, executor handle) of submitted steps, oldest first
        self._pipeline: collections.deque = collections.deque()
        # structured outputs: requests whose grammar compiles off the step loop, (Future, token ids, RequestParams)
        self._compiling: dict[str, tuple[concurrent.futures.Future, np.ndarray, Any]] = {}

    def _verify_graph_args(self) -> dict:
        """CUDA graphs for verification steps: queries of 1 + k tokens, batches below
        disable_by_batch_size (at most 64: larger speculating batches run eagerly)."""
        spec = self.speculative_config
        if spec is None:
            return {}
        limit = spec.disable_by_batch_size - 1 if spec.disable_by_batch_size > 0 else 64
        return dict(verify_query_len=1 + spec.num_speculative_tokens,
                    verify_max_seqs=max(0, min(limit, 64, self.args.max_num_seqs)))

    # ---- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        cache_salt: str = "",
    ) -> None:
        """Queue a request. Raises ValueError (nothing queued) for an empty prompt, token ids
        outside the vocabulary, a prompt of max_model_len tokens or more, or bad params.
        cache_salt: extra prefix-cache key (requests with different salts share no blocks).
        params.truncate_prompt_tokens keeps the prompt's last k tokens (a truncated prompt's text
        is dropped: the outputs' prompt and prompt_token_ids are the kept tokens')."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.truncate_prompt_tokens is not None:
            kept = truncate_prompt_ids(list(prompt_token_ids), params.truncate_prompt_tokens, self.max_model_len)
            if len(kept) < len(prompt_token_ids):
                prompt_token_ids, prompt = kept, None
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty (0 tokens)")
        try:
            arr = np.asarray(prompt_token_ids, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):  # an id beyond int64, or not an integer
            bad_id = next((t for t in prompt_token_ids if not (isinstance(t, (int, np.integer))
                                                               and 0 <= t < self.model_config.vocab_size)), None)
            raise ValueError(f"prompt token id {bad_id!r} is outside the vocabulary [0, "
                             f"{self.model_config.vocab_size})") from None
        bad = arr[(arr < 0) | (arr >= self.model_config.vocab_size)]
        if bad.size:
            raise ValueError(f"prompt token id {int(bad[0])} is outside the vocabulary [0, {self.model_config.vocab_size})")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, but max_model_len is {self.max_model_len}: a prompt must "
                             "be shorter than max_model_len")
        if priority != 0 and self.args.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} given, but scheduling_policy is 'fcfs': use scheduling_policy='priority'")
        params.verify_for_vocab(self.model_config.vocab_size)
        rp = params.to_request_params(self.eos_token_ids, priority=priority, arrival_time=arrival_time,
                                     cache_salt=cache_salt)
        room = self.max_model_len - n  # generation stops at max_model_len ("length")
        if rp.max_tokens < 0 or rp.max_tokens > room:
            rp.max_tokens = room
        rp.min_tokens = min(rp.min_tokens, rp.max_tokens)
        grammar = self.output_processor.add_request(request_id, prompt, list(map(int, prompt_token_ids)), params)
        # a grammar advances one accepted token at a time: such requests get no drafts
        rp.allow_speculation = grammar is None
        if grammar is not None and not grammar.done():  # scheduled once its grammar is compiled (_admit_compiled)
            self._compiling[request_id] = (grammar, arr.astype(np.int32), rp)
            return
        self._add_to_core(request_id, arr.astype(np.int32), rp, grammar)

    def _add_to_core(self, request_id: str, token_ids: np.ndarray, rp, grammar) -> None:
        try:
            if grammar is not None and grammar.exception() is not None:  # the request is dropped, nothing queued
                raise ValueError(f"structured_outputs: the grammar failed to compile: {grammar.exception()}")
            self.core.add_request(request_id, token_ids, rp)
        except BaseException:
            self.output_processor.abort_request(request_id)
            raise

    def _admit_compiled(self) -> None:
        """Hand the requests whose grammars finished compiling to the scheduler (structured
        outputs compile off the step loop). Those whose compile failed (or that the scheduler
        refused) are dropped and named by a RequestSetupError after the others are admitted (the
        engine loop fails those requests alone). With nothing else to run, waits briefly for the
        first compile."""
        if not self._compiling:
            return
        if (not self.core.has_unfinished_requests() and self._inflight is None and self._pending is None
                and not self._pipeline):
            concurrent.futures.wait([f for f, _, _ in self._compiling.values()], timeout=0.01,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        failed: dict[str, BaseException] = {}
        for request_id, (grammar, token_ids, rp) in list(self._compiling.items()):
            if not grammar.done():
                continue
            del self._compiling[request_id]
            if grammar.exception() is not None:  # the request alone fails; the engine goes on
                failed[request_id] = ValueError(f"structured_outputs: the grammar failed to compile: "
                                                f"{grammar.exception()}")
                self.output_processor.abort_request(request_id)
                continue
            try:
                self.core.add_request(request_id, token_ids, rp)
            except Exception as exc:  # noqa: BLE001 - as above
                failed[request_id] = exc
                self.output_processor.abort_request(request_id)
        if failed:
            raise RequestSetupError(failed)

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Abort a request (finish_reason "abort"); returns its final output, None if unknown.
        A request that had already finished in a deferred step returns that final output. Outputs
        of the request that the flushed steps produced and step() has not returned yet are folded
        into the returned one (DELTA: their tokens, text and logprobs come first), so nothing of
        the request is returned after its final output."""
        if self._compiling.pop(request_id, None) is not None:  # never reached the scheduler
            return self.output_processor.abort_request(request_id)
        self._flush_pending()
        self._flush_inflight()
        self._flush_pipeline()
        state = self.output_processor.requests.get(request_id)
        delta = state is not None and state.params.output_kind == RequestOutputKind.DELTA
        earlier = [o for o in self._ready if o.request_id == request_id]
        if earlier:
            self._ready = [o for o in self._ready if o.request_id != request_id]
        self.core.abort_request(request_id)
        out = self.output_processor.abort_request(request_id)
        if out is None:  # finished in a flushed step: its final output is the last of `earlier`
            return earlier[-1] if earlier and earlier[-1].finished else None
        if delta:
            for prev in earlier:
                _prepend_delta(out, prev)
        return out

    def has_unfinished_requests(self) -> bool:
        return (self.core.has_unfinished_requests() or self._pending is not None or self._inflight is not None
                or bool(self._pipeline) or bool(self._ready) or bool(self._compiling))

    def has_request(self, request_id: str) -> bool:
        return self.output_processor.has_request(request_id)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the RequestOutputs it produced (per each request's
        output_kind; finished requests included). An exception leaves no KV block leaked: the
        step's sequences are rescheduled (release of a step that was never updated).
        RequestSetupError names requests whose setup failed: abort those; the others go on."""
        self._admit_compiled()
        if self.async_scheduling:
            return self._step_async()
        if self.executor.pipeline_depth > 1:
            return self._step_pipelined()
        sched = self.core.schedule()
        stops: list[tuple[int, str]] = []
        try:
            if sched.num_tokens == 0:
                return self._take_ready()
            proc = self.output_processor
            proc.on_schedule(sched)
            self.histograms["iteration_tokens_total"].observe(int(sched.num_tokens))
            self.histograms["iteration_num_seqs"].observe(int(sched.num_seqs))
            # a plain greedy step on a model that can take the argmax in its LM head (the CPU's AMX
            # head) gets the ids without logits; the check costs host time, so only there
            greedy = (self.executor.argmax_applies(len(sched.sample_seq_ids))
                      and self.sampler.argmax_suffices(sched.sample_seq_ids))
            if not greedy and self._pending is None and self.device.type == "cuda":
                # structured outputs: the token bitmask is filled on other cores while this thread
                # launches the forward pass (on a CPU those cores run the forward pass itself)
                self.sampler.start_grammar(sched.sample_seq_ids)
            if self.proposer is not None:  # the draft model's tokens into the step's draft rows
                self.proposer.propose(sched)
            run = self.executor.execute_model(sched, greedy_vocab=self.sampler.vocab_size if greedy else 0)
            # the previous step's output processing, while the GPU runs this step's forward pass
            stops += self._flush_pending()
            if run.sampled_ids is not None:  # the model took the argmax itself (no logits written)
                sampled = self.sampler.from_argmax(run.sampled_ids)
            else:
                sampled = self.sampler(run.logits, sched.sample_seq_ids,
                                       sched.draft_token_ids if sched.num_draft_tokens else None)
            self.executor.check_health()  # a rank that died during the step: its tokens are not used
            self._add_prompt_logprobs(run.prompt_logits)
            result = self.core.update_from_output(
                sched, np.ascontiguousarray(sampled.sampled_token_ids, dtype=np.int32),
                *_topk_rows(sampled, len(sched.sample_seq_ids)))
            if self.async_output_processing and not proc.has_stop_strings:
                self._pending = (result, np.array(sched.sample_seq_ids, dtype=np.int64), sampled)
            else:
                outputs, step_stops = proc.on_update(result, sched.sample_seq_ids, sampled)
                self._ready.extend(outputs)
                stops += step_stops
        finally:
            self.core.release(sched)
        for seq_id, stop_str in stops:  # stop strings matched on the Python side
            self.core.finish_sequence(seq_id, stop_str)
        outputs, self._ready = self._ready, []  # a deferred step stays pending until the next step
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """step() under async scheduling (module docstring): launch step N + 1, then finish step N."""
        sched = self.core.schedule()
        prev, self._inflight = self._inflight, None
        owned = [sched] + ([prev.sched] if prev is not None else [])  # released on any error
        try:
            run = None
            if sched.num_tokens > 0:
                try:
                    self.output_processor.on_schedule(sched)
                except RequestSetupError:
                    if prev is not None:  # step N's tokens are good: apply them, release N + 1 only
                        stops = self._finish_step(prev)
                        owned.pop()
                        for seq_id, stop_str in stops:
                            self.core.finish_sequence(seq_id, stop_str)
                    raise
                self.histograms["iteration_tokens_total"].observe(int(sched.num_tokens))
                self.histograms["iteration_num_seqs"].observe(int(sched.num_seqs))
                prev_sampled = None
                if sched.num_placeholders:  # the scheduler's placeholders name rows of step_id - 1
                    if prev is None or prev.sched.step_id != sched.step_id - 1:
                        raise RuntimeError(f"step {sched.step_id} has placeholders but the step in flight is "
                                           f"{None if prev is None else prev.sched.step_id}")
                    prev_sampled = prev.sample.device_ids
                greedy = (self.executor.argmax_applies(len(sched.sample_seq_ids))
                          and self.sampler.argmax_suffices(sched.sample_seq_ids))
                run = self.executor.execute_model(sched, greedy_vocab=self.sampler.vocab_size if greedy else 0,
                                                prev_sampled=prev_sampled)
            if prev is not None:  # step N's tokens, while the device runs step N + 1
                stops = self._finish_step(prev)
                owned.pop()
                for seq_id, stop_str in stops:
                    self.core.finish_sequence(seq_id, stop_str)
            if run is not None:
                # which sequences of the launched step still run (the sampler forgets a sequence
                # when it finishes or is aborted); if none does (their rows were placeholders after
                # their last token), nothing is sampled or applied and the step is released below,
                # so that nothing stays in flight once every request has finished
                live = self.sampler.known(sched.sample_seq_ids)
                if live.any() or self.sampler.known(sched.seq_ids).any():
                    self._inflight = _InFlight(sched, *self._sample_async(sched, run, live))
                    owned.pop(0)
        finally:
            for out in owned:  # never updated: its sequences are rescheduled, nothing leaks
                self.core.release(out)
        if run is None and prev is not None and self.speculative_config is not None:
            # nothing could be launched because the sequences of a speculating step wait for its
            # tokens (no placeholders for them): now that it is applied, launch the next step in this
            # call, so that it runs while the caller handles these outputs
            return self._step_async()
        outputs, self._ready = self._ready, []
        return outputs

    def _step_pipelined(self) -> list[RequestOutput]:
        """step() under pipeline parallelism: submit a new step to stage 0 while up to
        pipeline_depth - 1 earlier ones run on the later stages (the scheduler leaves sequences in
        flight out of it, so the steps in flight hold disjoint sequences, as vLLM's virtual
        engines); once the pipeline is full, or nothing new can be scheduled, finish the oldest:
        its logits, sampling, update, outputs. Returns the outputs that produced."""
        depth = self.executor.pipeline_depth
        # each step in flight takes its share of the sequences, so that the stages stay busy
        share = -(-(self.core.num_running_seqs() + self.core.num_waiting_seqs()) // depth)
        sched = self.core.schedule(max_step_seqs=max(1, share))
        owned = [sched]
        stops: list[tuple[int, str]] = []
        try:
            if sched.num_tokens > 0:
                self.output_processor.on_schedule(sched)
                self.histograms["iteration_tokens_total"].observe(int(sched.num_tokens))
                self.histograms["iteration_num_seqs"].observe(int(sched.num_seqs))
                self._pipeline.append((sched, self.executor.submit(sched)))
                owned.pop()
                self.histograms["pipeline_steps_in_flight"].observe(len(self._pipeline))
            if self._pipeline and (len(self._pipeline) >= depth or sched.num_tokens == 0):
                stops = self._finish_pipelined(owned)
        finally:
            for out in owned:  # never updated: its sequences are rescheduled, nothing leaks
                self.core.release(out)
        for seq_id, stop_str in stops:
            self.core.finish_sequence(seq_id, stop_str)
        outputs, self._ready = self._ready, []
        return outputs

    def _finish_pipelined(self, owned: list) -> list[tuple[int, str]]:
        """Collect, sample and apply the oldest submitted step (appended to `owned`, released by
        the caller); its outputs go to self._ready. Returns its stop-string finishes."""
        sched, handle = self._pipeline.popleft()
        owned.append(sched)
        run = self.executor.collect(handle)
        sampled = self.sampler(run.logits, sched.sample_seq_ids)
        self.executor.check_health()  # a rank that died during the step: its tokens are not used
        self._add_prompt_logprobs(run.prompt_logits)
        result = self.core.update_from_output(
            sched, np.ascontiguousarray(sampled.sampled_token_ids, dtype=np.int32),
            *_topk_rows(sampled, len(sched.sample_seq_ids)))
        outputs, stops = self.output_processor.on_update(result, sched.sample_seq_ids, sampled)
        self._ready.extend(outputs)
        return stops

    def _flush_pipeline(self) -> None:
        """Finish every submitted step (pipeline parallelism), so that none is in flight. If one
        fails on this side (sampling, output processing) while the ranks are healthy, the others
        are still collected — the stages send their rows in submission order, so a step must not
        be skipped — and released unapplied (their sequences are rescheduled); then the error is
        raised. If the ranks failed, nothing more can be collected: all are released."""
        error: Optional[BaseException] = None
        while self._pipeline:
            owned: list = []
            try:
                if error is None:
                    stops = self._finish_pipelined(owned)
                    for seq_id, stop_str in stops:
                        self.core.finish_sequence(seq_id, stop_str)
                else:
                    sched, handle = self._pipeline.popleft()
                    owned.append(sched)
                    self.executor.collect(handle)  # (its rows, discarded)
            except BaseException as exc:  # noqa: BLE001 (raised once every step is accounted for)
                if error is None:
                    error = exc
                try:
                    self.executor.check_health()
                except Exception:  # noqa: BLE001 (the group is gone: nothing else will arrive)
                    owned.extend(sched for sched, _ in self._pipeline)
                    self._pipeline.clear()
            finally:
                for out in owned:
                    self.core.release(out)
        if error is not None:
            raise error

    def _sample_async(self, sched, run, live: np.ndarray):
        """(PendingSample, seq ids of its logprob rows, prompt logits) of a launched step. Rows of
        sequences that finished after it was scheduled (live[r] False: no longer in the sampler)
        are skipped."""
        seq_ids = np.array(sched.sample_seq_ids, dtype=np.int64)
        if run.sampled_ids is not None:  # the model took the argmax itself
            return PendingSample(run.sampled_ids), seq_ids, run.prompt_logits
        drafts = np.array(sched.draft_token_ids, dtype=np.int64) if sched.num_draft_tokens else None
        if live.all():
            return (self.sampler.sample_async(run.logits, seq_ids, draft_token_ids=drafts), seq_ids,
                    run.prompt_logits)
        rows = np.nonzero(live)[0]  # (a speculative run's rows are all live or none)
        logits = run.logits[torch.from_numpy(rows).to(run.logits.device)]
        pending = self.sampler.sample_async(logits, seq_ids[rows], rows=rows, num_rows=len(seq_ids),
                                            draft_token_ids=None if drafts is None else drafts[rows])
        return pending, seq_ids[rows], run.prompt_logits

    def _finish_step(self, step: "_InFlight") -> list[tuple[int, str]]:
        """Wait for a launched step's ids, update the native core, process its outputs into
        self._ready and release it; returns its stop-string finishes."""
        sampled = step.sample.result()
        self.executor.check_health()  # a rank that died during the step: its tokens are not used
        self._add_prompt_logprobs(step.prompt_logits)
        result = self.core.update_from_output(step.sched, np.ascontiguousarray(sampled.sampled_token_ids),
                                              *_topk_rows(sampled, len(step.sched.sample_seq_ids), step.sample.rows))
        outputs, stops = self.output_processor.on_update(result, step.logprob_seq_ids, sampled)
        self._ready.extend(outputs)
        self.core.release(step.sched)
        return stops

    def _add_prompt_logprobs(self, prompt_logits) -> None:
        proc = self.output_processor
        for request_id, (first_position, rows) in prompt_logits.items():
            state = proc.requests.get(request_id)
            if state is None or state.params.prompt_logprobs is None:
                continue
            prompt = state.prompt_token_ids
            targets = prompt[first_position + 1: first_position + 1 + rows.shape[0]]
            if targets:
                lp = compute_prompt_logprobs(rows[: len(targets)], targets, state.params.prompt_logprobs,
                                             self.model_config.vocab_size)
                proc.add_prompt_logprobs(request_id, first_position, lp)

    def _flush_inflight(self) -> None:
        """Finish the launched step now (async scheduling), so that no step is in flight."""
        step, self._inflight = self._inflight, None
        if step is None:
            return
        try:
            stops = self._finish_step(step)
        except BaseException:
            self.core.release(step.sched)
            raise
        for seq_id, stop_str in stops:
            self.core.finish_sequence(seq_id, stop_str)

    def _flush_pending(self) -> list[tuple[int, str]]:
        """Process a deferred step's outputs into self._ready; returns its stop-string finishes
        (none in practice: steps with stop strings are never deferred)."""
        if self._pending is None:
            return []
        result, sample_seq_ids, sampled = self._pending
        self._pending = None
        outputs, stops = self.output_processor.on_update(result, sample_seq_ids, sampled)
        self._ready.extend(outputs)
        return stops

    def _take_ready(self) -> list[RequestOutput]:
        """Everything processed so far, a deferred step included (nothing was scheduled)."""
        self._flush_pending()
        outputs, self._ready = self._ready, []
        return outputs

    # ---- observability / lifecycle --------------------------------------------------------
    def get_metrics(self) -> list[Metric]:
        metrics = metrics_from_stats(self.core.stats(), self.model_name, self.histograms,
                                     extra_waiting=len(self._compiling))
        replays = self.executor.num_graph_replays if self.executor is not None else 0
        labels = {"model_name": self.model_name} if self.model_name else {}
        metrics.append(Counter("pagedllm:cuda_graph_replays", labels, int(replays)))
        return metrics

    def shutdown(self) -> None:
        """Free the KV pool, the weights and the native engine."""
        if self.core is not None:
            for request_id in list(self.output_processor.requests):
                self.abort_request(request_id)
            self.output_processor.shutdown()
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown()
            self.executor = None
        if getattr(self, "proposer", None) is not None:
            self.proposer.runner.shutdown()
            self.proposer = None
        self.runner = None
        self.core = None


@dataclasses.dataclass
class _DraftSpec:
    """A draft model for speculative decoding (pagedllm.spec_decode.draft_model), checked before
    anything loads: same vocabulary as the target, one rank, a context of at least max_model_len.
    Its KV cache uses the target's block ids: the target's KV budget is shared (bytes per block of
    both) and, on a GPU, the draft's weights are reserved before the target sizes its KV cache."""

    path: Any
    config: ModelConfig
    dtype: torch.dtype
    spec: Any
    device: torch.device
    max_model_len: int
    block_size: int

    @classmethod
    def check(cls, spec, target_cfg: ModelConfig, target_dtype, device, max_model_len: int, block_size: int,
              tp: int) -> "_DraftSpec":
        if tp > 1:
            raise ValueError("speculative_config: a draft model with tensor_parallel_size > 1 is not supported")
        path = resolve_model(spec.model)
        cfg = ModelConfig.from_pretrained(path)
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocab_size {cfg.vocab_size} differs from the "
                             f"target's {target_cfg.vocab_size} (a draft needs the target's tokenizer)")
        if cfg.head_dim not in ops.SUPPORTED_HEAD_SIZES:
            raise ValueError(f"speculative_config: the draft's head_dim={cfg.head_dim} is not supported: "
                             f"{list(ops.SUPPORTED_HEAD_SIZES)}")
        if cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config: the draft's max_position_embeddings={cfg.max_position_embeddings} "
                             f"is shorter than max_model_len={max_model_len}")
        dtype = resolve_dtype(spec.dtype, cfg.dtype, device) if spec.dtype else target_dtype
        get_quantization_config(spec.quantization, cfg.quantization, device, gguf_source(spec.model),
                                cfg.quantization_config, dtype)
        return cls(path, cfg, dtype, spec, device, max_model_len, block_size)

    def executor_args(self) -> dict:
        elem = torch.empty((), dtype=self.dtype).element_size()
        kv = 2 * self.config.num_hidden_layers * self.block_size * self.config.num_key_value_heads * self.config.head_dim
        reserved = 0
        if self.device.type == "cuda":  # its weights in its dtype (an overestimate for a quantized draft)
            c = self.config
            per_layer = (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                         + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
            reserved = (c.num_hidden_layers * per_layer + 2 * c.vocab_size * c.hidden_size) * elem + (256 << 20)
        return dict(kv_extra_bytes_per_block=kv * elem, reserved_bytes=reserved)

    def build(self, num_blocks: int, args: "EngineArgs"):
        from pagedllm.spec_decode.draft_model import DraftModelProposer
        from pagedllm.worker.model_runner import ModelRunner

        runner = ModelRunner(self.path, self.config, device=self.device, dtype=self.dtype, block_size=self.block_size,
                             max_model_len=self.max_model_len, num_blocks=num_blocks, load_format=args.load_format,
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=_batched_tokens(args, self.max_model_len),
                             enforce_eager=args.enforce_eager, seed=args.seed + 1, quantization=self.spec.quantization,
                             gguf_file=gguf_source(self.spec.model))
        logger.info("speculative decoding: draft model %s (%s), k = %d", self.path, str(self.dtype).removeprefix("torch."),
                    self.spec.num_speculative_tokens)
        return DraftModelProposer(runner, self.spec.num_speculative_tokens)


@dataclasses.dataclass
class _InFlight:
    """A step launched under async scheduling and not updated yet."""

    sched: Any  # the SchedulerOutput (held until released)
    sample: PendingSample
    logprob_seq_ids: np.ndarray  # the seq ids of sample's logprob rows (its sampled rows)
    prompt_logits: dict


def _topk_rows(sampled, num_sampled: int, rows: Optional[np.ndarray] = None):
    """(top-k token ids int64 [R, k], their logprobs float32 [R, k]) of a step's sampled rows for
    EngineCore.update_from_output (beam search reads them), or (None, None) without logprobs. rows:
    the sampled rows the logprobs cover when not all (async scheduling); the others get -inf."""
    lp = sampled.logprobs
    if lp is None or lp.token_ids.shape[1] < 2:
        return None, None
    ids = np.ascontiguousarray(lp.token_ids[:, 1:], dtype=np.int64)
    vals = np.ascontiguousarray(lp.logprobs[:, 1:], dtype=np.float32)
    if rows is not None and len(rows) != num_sampled:
        full_ids = np.zeros((num_sampled, ids.shape[1]), dtype=np.int64)
        full_vals = np.full((num_sampled, ids.shape[1]), -np.inf, dtype=np.float32)
        full_ids[rows], full_vals[rows] = ids, vals
        ids, vals = full_ids, full_vals
    return ids, vals


def _prepend_delta(out: RequestOutput, prev: RequestOutput) -> None:
    """out (a DELTA output) now starts with prev's pieces (an earlier DELTA output of the request),
    sequence by sequence (by index)."""
    earlier = {c.index: c for c in prev.outputs}
    for c in out.outputs:
        p = earlier.get(c.index)
        if p is None:
            continue
        c.token_ids = list(p.token_ids) + list(c.token_ids)
        c.text = p.text + c.text
        if p.logprobs is not None and c.logprobs is not None:
            c.logprobs = list(p.logprobs) + list(c.logprobs)


def _tri_state(name: str, value) -> Any:
    """True, False or "auto" (also the command line's "true" / "false", any case)."""
    if isinstance(value, str) and value.lower() in ("true", "false", "auto"):
        return {"true": True, "false": False, "auto": "auto"}[value.lower()]
    if value is True or value is False:
        return value
    raise ValueError(f"{name} must be True, False or 'auto', got {value!r}")


def _check_tensor_parallel(cfg: ModelConfig, tp: int, device: torch.device, backend: Optional[str] = None) -> None:
    """ValueError, naming both numbers, when the model cannot be split over tp ranks of `device`
    (the GPUs of this host; with the "ray" backend the cluster's, which RayExecutor counts)."""
    partition_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's intermediate_size="
                         f"{cfg.intermediate_size}")
    if device.type == "cuda" and backend != "ray" and torch.cuda.device_count() < tp:
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} CUDA devices, but torch sees "
                         f"{torch.cuda.device_count()}")


#: steps in flight + the one being scheduled must fit EngineCore's 16 output buffer sets
MAX_PIPELINE_STAGES = 15


def _check_pipeline_parallel(cfg: ModelConfig, tp: int, pp: int, device: torch.device, speculative_config,
                             backend: Optional[str] = None) -> None:
    """ValueError, naming the numbers, when the model cannot run in pp stages of tp ranks (before
    any process starts or weight loads)."""
    pp_partition(cfg.num_hidden_layers, pp)  # P <= layers, PAGEDLLM_PP_LAYER_PARTITION
    if pp > MAX_PIPELINE_STAGES:  # each step in flight holds one of the core's output buffers
        raise ValueError(f"pipeline_parallel_size={pp} is more than the {MAX_PIPELINE_STAGES} stages the engine keeps in "
                         "flight")
    if device.type == "cuda" and backend != "ray" and torch.cuda.device_count() < tp * pp:
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs {tp * pp} CUDA devices, but "
                         f"torch sees {torch.cuda.device_count()}")
    if speculative_config is not None:
        raise ValueError("speculative_config with pipeline_parallel_size > 1 is not supported: use one stage")


def _resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported: use 'auto', 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    return dev


def _max_model_len(requested: Optional[int], cfg: ModelConfig) -> int:
    limit = cfg.max_position_embeddings
    if requested is None:
        return limit
    if not isinstance(requested, int) or requested < 2:
        raise ValueError(f"max_model_len must be an int >= 2, got {requested!r}")
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}")
    return requested


def _batched_tokens(args: EngineArgs, max_model_len: int) -> int:
    if args.max_num_batched_tokens is None:
        return 8192 if args.enable_chunked_prefill else max(8192, max_model_len)
    value = args.max_num_batched_tokens
    if value < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {value}")
    if not args.enable_chunked_prefill and value < max_model_len:
        raise ValueError(f"max_num_batched_tokens={value} is smaller than max_model_len={max_model_len}; "
                         "without chunked prefill a whole prompt must fit one step")
    return value


def _load_tokenizer(path, vocab_size: int = 0, allow_synthetic: bool = False):
    """The checkpoint's Hugging Face tokenizer. A folder with tokenizer.json loads it as a fast
    tokenizer directly (AutoTokenizer first imports the model's whole config/modeling stack: many
    seconds of start-up); other folders and hub ids go through AutoTokenizer. With
    load_format="dummy" (allow_synthetic) a folder without tokenizer files gets a synthetic
    word-level one over the vocabulary (token i is "<i>")."""
    from pathlib import Path

    folder = Path(str(path))
    if (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as exc:
        if not allow_synthetic:
            raise
        from pagedllm.model_executor.dummy import synthetic_tokenizer

        logger.warning("no tokenizer in %s (%s): using a synthetic one of %d tokens", path,
                       type(exc).__name__, vocab_size)
        return synthetic_tokenizer(vocab_size)


def _eos_token_ids(path, cfg: ModelConfig, tokenizer) -> list[int]:
    """EOS ids: the tokenizer's, the config's and generation_config.json's (vLLM stops on all)."""
    ids = list(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen = _read_generation_config(path)
    eos = gen.get("eos_token_id")
    ids += [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    return sorted(set(ids))


def _read_generation_config(path) -> dict:
    import json
    from pathlib import Path

    file = Path(path) / "generation_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def _generation_defaults(path) -> dict:
    """Sampling defaults the checkpoint's generation_config.json sets (vLLM applies them to
    SamplingParams() when the user gives none)."""
    gen = _read_generation_config(path)
    keys = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
    if gen.get("do_sample") is False:
        return {}
    return {ours: gen[theirs] for theirs, ours in keys.items() if gen.get(theirs) is not None}
