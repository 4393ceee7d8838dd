"""pytest setup for tests/python.

The tests run with OMP_WAIT_POLICY=PASSIVE (unless the environment says otherwise), set before
pagedllm and torch load their OpenMP runtime: server tests run engines in subprocesses next to
the pytest process on 2 cores, where spinning OpenMP workers would stall each other.

Fixture `gen`: a CPU torch.Generator with a fresh seed every test (printed, so a failure can be
replayed), for the kernel tests' random inputs.

Fixtures `server` / `client` (module scope): the shared default `pagedllm serve` process of
server_utils and an `openai` client of it, for server test modules that do not define their own.
"""

import os
import random

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pagedllm  # noqa: F401,E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def gen():
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def server():
    from server_utils import DEFAULT_ARGS, shared_server

    return shared_server("default", DEFAULT_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return server.client()
