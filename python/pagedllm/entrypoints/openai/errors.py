"""Errors as OpenAI error objects, and the FastAPI exception handlers that produce them.

Every client mistake becomes a 4xx JSON body ``{"error": {"message", "type", "param", "code"}}``
whose message names the bad field; an unexpected exception becomes a 500 with the same shape,
and the server keeps serving either way.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("pagedllm")

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
          413: "RequestTooLarge", 422: "BadRequestError", 429: "RateLimitError", 503: "ServiceUnavailableError",
          500: "InternalServerError"}


class OpenAIError(Exception):
    """An error answered as an OpenAI error object. status: HTTP status; param: the field."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers


def error_body(message: str, status: int, param: Optional[str] = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=_TYPES.get(status, "BadRequestError"),
                                         param=param, code=status))


def error_response(message: str, status: int = 400, param: Optional[str] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param).model_dump(), status_code=status, headers=headers)


def from_value_error(exc: ValueError) -> OpenAIError:
    """A ValueError of SamplingParams / the engine (its message starts with the field name)."""
    message = str(exc)
    first = message.split(" ", 1)[0].rstrip(":,.")
    parts = first.split(".")  # a dotted field names its top-level request field (structured_outputs.regex)
    param = parts[0] if all(p.isidentifier() and p.islower() for p in parts) else None
    return OpenAIError(message, 400, param)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "[key]"}


def _loc_name(loc) -> str:
    """("body", "messages", 0, "content", "str") -> "messages[0].content" (pydantic adds union
    member tags such as "str" or "list[int]" to the location; they are not field names)."""
    out = ""
    for p in loc:
        if p == "body" and not out:
            continue
        if isinstance(p, int):
            out += f"[{p}]"
            continue
        p = str(p)
        if p in _TYPE_TAGS or "[" in p or p[:1].isupper():
            continue
        out += ("." if out else "") + p
    return out or "body"


def validation_message(errors) -> tuple[str, Optional[str]]:
    """One line per pydantic error, each naming the field; returns (message, first field)."""
    lines, first = [], None
    for err in errors[:8]:
        if err.get("type") == "json_invalid":
            lines.append(f"body: the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
            first = first or "body"
            continue
        name = _loc_name(err.get("loc", ()))
        if err.get("type") == "missing" and name == "body":
            lines.append("body: a JSON object is required")
        else:
            lines.append(f"{name}: {err.get('msg', 'invalid value')}")
        first = first or name.split("[")[0].split(".")[0]
    return "; ".join(lines), first


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError):
        return error_response(exc.message, exc.status, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code, None, getattr(exc, "headers", None))

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError):
        err = from_value_error(exc)
        return error_response(err.message, err.status, err.param)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        logger.exception("unexpected error while serving a request")
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)


__all__ = ["OpenAIError", "error_body", "error_response", "from_value_error", "install_handlers",
           "validation_message"]
