"""`pagedllm serve --api-server-count 2` (vLLM's API server scale-out): two HTTP front-end
processes share the port and one engine process. Concurrent streamed requests all complete with
the greedy answer a single request gets; /metrics reports the same totals whichever front end
answers (the engine owns the series); SIGTERM drains both and exits 0; a dead engine makes the
server exit 1; per-process rate limits are refused with N > 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_utils import DEFAULT_ARGS, RemoteServer, package_root, tiny_model_dir  # noqa: E402

BODY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    s = RemoteServer(str(tiny_model_dir()), [*DEFAULT_ARGS, "--api-server-count", "2"])
    yield s
    s.stop()


def _stream_text(url: str) -> str:
    text = []
    with httpx.Client(timeout=120) as client:  # a connection of its own
        with client.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


def test_two_front_ends_serve_concurrent_streams_with_the_same_answers(server):
    assert len(server.spawned_children()) == 3  # the engine process and two front ends
    expected = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    assert expected
    results: list = [None] * 16
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _stream_text(server.url))) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [expected] * 16


def test_metrics_are_the_same_from_either_front_end(server):
    before = server.metrics()['pagedllm:request_success_total{finished_reason="length"}']
    for _ in range(5):
        httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).raise_for_status()
    seen = {server.metrics()['pagedllm:request_success_total{finished_reason="length"}'] for _ in range(8)}
    assert seen == {before + 5}, seen  # eight fresh connections, spread over both front ends


def test_sigterm_drains_both_front_ends_and_stops_the_engine():
    s = RemoteServer(str(tiny_model_dir()), [*DEFAULT_ARGS, "--api-server-count", "2"])
    try:
        children = s.spawned_children()
        assert len(children) == 3
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0
        time.sleep(0.5)
        assert not [c for c in children if Path(f"/proc/{c}").exists()]  # no process left behind
    finally:
        s.stop()


def test_engine_death_exits_one():
    s = RemoteServer(str(tiny_model_dir()), [*DEFAULT_ARGS, "--api-server-count", "2"])
    try:
        os.kill(s.engine_pid(), signal.SIGKILL)
        assert s.proc.wait(60) == 1
    finally:
        s.stop()


def test_rate_limits_are_refused_with_several_front_ends():
    cmd = [sys.executable, "-m", "pagedllm", "serve", str(tiny_model_dir()), *DEFAULT_ARGS, "--api-server-count", "2",
           "--rate-limit-rpm", "10"]
    env = dict(os.environ, PYTHONPATH=package_root())
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--api-server-count 1" in out.stderr, out.stderr[-2000:]
