"""/metrics values (not only names), on the real server: token counters equal the summed usage,
prefix-cache hits rise on a repeated prompt, kv_cache_usage_perc is above 0 mid-stream and 0
after, at least 16 requests run at once during 32 concurrent streams, latency histograms count
every request, cache_config_info carries block_size and the number of blocks."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_utils import DEFAULT_ARGS, shared_server  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def server():
    return shared_server("default", DEFAULT_ARGS)


def wait_idle(server, timeout: float = 1.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["pagedllm:kv_cache_usage_perc"] == 0 and m["pagedllm:num_requests_running"] == 0
                and m["pagedllm:num_requests_waiting"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.02)


def test_exported_names_and_cache_config(server):
    m = wait_idle(server)
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total",
                 "num_preemptions_total", "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count"]:
        assert "pagedllm:" + name in m, name
    info = [k for k in m if k.startswith("pagedllm:cache_config_info{")]
    assert len(info) == 1 and m[info[0]] == 1.0
    assert 'block_size="16"' in info[0]
    blocks = int(info[0].split('num_gpu_blocks="')[1].split('"')[0])
    assert blocks == (64 << 20) // (16 * 2 * 2 * 1 * 64 * 4)  # pool bytes / bytes per block (fp32, 2 layers, 1 KV head)
    assert m["pagedllm:kv_cache_usage_perc"] == 0


def test_token_counters_equal_summed_usage(server):
    before = wait_idle(server)
    usage = []
    for i in range(4):
        body = {"model": MODEL, "prompt": [900 + 37 * i + k for k in range(9 + i)], "max_tokens": 5 + i,
                "temperature": 0.0, "ignore_eos": True}
        usage.append(httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"])
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "count the tokens 0123"}], "max_tokens": 6,
        "temperature": 0.0, "ignore_eos": True}, timeout=60).json()["usage"]
    usage.append(chat)
    after = wait_idle(server)
    assert after["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"] == sum(
        u["completion_tokens"] for u in usage)
    assert after["pagedllm:prompt_tokens_total"] - before["pagedllm:prompt_tokens_total"] == sum(
        u["prompt_tokens"] for u in usage)
    done = 'pagedllm:request_success_total{finished_reason="length"}'
    assert after[done] - before[done] == 5
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"pagedllm:{h}_count"] - before[f"pagedllm:{h}_count"] == 5
    itl = after["pagedllm:inter_token_latency_seconds_count"] - before["pagedllm:inter_token_latency_seconds_count"]
    assert itl == sum(u["completion_tokens"] - 1 for u in usage)


def test_prefix_cache_hits_rise_on_a_repeated_prompt(server):
    prompt = [3000 + k for k in range(64)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    before = wait_idle(server)
    httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    after = wait_idle(server)
    hits = after["pagedllm:prefix_cache_hits_total"] - before["pagedllm:prefix_cache_hits_total"]
    queries = after["pagedllm:prefix_cache_queries_total"] - before["pagedllm:prefix_cache_queries_total"]
    assert hits >= 48  # 3 of the 4 full blocks (a full-prompt hit still recomputes the last token)
    assert queries >= hits


def test_kv_usage_above_zero_mid_stream_and_zero_after(server):
    body = {"model": MODEL, "prompt": [77] * 40, "max_tokens": 300, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    mid = None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        for k, _ in enumerate(resp.iter_lines()):
            if k == 4:
                mid = server.metrics()
    assert mid["pagedllm:kv_cache_usage_perc"] > 0
    assert mid["pagedllm:num_requests_running"] == 1
    after = wait_idle(server)
    assert after["pagedllm:kv_cache_usage_perc"] == 0


def test_32_concurrent_streams_run_together(server):
    async def one(client, i):
        body = {"model": MODEL, "prompt": [100 + i, 200, 300 + i], "max_tokens": 150, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        text = []
        async with client.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    text.append(line)
        return len(text)

    async def poll(stop: asyncio.Event):
        peak = 0
        async with httpx.AsyncClient(timeout=10) as c:
            while not stop.is_set():
                text = (await c.get(server.url + "/metrics")).text
                for line in text.splitlines():
                    if line.startswith("pagedllm:num_requests_running"):
                        peak = max(peak, float(line.rsplit(" ", 1)[1]))
                await asyncio.sleep(0.05)
        return peak

    async def main():
        stop = asyncio.Event()
        poller = asyncio.create_task(poll(stop))
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            counts = await asyncio.gather(*(one(client, i) for i in range(32)))
        stop.set()
        return counts, await poller

    counts, peak = asyncio.run(main())
    assert all(c > 0 for c in counts)
    assert peak >= 16
    assert wait_idle(server)["pagedllm:kv_cache_usage_perc"] == 0
