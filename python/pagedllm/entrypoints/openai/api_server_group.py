"""`pagedllm serve --api-server-count N`: N HTTP front-end processes over one engine process
(vLLM's API server scale-out).

One Python event loop renders and sends every streamed chunk; at a few hundred concurrent
streams that loop, not the engine, sets the pace (tokens start to share chunks). With N > 1:

- this process starts the engine-core process with one pipe per front end
  (engine/core_client.start_engine_process; the engine namespaces each front end's request ids
  and routes their outputs back), binds the listening socket, and spawns N front-end processes;
- each front end is a whole server (engine/async_llm.AsyncLLM attached to its pipe, the FastAPI
  app, GracefulServer) accepting on the shared socket, so the kernel spreads connections over
  them;
- metrics come from the engine (its counters and the request histograms,
  engine/request_stats.py), so /metrics reads the same whichever front end answers; per-key rate
  limits would count per process and are refused with N > 1;
- SIGTERM here is passed to every front end once it handles signals itself (each drains as one
  server does; one that gets it while starting drains at once); Ctrl-C reaches them from the
  terminal. When one exits with an error (the engine died) the others are stopped the same way.
  When they have all exited, the engine process stops (its pipes closed). The exit status is the
  largest of theirs: 1 when the engine died.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import signal
import socket
import time

logger = logging.getLogger("pagedllm")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_api_servers(args: argparse.Namespace, engine_args) -> int:
    from pagedllm.engine.core_client import start_engine_process, stop_engine_process

    n = args.api_server_count
    sock = _bind(args.host, args.port)
    engine_proc, conns, info = start_engine_process(engine_args, n)
    ctx = multiprocessing.get_context("spawn")
    ready = [ctx.Event() for _ in range(n)]  # set once that server handles SIGTERM itself
    servers = [ctx.Process(target=api_server_main, name=f"pagedllm-api-server-{i}",
                           args=(i, args, sock, conns[i], info, ready[i])) for i in range(n)]
    signalled: list = []
    forwarded: set[int] = set()

    def forward_ready() -> None:  # SIGTERM to each server that can take it (it drains)
        for i, proc in enumerate(servers):
            if i not in forwarded and ready[i].is_set() and proc.is_alive():
                forwarded.add(i)
                proc.terminate()

    signal.signal(signal.SIGTERM, lambda signum, frame: signalled.append(signum))  # forwarded below
    signal.signal(signal.SIGINT, lambda signum, frame: None)  # the terminal sends it to every server too
    for proc in servers:
        proc.start()
    for conn in conns:  # theirs now: the engine sees a pipe close when its front end exits
        conn.close()
    sock.close()
    logger.info("%d API server processes on http://%s:%d (engine process %d)", n, args.host, args.port, info.pid)
    while any(proc.is_alive() for proc in servers):
        time.sleep(0.2)
        if not signalled and any(proc.exitcode not in (None, 0) for proc in servers):
            signalled.append(signal.SIGTERM)  # one failed (the engine died, or a crash): stop the rest
        if signalled:
            forward_ready()
    codes = [proc.exitcode for proc in servers]
    stop_engine_process(engine_proc, 30.0)
    bad = [c for c in codes if c]
    return max(1, *[abs(c) for c in bad]) if bad else 0


def api_server_main(index: int, args: argparse.Namespace, sock: socket.socket, conn, info, ready) -> None:
    """One front-end process: an AsyncLLM on its pipe to the engine, served on the shared socket. A
    SIGTERM that arrives while it starts (its siblings may already serve) drains it at once."""
    early: list = []
    signal.signal(signal.SIGTERM, lambda signum, frame: early.append(signum))
    ready.set()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[api {index}]: %(message)s")
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import serve

    engine = AsyncLLM(engine_conn=conn, engine_info=info)
    raise SystemExit(serve(args, engine, sockets=[sock], early_signals=early))
