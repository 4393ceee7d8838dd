"""Graceful shutdown and engine death for the server process.

``InFlight`` (ASGI middleware) counts the HTTP requests in progress (a streamed response until its
last chunk) and, once ``draining`` is set, answers new requests with 503 (OpenAI error object,
Retry-After) — /health included, so a load balancer takes the instance out.

``GracefulServer`` (a uvicorn.Server): the first SIGTERM / SIGINT starts draining instead of
exiting; the server exits once no request is in flight, or after ``shutdown_timeout`` seconds,
when the requests still running are aborted (their clients get a final chunk / response with
finish_reason "abort") and the engine is shut down. A second signal exits at once. If the engine
dies (its thread raised), the server drains the same way and the process exits with status 1.
"""

from __future__ import annotations

import json
import logging
import time

import uvicorn

from pagedllm.entrypoints.openai.errors import error_body

logger = logging.getLogger("pagedllm")


class InFlight:
    """ASGI middleware: counts HTTP requests in progress; 503 for new ones while draining."""

    def __init__(self, app):
        self.app = app
        self.count = 0
        self.draining = False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.draining:
            body = json.dumps(error_body("the server is shutting down; retry on another instance", 503)
                              .model_dump()).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn.Server draining on the first signal (module docstring). exit_code: 1 if the engine
    died, else 0."""

    def __init__(self, config: uvicorn.Config, engine, in_flight: InFlight, shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.in_flight = in_flight
        self.shutdown_timeout = float(shutdown_timeout)
        self.exit_code = 0
        self._deadline = None  # draining: when to abort what is still in flight
        self._aborted_at = None  # the abort's time: its final responses get 5 s, then exit anyway

    def handle_exit(self, sig, frame) -> None:
        if self._deadline is not None:  # a second signal: now
            return super().handle_exit(sig, frame)
        logger.info("signal %s: draining (no new requests; up to %.0f s for %d in flight)", sig,
                    self.shutdown_timeout, self.in_flight.count)
        self._start_drain()

    def _start_drain(self) -> None:
        self.in_flight.draining = True
        self._deadline = time.monotonic() + self.shutdown_timeout

    async def on_tick(self, counter: int) -> bool:
        if self._deadline is None and not self.engine.is_running and not self.should_exit:
            logger.error("the engine died: draining and exiting with status 1")
            self.exit_code = 1
            self._start_drain()
        if self._deadline is not None:
            now = time.monotonic()
            if self.in_flight.count == 0 or (self._aborted_at is not None and now >= self._aborted_at + 5.0):
                self.should_exit = True
            elif self._aborted_at is None and now >= self._deadline:
                logger.warning("--shutdown-timeout reached with %d requests in flight: aborting them",
                               self.in_flight.count)
                await self.engine.abort_all()
                self._aborted_at = now
        return await super().on_tick(counter)

__all__ = ["GracefulServer", "InFlight"]
