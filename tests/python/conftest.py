"""pytest setup for tests/python.

pagedllm is imported before any test module imports torch, so that its OMP_WAIT_POLICY=PASSIVE
default (pagedllm/__init__.py) is in place when torch's and the kernels' OpenMP runtimes load.
"""

import pagedllm  # noqa: F401
