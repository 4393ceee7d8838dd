"""`python -m pagedllm.demo`: a short demonstration of the native KV-cache core.

(The model issue turns this into text generation with the bundled model.)
"""

from __future__ import annotations

from pagedllm import _C


def main() -> int:
    print(f"pagedllm._C loaded; built with CUDA: {_C.built_with_cuda}; CUDA devices: {_C.cuda_device_count()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
