"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and the
exception handlers that turn every failure of a request into one.

Handlers raise :class:`OpenAIError` (or let ``ValueError`` from parameter validation, the
scheduler's ``QueueFullError`` or ``EngineDeadError`` escape); :func:`install_error_handlers`
maps each onto its status code, so no failure leaves the server as a bare 500 or FastAPI's 422.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from roofline.engine.async_engine import EngineDeadError
from roofline.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """A request failure with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        # Never fail to encode the answer: a lone surrogate echoed from a request is escaped.
        if not message.isascii():
            message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.to_dict(), status_code=self.status, headers=headers)


_CONTEXT_RE = re.compile(r"max_model_len|context length|model length|maximum context", re.I)


def from_exception(e: BaseException, param: str | None = None) -> OpenAIError:
    """Classify an exception raised while validating or adding a request."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), code="engine_dead")
    if type(e).__name__ == "QueueFullError":
        return OpenAIError(429, f"the server is overloaded: {e}", code="queue_full")
    if isinstance(e, ValueError):
        message = str(e)
        if _CONTEXT_RE.search(message):
            return OpenAIError(
                400, message, param=param or "max_tokens", code="context_length_exceeded"
            )
        first = message.split(" ", 1)[0].split("[", 1)[0]
        return OpenAIError(
            400, message, param=first if first in _PARAMS else param, code="invalid_value"
        )
    logger.exception("unexpected error", exc_info=e)
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}")


_PARAMS = {f.name for f in fields(SamplingParams)} | {"prompt", "messages", "model"}


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return OpenAIError(
            400,
            f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
            code="invalid_json",
        )
    if first.get("type") == "missing" and not loc:
        return OpenAIError(400, "the request needs a JSON object body", code="missing_body")
    # Union errors list one entry per member type: name the field, not the member.
    path = [p for p in loc if p not in _TYPE_TAGS and "[" not in p and not p[:1].isupper()]
    where = ".".join(path) or "body"
    fields_hit = {tuple(str(p) for p in e.get("loc", ()))[:2] for e in errors}
    if len(fields_hit) == 1 and len(errors) > 1:
        msg = (
            "does not match any accepted type ("
            + "; ".join(sorted({e.get("msg", "") for e in errors}))
            + ")"
        )
    else:
        msg = first.get("msg", "invalid value")
    code = "invalid_type" if first.get("type", "").endswith("_type") else "invalid_value"
    return OpenAIError(
        400, f"invalid value for '{where}': {msg}", param=loc[0] if loc else None, code=code
    )


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return OpenAIError(exc.status_code, detail or "request failed").response()

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()
