"""pagedllm: a paged-KV-cache LLM inference and serving engine (vLLM-compatible API).

The native core (KV cache, scheduler, kernels) lives in :mod:`pagedllm._C`. The offline API uses
vLLM's names: ``from pagedllm import LLM, SamplingParams``.
"""

import os as _os

# pagedllm's CPU kernels and torch each run an OpenMP runtime (libgomp). With the default wait
# policy, idle workers spin for milliseconds after every parallel region, so alternating torch ops
# and pagedllm kernels (every decoder layer) makes the two runtimes' workers fight for the cores:
# on the 2-core dev machine 30 layers of (matmul + paged_attention) took 793 ms instead of 73 ms.
# Each runtime reads OMP_WAIT_POLICY when it loads, so this must precede `import torch` (importing
# pagedllm first) and `_C`; an explicit user setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagedllm import _C  # noqa: E402

__version__ = "0.1.0"

_LAZY = {  # vLLM's top-level names, imported on first use (keeps `import pagedllm` light)
    "LLM": "pagedllm.entrypoints.llm",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "EngineArgs": "pagedllm.engine.llm_engine",
    "SamplingParams": "pagedllm.sampling_params",
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
