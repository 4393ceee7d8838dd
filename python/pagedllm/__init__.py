"""pagedllm: a paged-KV-cache LLM inference and serving engine (vLLM-compatible API).

The native core (KV cache, scheduler, kernels) lives in :mod:`pagedllm._C`.
"""

from pagedllm import _C

__version__ = "0.1.0"

__all__ = ["_C", "__version__"]
