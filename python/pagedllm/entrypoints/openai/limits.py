"""Request size limit: an ASGI middleware that refuses a request body over ``max_bytes`` before
anything parses it (413 with an OpenAI error object naming ``--max-request-bytes``).

A declared Content-Length over the limit is refused without reading the body; a body without one
(chunked) is read up to the limit and refused as soon as it passes it; a body within the limit is
handed to the app unchanged. So a 10 MB prompt costs neither JSON parsing nor tokenization, and
the process does not grow with such requests.

``default_max_request_bytes(max_model_len)``: 1 MiB or 64 bytes per context token, whichever is
larger — room for a prompt of max_model_len tokens as text (a few bytes per token) or as JSON token
ids (up to 7 bytes each) plus the rest of the request.
"""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.errors import error_body


def default_max_request_bytes(max_model_len: int) -> int:
    return max(1 << 20, 64 * int(max_model_len))


class RequestSizeLimit:
    """ASGI middleware: HTTP request bodies of at most max_bytes bytes (see the module docstring)."""

    def __init__(self, app, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = int(max_bytes)

    async def _refuse(self, send, size: str) -> None:
        message = (f"the request body is {size} bytes, more than the server's limit of {self.max_bytes} bytes "
                   f"(--max-request-bytes)")
        body = json.dumps(error_body(message, 413).model_dump()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, declared.decode())
        chunks, total, more = [], 0, True
        while more:  # read the body (bounded) before the app sees it
            message = await receive()
            if message["type"] != "http.request":  # a disconnect: let the app see it
                chunks.append(message)
                break
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                return await self._refuse(send, f"more than {self.max_bytes}")
            chunks.append(message)
            more = message.get("more_body", False)
        pending = iter(chunks)

        async def replay():
            for message in pending:
                return message
            return await receive()

        return await self.app(scope, replay, send)


__all__ = ["RequestSizeLimit", "default_max_request_bytes"]
