"""Case C21: clients that disconnect (mid-stream, while waiting for a non-streamed answer, during
a long prefill) abort their requests: KV usage is back to 0 within a second, the process stays
up, and a greedy reference request returns the same token ids as before (on the real server)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_utils import DEFAULT_ARGS, MAX_MODEL_LEN, shared_server  # noqa: E402

MODEL = "tiny"
REFERENCE = {"model": MODEL, "prompt": [12, 34, 56, 78, 90], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
             "return_token_ids": True}


@pytest.fixture(scope="module")
def server():
    return shared_server("default", DEFAULT_ARGS)


@pytest.fixture(scope="module")
def reference(server):
    ids = httpx.post(server.url + "/v1/completions", json=REFERENCE, timeout=60).json()["choices"][0]["token_ids"]
    return REFERENCE, ids


def seconds_until_idle(server, timeout: float = 5.0) -> float:
    """Seconds until no request runs or waits and KV usage is 0 (inf if not within timeout)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        m = server.metrics()
        if (m["pagedllm:kv_cache_usage_perc"] == 0 and m["pagedllm:num_requests_running"] == 0
                and m["pagedllm:num_requests_waiting"] == 0):
            return time.monotonic() - start
        time.sleep(0.02)
    return float("inf")


def test_streams_closed_mid_generation_free_their_blocks(server, reference):
    """64 concurrent streams ("tell me a joke " x 20, ignore_eos, long max_tokens), all closed
    after they started streaming; 3 rounds."""
    prompt = "tell me a joke " * 20

    async def one(client, started: list):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with client.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    started.append(1)
                    await asyncio.sleep(3600)  # hold the connection until cancelled

    async def round_():
        started: list = []
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=80)) as client:
            tasks = [asyncio.create_task(one(client, started)) for _ in range(64)]
            deadline = time.monotonic() + 60
            while len(started) < 64 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return len(started)

    for _ in range(3):
        n_started = asyncio.run(round_())
        assert n_started == 64
        assert seconds_until_idle(server) < 1.5
        assert server.healthy(reference)


def test_non_streamed_requests_dropped_mid_generation(server, reference):
    body = {"model": MODEL, "prompt": [5] * 30, "max_tokens": 450, "ignore_eos": True}

    async def drop():
        async with httpx.AsyncClient(timeout=httpx.Timeout(1.0)) as client:
            res = await asyncio.gather(*(client.post(server.url + "/v1/completions", json=body) for _ in range(8)),
                                       return_exceptions=True)
        return res

    before = server.metrics()
    results = asyncio.run(drop())
    assert all(isinstance(r, httpx.TimeoutException) for r in results), results
    assert seconds_until_idle(server) < 1.5
    after = server.metrics()
    aborted = 'pagedllm:request_success_total{finished_reason="abort"}'
    assert after[aborted] - before[aborted] == 8
    assert server.healthy(reference)


def test_client_timeout_during_long_prefill(server, reference):
    body = {"model": MODEL, "prompt": [9] * (MAX_MODEL_LEN - 100), "max_tokens": 90, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.05)
    assert seconds_until_idle(server) < 1.5
    assert server.healthy(reference)
