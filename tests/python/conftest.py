"""pytest setup for tests/python.

The tests run with OMP_WAIT_POLICY=PASSIVE (unless the environment says otherwise), set before
pagedllm and torch load their OpenMP runtime: server tests run engines in subprocesses next to
the pytest process on 2 cores, where spinning OpenMP workers would stall each other.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pagedllm  # noqa: F401,E402
