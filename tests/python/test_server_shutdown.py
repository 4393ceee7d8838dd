"""Graceful shutdown of `pagedllm serve` (issue 31): on SIGTERM the server refuses new requests
with 503 (/health too), lets the requests in flight finish, and exits 0; past --shutdown-timeout
it aborts them (finish_reason "abort") and exits. An engine process that dies fails the requests
in flight and makes the server exit with status 1."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from server_utils import DEFAULT_ARGS, RemoteServer, tiny_model_dir  # noqa: E402


def _stream(url: str, body: dict, events: list, started: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                started.set()


def _run(timeout_s: float, max_tokens: int):
    server = RemoteServer(str(tiny_model_dir()), [*DEFAULT_ARGS, "--shutdown-timeout", str(timeout_s)])
    events: list = []
    started = threading.Event()
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": max_tokens, "ignore_eos": True}
    t = threading.Thread(target=_stream, args=(server.url, body, events, started))
    t.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    return server, t, events


def _finish_then_exit(server, t, events) -> list:
    """The streamed request's finish reasons, once it ended and the server exited with status 0."""
    t.join(60)
    assert server.proc.wait(30) == 0
    return [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]


def test_sigterm_drains_then_exits_zero():
    server, t, events = _run(60, 400)
    try:
        health = httpx.get(server.url + "/health", timeout=10)
        refused = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                             timeout=10)
        assert health.status_code == 503 and refused.status_code == 503
        assert "shutting down" in refused.json()["error"]["message"] and refused.headers["retry-after"]
        assert _finish_then_exit(server, t, events) == ["length"]  # the request in flight completed
    finally:
        server.stop()


def test_shutdown_timeout_aborts_what_is_still_running():
    server, t, events = _run(0.5, 480)
    try:
        assert _finish_then_exit(server, t, events) == ["abort"]  # cut short by the timeout
    finally:
        server.stop()


def test_engine_process_death_fails_requests_and_exits_one():
    """The engine runs in its own process (the default): when it dies, the request in flight ends
    with an error event, /health answers 503 until the server exits, and it exits with status 1.
    (A second request still sending its body keeps the drain open, so the 503 window is there to
    see; the server exits once that client gives up.)"""
    server = RemoteServer(str(tiny_model_dir()), DEFAULT_ARGS)
    try:
        events: list = []
        started = threading.Event()
        body = {"model": "tiny", "prompt": "a long story", "max_tokens": 480, "ignore_eos": True}
        t = threading.Thread(target=_stream, args=(server.url, body, events, started))
        t.start()
        assert started.wait(60)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        slow = socket.create_connection(("127.0.0.1", server.port))  # a body that never completes
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        time.sleep(0.3)
        os.kill(server.engine_pid(), signal.SIGKILL)
        statuses = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and 503 not in statuses and server.proc.poll() is None:
            try:
                statuses.append(httpx.get(server.url + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        slow.close()
        t.join(30)
        assert server.proc.wait(30) == 1
        assert statuses and statuses[-1] == 503 and set(statuses) <= {200, 503}, statuses
        errors = [e["error"] for e in events if "error" in e]
        assert errors and "engine" in errors[0]["message"], events[-3:]
        assert not any(c.get("finish_reason") == "length" for e in events for c in e.get("choices", []))
    finally:
        server.stop()
