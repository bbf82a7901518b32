"""The FastAPI app of the OpenAI-compatible server and its uvicorn runner.

``build_app`` wires an :class:`AsyncLLMEngine` to the routes (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``), installs the OpenAI-shaped
error handlers, and wraps the app in two plain ASGI middlewares: the API key check (401 before
the body is read; on every path but ``/health``, which load balancers poll, unless the operator
leaves ``/metrics`` and the API docs open) and the body-size limit (413, the body is buffered up
to the limit and replayed to the app, so chunked uploads are bounded too). A POST body to
``/v1`` is read as JSON whatever its ``Content-Type`` says (``curl -d`` sends a form type).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from roofline.engine.async_engine import AsyncLLMEngine
from roofline.entrypoints.openai import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_SEQS_PER_REQUEST
from roofline.entrypoints.openai.errors import OpenAIError, install_error_handlers
from roofline.entrypoints.openai.metrics import ServerMetrics
from roofline.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from roofline.entrypoints.openai.serving_base import ServingState
from roofline.entrypoints.openai.serving_chat import create_chat_completion
from roofline.entrypoints.openai.serving_completion import create_completion

logger = logging.getLogger(__name__)


async def _send_error(send: Send, error: OpenAIError) -> None:
    body = json.dumps(error.to_dict()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


OPEN_PATHS = frozenset({"/health"})
"""Paths served without the API key."""
DOCS_AND_METRICS_PATHS = frozenset({"/metrics", "/docs", "/docs/oauth2-redirect", "/redoc"})
"""Paths that ``public_docs_and_metrics`` opens too (with ``/openapi.json``)."""


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every path but ``open_paths``."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _send_error(
                    send,
                    OpenAIError(
                        401,
                        "invalid or missing API key (send 'Authorization: Bearer <key>')",
                        code="invalid_api_key",
                    ),
                )
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses bodies over ``max_bytes`` with a 413; buffers the rest and replays it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        too_large = OpenAIError(
            413,
            f"the request body is over the limit of {self.max_bytes} bytes",
            code="request_too_large",
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await _send_error(send, OpenAIError(400, "invalid Content-Length header"))
                return
            if int(length) > self.max_bytes:
                await _send_error(send, too_large)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _send_error(send, too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class JsonBodyMiddleware:
    """Marks every POST body to ``/v1`` as JSON: a body sent without a ``Content-Type``, or
    with a form or text type (``curl -d``), is parsed as JSON (a 400 if it is not)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"].startswith("/v1/")
        ):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            given = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip()
            if not (given == b"application/json" or given.endswith(b"+json")):
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)
}


def build_app(
    engine: AsyncLLMEngine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allow_request_chat_template: bool = False,
    model_root: str | None = None,
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST,
    public_docs_and_metrics: bool = False,
    tool_call_parser: str = "auto",
    reasoning_parser: str | None = None,
    structured_outputs_backend: str = "auto",
) -> FastAPI:
    """The app for one engine. Attaches a :class:`ServerMetrics` observer to the engine
    unless it already has one. With an ``api_key`` every path but ``/health`` needs it
    (``public_docs_and_metrics`` leaves ``/metrics``, ``/docs``, ``/openapi.json`` open)."""
    name = served_model_name or engine.model_name
    metrics = engine.observer if isinstance(engine.observer, ServerMetrics) else None
    if metrics is None:
        metrics = ServerMetrics(name)
        engine.observer = metrics
    state = ServingState(
        engine,
        name,
        model_root,
        allow_request_chat_template,
        max_seqs_per_request,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        structured_outputs_backend=structured_outputs_backend,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if state.template_renderer is not None:
            await state.template_renderer.close()

    app = FastAPI(title="roofline OpenAI-compatible server", version="0.1", lifespan=lifespan)
    app.state.serving = state
    app.state.metrics = metrics
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_dead:
            return OpenAIError(
                503, f"the engine loop is dead: {engine.dead_error!r}", code="engine_dead"
            ).response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def card() -> ModelCard:
        return ModelCard(id=name, root=model_root, max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model_id: str) -> ModelCard:
        state.check_model(model_id)
        return card()

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={200: {"model": CompletionResponse}, **_ERRORS},
    )
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await create_completion(state, body, raw)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: {"model": ChatCompletionResponse}, **_ERRORS},
    )
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await create_chat_completion(state, body, raw)

    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:  # added last, so it runs first: no body is read without the key
        open_paths = OPEN_PATHS
        if public_docs_and_metrics:
            open_paths |= DOCS_AND_METRICS_PATHS | {app.openapi_url or "/openapi.json"}
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)
    return app


def run_server(
    engine: AsyncLLMEngine, app: FastAPI, host: str, port: int, log_level: str = "info"
) -> None:
    """Serve until interrupted, then stop the engine thread."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    try:
        server.run()
    finally:
        engine.shutdown()
