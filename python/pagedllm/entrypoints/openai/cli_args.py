"""Every engine argument of ``LLM`` / ``EngineArgs`` as a command-line flag (``--block-size``,
``--max-model-len``, ``--kv-cache-memory-bytes``, ``--scheduling-policy``, ...), generated from
the EngineArgs dataclass so a new engine argument gets its flag without an edit here.
Booleans get ``--flag`` / ``--no-flag``; byte sizes accept suffixes (``4GiB``, ``512M``)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

from pagedllm.engine.llm_engine import EngineArgs

_HELP = {
    "data_parallel_size": "engine replicas behind this server (each its own process, KV pool and model copy; "
                          "requests go to the least loaded; tensor x pipeline parallel GPUs each on CUDA)",
    "tokenizer": "tokenizer folder (default: the model's)",
    "dtype": "auto | float32 | bfloat16 | float16 (CUDA)",
    "max_model_len": "context length (prompt + output tokens); default the model's",
    "block_size": "KV-cache block size in tokens",
    "kv_cache_memory_bytes": "KV pool size in bytes (suffixes K, M, G, KiB, MiB, GiB)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step",
    "scheduling_policy": "fcfs | priority",
    "seed": "seed of requests without their own seed",
    "device": "auto | cpu | cuda",
    "tensor_parallel_size": "split the model over this many ranks of this host (CUDA: GPUs; CPU: processes)",
    "pipeline_parallel_size": "split the decoder layers into this many stages of tensor_parallel_size ranks each "
                              "(worker processes of this host, or Ray actors with --distributed-executor-backend ray)",
    "distributed_executor_backend": "mp (worker processes of this host; the default with more than one rank) | ray "
                                    "(Ray actors, on one host or several) | uni (one rank)",
    "quantization": "weight quantization (docs/quantization.md): int8 (CPU), int4 (CPU, CUDA), gguf (a GGUF file's "
                    "own types, CPU), fp8 (CUDA); a GPTQ / AWQ / compressed-tensors checkpoint needs none",
    "async_output_processing": "auto | true | false: a step's detokenization during the next step's forward pass",
    "async_scheduling": "auto | true | false: schedule and launch step N + 1 before step N's tokens are known "
                        "(auto: on CUDA)",
    "kv_cache_dtype": "auto | fp8 | fp8_e4m3 | fp8_e5m2: the KV cache's dtype (fp8: twice the tokens of bfloat16 "
                      "in the same memory; docs/fp8_kv_cache.md)",
    "calculate_kv_scales": "FP8 KV cache: compute each layer's k/v scales from the first batch",
}

#: vLLM's short flags
_ALIASES = {"-tp": "tensor_parallel_size", "-pp": "pipeline_parallel_size", "-dp": "data_parallel_size"}

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """'4GiB' -> 4294967296, '512M' -> 512000000, '1000' -> 1000 (argparse type)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4GiB, 512M, 1000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def _base_type(tp):
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine arguments (those of LLM(...))")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            group.add_argument("--model", default=None, help="model (same as the positional MODEL)")
            continue
        flag = "--" + f.name.replace("_", "-")
        flags = [flag] + [alias for alias, name in _ALIASES.items() if name == f.name]
        tp = _base_type(hints[f.name])
        help_text = _HELP.get(f.name, f.name.replace("_", " ")) + f" (default: {f.default})"
        if tp is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif f.name.endswith("_bytes"):
            group.add_argument(*flags, type=parse_bytes, default=f.default, help=help_text)
        elif tp in (int, float):
            group.add_argument(*flags, type=tp, default=f.default, help=help_text)
        else:
            group.add_argument(*flags, type=str, default=f.default, help=help_text)


def engine_args_from(args: argparse.Namespace, cls=EngineArgs):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)})


__all__ = ["add_engine_args", "engine_args_from", "parse_bytes"]
