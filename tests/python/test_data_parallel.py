"""Data parallelism (`pagedllm serve --data-parallel-size 2`, engine/data_parallel.py): two engine
replicas behind one server. 64 concurrent requests are all answered, greedy outputs equal those of
a one-replica server, both replicas served some (per-replica metrics, label engine); killing one
replica's process fails its request in flight with an error, /health turns 503 and the other
replica keeps answering; misconfigurations are refused before anything starts."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_utils import DEFAULT_ARGS, RemoteServer, tiny_model_dir  # noqa: E402

PROMPTS = [f"Request number {i}: tell me about the harbour." for i in range(64)]


def complete(server, prompt, max_tokens=8):
    r = httpx.post(server.url + "/v1/completions", timeout=180,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                         "ignore_eos": True})
    return r.status_code, r.json()


@pytest.fixture(scope="module")
def dp_server():
    server = RemoteServer(str(tiny_model_dir()), [*DEFAULT_ARGS, "--data-parallel-size", "2"])
    yield server
    server.stop()


def test_requests_are_spread_over_both_replicas(dp_server, server):
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: complete(dp_server, p), PROMPTS))
    assert all(status == 200 for status, _ in results), [r for r in results if r[0] != 200][:2]
    single = [complete(server, p) for p in PROMPTS[:8]]  # the shared one-replica server, same model
    assert [r[1]["choices"][0]["text"] for r in results[:8]] == [r[1]["choices"][0]["text"] for r in single]
    metrics = dp_server.metrics()
    served = {e: sum(v for k, v in metrics.items() if k.startswith("pagedllm:request_success_total{")
                     and f'engine="{e}"' in k and "model_name" not in k) for e in ("0", "1")}
    assert served["0"] > 0 and served["1"] > 0 and served["0"] + served["1"] >= 64, served
    assert httpx.get(dp_server.url + "/health", timeout=5).status_code == 200


def test_misconfigurations_are_refused():
    for extra, message in ((["--data-parallel-size", "0"], "data_parallel_size"),
                           (["--data-parallel-size", "2", "--api-server-count", "2"], "api-server-count")):
        with pytest.raises(RuntimeError, match=message):
            RemoteServer(str(tiny_model_dir()), [*DEFAULT_ARGS, *extra], timeout=60)
    from pagedllm import LLM

    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(str(tiny_model_dir()), data_parallel_size=2)


def test_a_dead_replica_fails_its_requests_and_the_other_keeps_serving():
    server = RemoteServer(str(tiny_model_dir()), [*DEFAULT_ARGS, "--data-parallel-size", "2"])
    try:
        pids = [int(p) for p in re.findall(r"engine core process (\d+) ready", server.read_log())]
        assert len(pids) == 2 and set(pids) <= set(server.spawned_children()), (pids, server.spawned_children())
        events, started = [], threading.Event()

        def stream():  # the first request goes to replica 0 (both idle: the lowest index)
            body = {"model": "tiny", "prompt": "a long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        os.kill(pids[0], signal.SIGKILL)
        t.join(60)
        errors = [e["error"] for e in events if "error" in e]
        assert errors and "engine" in errors[0]["message"], events[-3:]
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health did not turn 503"
            time.sleep(0.1)
        for p in PROMPTS[:6]:  # the live replica takes every new request
            status, body = complete(server, p)
            assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert server.proc.poll() is None  # the server keeps running with one replica
    finally:
        server.stop()


def test_gpu_replicas_each_see_their_own_tp_x_pp_gpus(monkeypatch):
    """On an (pretended) 8-GPU machine, replica i of -dp 2 -tp 2 -pp 2 starts with
    CUDA_VISIBLE_DEVICES = GPUs 4i..4i+3 (of the visible list, kept in order), restored afterwards;
    more GPUs than visible and DP x Ray on GPUs are refused by name."""
    import os

    import torch

    from pagedllm.engine.data_parallel import check_data_parallel, replica_device
    from pagedllm.engine.llm_engine import EngineArgs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")
    args = EngineArgs(model=None, device="cuda", data_parallel_size=2, tensor_parallel_size=2,
                      pipeline_parallel_size=2)
    assert check_data_parallel(args) == 2
    seen = []
    for i in range(2):
        with replica_device(args, i):
            seen.append(os.environ["CUDA_VISIBLE_DEVICES"])
    assert seen == ["7,6,5,4", "3,2,1,0"] and os.environ["CUDA_VISIBLE_DEVICES"] == "7,6,5,4,3,2,1,0"
    with pytest.raises(ValueError, match="needs 16 GPUs, but 8 are visible"):
        check_data_parallel(EngineArgs(model=None, device="cuda", data_parallel_size=2, tensor_parallel_size=4,
                                       pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="distributed_executor_backend='ray' on GPUs"):
        check_data_parallel(EngineArgs(model=None, device="cuda", data_parallel_size=2, tensor_parallel_size=2,
                                       distributed_executor_backend="ray"))
