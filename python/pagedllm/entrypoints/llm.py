"""The offline API: ``LLM`` with vLLM's constructor arguments, ``generate``, ``chat``,
``get_tokenizer``, ``get_metrics`` and ``shutdown`` — a vLLM user's script runs after changing
the import.

Length rule (as vLLM's offline API): a prompt of max_model_len tokens or more raises ValueError
(nothing is queued); generation stops when prompt + output reach max_model_len, with
finish_reason "length" (max_tokens=None means "until max_model_len").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Optional, Union

from pagedllm.engine.llm_engine import EngineArgs, LLMEngine
from pagedllm.entrypoints.chat_templates import load_chat_template
from pagedllm.entrypoints.chat_utils import chat_prompt_token_ids
from pagedllm.metrics import Metric
from pagedllm.outputs import RequestOutput
from pagedllm.beam_search import BeamSearchOutput, BeamSearchSequence
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, truncate_prompt_ids

logger = logging.getLogger("pagedllm")

# vLLM arguments with no effect on what runs or what comes out here: accepted, logged.
_NO_EFFECT_ARGS = {
    "trust_remote_code", "revision", "tokenizer_revision", "download_dir", "disable_log_stats",
    "disable_custom_all_reduce", "max_seq_len_to_capture", "compilation_config", "allowed_local_media_path",
    "mm_processor_kwargs",
    "swap_space",  # vLLM swaps preempted sequences' KV to the CPU; pagedllm recomputes them: same tokens
}
# vLLM arguments that would change what runs, not implemented here: accepted only at the value
# that asks for nothing (vLLM's default), else a ValueError naming the argument — a user who asks
# for two pipeline stages must not silently get one.
_UNIMPLEMENTED_ARGS = {
    "enable_lora": False,
    "cpu_offload_gb": 0, "max_logprobs": 20, "hf_overrides": None, "tokenizer_mode": "auto",
    "skip_tokenizer_init": False,
    "data_parallel_size": 1,  # replicas: `pagedllm serve --data-parallel-size D`
}


def check_vllm_args(kwargs: dict[str, Any], where: str = "LLM") -> None:
    """Refuse what LLM(...) does not implement (TypeError for an unknown argument, ValueError for
    one of _UNIMPLEMENTED_ARGS at another value than its neutral one); log the no-effect ones."""
    unknown = sorted(set(kwargs) - _NO_EFFECT_ARGS - set(_UNIMPLEMENTED_ARGS))
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s): {', '.join(unknown)}")
    for name in sorted(kwargs):
        if name in _UNIMPLEMENTED_ARGS:
            neutral, value = _UNIMPLEMENTED_ARGS[name], kwargs[name]
            if value != neutral and not (neutral is None and not value):
                raise ValueError(f"{name}={value!r} is not supported by pagedllm (only {neutral!r}, which is "
                                 f"the same as leaving it out); see the project's issues for what is planned")
        logger.info("%s(%s=...) is accepted for vLLM compatibility and has no effect here", where, name)


class LLM:
    """An offline inference engine over one model (vLLM's ``LLM``).

    model: None or "HuggingFaceTB/SmolLM2-135M-Instruct" (the bundled GGUF), a Hugging Face folder,
      a .gguf file, or a hub id present in the local HF cache. dtype: "auto" | "float32" |
      "bfloat16" | "float16" (CUDA). kv_cache_memory_bytes: KV pool size (default 4 GiB on CPU;
      on CUDA gpu_memory_utilization of the device). max_num_batched_tokens: token budget per step
      (default 8192). seed: seeds the sampling of requests without their own seed (and the dummy
      weights). load_format: "auto" (safetensors) or "dummy" (random weights with the config's
      shapes, drawn on the device; a folder with config.json alone gets a synthetic tokenizer).
      enforce_eager: no CUDA graphs for decode steps. disable_async_output_proc: on CUDA a step's
      detokenization runs while the GPU computes the next step unless this is True (vLLM's flag;
      see pagedllm.engine.llm_engine). async_scheduling: schedule and launch step N + 1 before step
      N's tokens reach the host (vLLM's flag; None = on for CUDA, off on the CPU where it gains
      nothing). device: "auto" (CUDA when present), "cuda", "cpu". tensor_parallel_size: split the
      model over this many ranks of this host (heads, MLP and vocabulary; CUDA: one GPU each, NCCL;
      CPU: processes sharing the cores); rank 0 runs here, the others in worker processes
      (distributed_executor_backend "mp", the default then), so a script that builds an LLM at
      module level needs an ``if __name__ == "__main__":`` guard. pipeline_parallel_size: split
      the decoder layers into this many contiguous stages (distributed/pipeline.py), each
      tensor_parallel_size ranks; the same worker processes, stage 0 here.
      distributed_executor_backend="ray": the ranks other than 0 as Ray actors, on one host or
      several (executor/ray_executor.py; the README's "Several hosts (Ray)"). quantization: None, "int8" (CPU),
      "int4" (CPU; CUDA in bfloat16), "gguf" (a GGUF model's own quantized types, CPU) or "fp8"
      (CUDA, bfloat16); a GPTQ / AWQ / compressed-tensors checkpoint is recognised from its
      config.json (docs/quantization.md). speculative_config: vLLM's dict, e.g. {"method": "ngram",
      "num_speculative_tokens": 4, "prompt_lookup_max": 4}: n-gram speculative decoding, exact
      (greedy output unchanged; sampled output from the same distribution); see
      pagedllm.spec_decode.config and docs/speculative_decoding.md. kv_cache_dtype: "auto" (the
      model's dtype), "fp8" = "fp8_e4m3" or "fp8_e5m2": one byte per cached element, twice the
      tokens of a bfloat16 cache in the same memory; scales from the checkpoint's k_scale /
      v_scale, else 1.0, or from the first batch with calculate_kv_scales=True (docs/fp8_kv_cache.md).
    Errors: ValueError naming the bad argument.
    """

    def __init__(
        self,
        model: Optional[str] = None,
        tokenizer: Optional[str] = None,
        dtype: Any = "auto",
        max_model_len: Optional[int] = None,
        block_size: int = 16,
        kv_cache_memory_bytes: Optional[int] = None,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 256,
        max_num_batched_tokens: Optional[int] = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        scheduling_policy: str = "fcfs",
        seed: int = 0,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        distributed_executor_backend: Optional[str] = None,
        quantization: Optional[str] = None,
        device: str = "auto",
        num_gpu_blocks_override: Optional[int] = None,
        load_format: str = "auto",
        disable_async_output_proc: bool = False,
        async_scheduling: Optional[bool] = None,
        speculative_config: Optional[dict] = None,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
        **kwargs: Any,
    ):
        check_vllm_args(kwargs)
        start = time.perf_counter()
        self.llm_engine = LLMEngine(EngineArgs(
            model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len, block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill,
            scheduling_policy=scheduling_policy, seed=seed, enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
            quantization=quantization, device=device,
            num_gpu_blocks_override=num_gpu_blocks_override, load_format=load_format,
            async_output_processing=False if disable_async_output_proc else "auto",
            async_scheduling="auto" if async_scheduling is None else async_scheduling,
            speculative_config=speculative_config, kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
        ))
        self.startup_seconds = time.perf_counter() - start
        logger.info("LLM ready in %.1f s", self.startup_seconds)

    # ---- vLLM API -------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() updated with the checkpoint's generation_config.json defaults."""
        return SamplingParams(**self.llm_engine.generation_defaults)

    def generate(
        self,
        prompts: Union[str, dict, Sequence[Union[str, dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        priority: Optional[list[int]] = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Generate completions for `prompts` (str, TextPrompt, TokensPrompt / {"prompt_token_ids":
        [...]}, or a list of them) with one SamplingParams or one per prompt. Returns one finished
        RequestOutput per prompt, in input order. ValueError (nothing queued) for a malformed
        prompt, a length mismatch of the per-prompt lists, or a prompt of >= max_model_len tokens."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported by pagedllm")
        items = _as_list(prompts)
        params = self._params_list(sampling_params, len(items))
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"priority has {len(priority)} entries for {len(items)} prompts")
        engine = self.llm_engine
        parsed = [self._parse_prompt(p) for p in items]
        for (_, ids), p in zip(parsed, params):  # validate everything before queueing anything
            # (the engine keeps the last tokens of a longer prompt with truncate_prompt_tokens)
            if len(truncate_prompt_ids(ids, p.truncate_prompt_tokens, engine.max_model_len)) >= engine.max_model_len:
                raise ValueError(f"a prompt has {len(ids)} tokens, but max_model_len is {engine.max_model_len}: "
                                 "prompts must be shorter than max_model_len")
        ids_in_order = []
        # Only finished outputs are returned (vLLM's LLM does the same): FINAL_ONLY spares the
        # per-step cumulative RequestOutput of every running request.
        final_only: dict[int, SamplingParams] = {}
        for i, p in enumerate(params):
            if p.output_kind != RequestOutputKind.FINAL_ONLY:
                if id(p) not in final_only:
                    final_only[id(p)] = p.clone()
                    final_only[id(p)].output_kind = RequestOutputKind.FINAL_ONLY
                params[i] = final_only[id(p)]
        try:
            for i, ((text, ids), p) in enumerate(zip(parsed, params)):
                request_id = engine.new_request_id()
                engine.add_request(request_id, text, ids, p, priority=priority[i] if priority else 0)
                ids_in_order.append(request_id)
            finished = self._run(ids_in_order, use_tqdm)
        except BaseException:
            for request_id in ids_in_order:
                if engine.has_request(request_id):
                    engine.abort_request(request_id)
            raise
        return [finished[r] for r in ids_in_order]

    def beam_search(
        self,
        prompts: Union[str, dict, Sequence[Union[str, dict]]],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: Optional[int] = None,
    ) -> list[BeamSearchOutput]:
        """Beam search over `prompts` (as generate's): one BeamSearchOutput per prompt, in input
        order, with params.beam_width hypotheses, best score first. Each prompt is one engine
        request whose beams are copy-on-write forks (the native engine runs the search; Hugging
        Face's algorithm, early_stopping=False). concurrency_limit: at most this many prompts at
        once (None: all). ValueError (nothing queued): bad params, beam_width > max_num_seqs, a
        prompt too long for max_model_len."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if lora_request is not None:
            raise ValueError("lora_request is not supported by pagedllm")
        max_num_seqs = self.llm_engine.args.max_num_seqs
        if params.beam_width > max_num_seqs:
            raise ValueError(f"beam_width must be in [1, max_num_seqs = {max_num_seqs}], got {params.beam_width}")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be None or an int >= 1, got {concurrency_limit!r}")
        items = _as_list(prompts)
        sp = params.to_sampling_params()
        limit = concurrency_limit or max(1, len(items))
        outputs: list[RequestOutput] = []
        for start in range(0, len(items), limit):
            outputs += self.generate(items[start:start + limit], sp, use_tqdm=use_tqdm)
        return [self._beam_output(out, params) for out in outputs]

    def _beam_output(self, out: RequestOutput, params: BeamSearchParams) -> BeamSearchOutput:
        tok = self.llm_engine.tokenizer
        prompt_ids = list(out.prompt_token_ids)
        seqs = []
        for c in out.outputs:
            generated = list(c.token_ids)
            shown = generated[:-1] if c.finish_reason == "stop" and not params.include_stop_str_in_output else generated
            seqs.append(BeamSearchSequence(
                tokens=prompt_ids + generated, cum_logprob=c.cumulative_logprob,
                text=tok.decode(prompt_ids + shown, skip_special_tokens=params.skip_special_tokens),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                score=c.cumulative_logprob / max(1, len(generated)) ** params.length_penalty))
        return BeamSearchOutput(sequences=seqs)

    def chat(
        self,
        messages: Union[list[dict], list[list[dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[dict] = None,
        tools: Optional[list[dict]] = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (list of {"role", "content"}) or a list of them,
        rendered by the tokenizer's chat template (or `chat_template`: Jinja text, a file, or a
        bundled template's name such as "hermes_tools"), BOS exactly once. tools: OpenAI's tool
        objects, for templates that describe them (the output is text; constrain it with
        SamplingParams(structured_outputs=...) or parse it with a tool parser)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        if chat_template is not None:
            chat_template = load_chat_template(chat_template)
        prompts = []
        for c in conversations:
            ids = self._chat_ids(c, chat_template, add_generation_prompt, continue_final_message,
                                 chat_template_kwargs or {}, tools)
            # RequestOutput.prompt: the rendered conversation, as vLLM reports it
            prompts.append({"prompt": tok.decode(ids), "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics (vLLM v1 names with the ``pagedllm:`` prefix; see pagedllm.metrics)."""
        return self.llm_engine.get_metrics()

    def shutdown(self) -> None:
        """Free the KV pool and the weights; another LLM can start in this process afterwards."""
        if self.llm_engine is not None:
            self.llm_engine.shutdown()
            self.llm_engine = None
        import gc

        gc.collect()

    # ---- helpers --------------------------------------------------------------------------
    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts: pass one, or one per prompt")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params entries must be SamplingParams, got {type(p).__name__}")
        return params

    def _parse_prompt(self, prompt) -> tuple[Optional[str], list[int]]:
        tok = self.llm_engine.tokenizer
        if isinstance(prompt, str):
            return prompt, list(tok.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], list(tok.encode(prompt["prompt"]))
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        raise ValueError(f"a prompt must be a str, a TextPrompt or a TokensPrompt dict, got {type(prompt).__name__}")

    def _chat_ids(self, conversation, chat_template, add_generation_prompt, continue_final_message, kwargs,
                  tools=None) -> list[int]:
        return chat_prompt_token_ids(self.llm_engine.tokenizer, conversation, chat_template,
                                     add_generation_prompt, continue_final_message, kwargs, tools)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                       postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        idle_steps = 0
        try:
            while pending:
                outputs = engine.step()
                if not outputs and not engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine stopped with {len(pending)} request(s) unfinished")
                idle_steps = 0 if outputs or engine.core.stats().num_running else idle_steps + 1
                if idle_steps > 1000:
                    raise RuntimeError("the engine scheduled nothing for 1000 steps (KV pool too small?)")
                for out in outputs:
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        if bar is not None:
                            in_tokens += len(out.prompt_token_ids)
                            out_tokens += sum(len(o.token_ids) for o in out.outputs)
                            elapsed = time.perf_counter() - start
                            bar.postfix = (f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                           f"output: {out_tokens / elapsed:.2f} toks/s")
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return finished


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence):
        items = list(prompts)
        if not items:
            raise ValueError("no prompts given")
        return items
    raise ValueError(f"prompts must be a str, a prompt dict or a list of them, got {type(prompts).__name__}")
