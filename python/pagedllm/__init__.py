"""pagedllm: a paged-KV-cache LLM inference and serving engine (vLLM-compatible API).

The native core (KV cache, scheduler, kernels) lives in :mod:`pagedllm._C`. The offline API uses
vLLM's names: ``from pagedllm import LLM, SamplingParams``.
"""

import os as _os

# OpenMP wait policy (torch and pagedllm's CPU kernels share one libgomp). Between two parallel
# regions the idle worker either spins (libgomp's default: up to 300,000 spins, milliseconds) or
# sleeps (OMP_WAIT_POLICY=PASSIVE). Sleeping makes every region pay a futex wake-up: on the 2-core
# dev machine a oneDNN decode GEMM took 430 us instead of 140 us and a 64-sequence decode step was
# ~10% slower. Spinning for milliseconds makes a machine with any other busy process (a compile,
# a second engine) stall every barrier on a descheduled thread: 2-15x slower. So, unless the user
# chose, spin briefly (GOMP_SPINCOUNT=10000, ~0.5 ms: the gaps between the ops of a step) and then
# sleep. libgomp reads this when it loads, so it must precede `import torch` (import pagedllm first).
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "10000"

from pagedllm import _C  # noqa: E402

__version__ = "0.1.0"

_LAZY = {  # vLLM's top-level names, imported on first use (keeps `import pagedllm` light)
    "LLM": "pagedllm.entrypoints.llm",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "EngineArgs": "pagedllm.engine.llm_engine",
    "AsyncLLM": "pagedllm.engine.async_llm",
    "AsyncEngineArgs": "pagedllm.engine.async_llm",
    "AsyncLLMEngine": "pagedllm.engine.async_llm",
    "SamplingParams": "pagedllm.sampling_params",
    "BeamSearchParams": "pagedllm.sampling_params",
    "BeamSearchOutput": "pagedllm.beam_search",
    "BeamSearchSequence": "pagedllm.beam_search",
    "RequestOutputKind": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "TokensPrompt": "pagedllm.inputs",
    "TextPrompt": "pagedllm.inputs",
    "PromptType": "pagedllm.inputs",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["_C", "__version__", *_LAZY]
