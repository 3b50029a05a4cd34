"""The Starlette application: routes, the API-key check, OpenAI-shaped errors, the backend's lifespan."""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from agentserve.gateway.backend import Backend, GatewayOptions
from agentserve.gateway.chat import chat_completions
from agentserve.gateway.completions import completions
from agentserve.gateway.errors import APIError, bad_request, unauthorized
from agentserve.gateway.info_routes import health, metrics, model, models
from agentserve.gateway.tokenize_routes import detokenize, tokenize
from agentserve.gateway.worker_routes import flush_cache, get_load, health_generate, model_info, server_info

log = logging.getLogger("agentserve.gateway")

OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})  # no API key: probes, scrapers


class APIKeyCheck:
    """ASGI middleware: ``Authorization: Bearer KEY`` on every path but :data:`OPEN_PATHS` (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # the scheme is case-insensitive (RFC 9110); the key is compared in constant time
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.expected):
                await JSONResponse(unauthorized().body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)  # a 405's Allow


async def _bad_value(request: Request, exc: Exception) -> JSONResponse:
    """Input no check above caught that Python cannot take further: a 400, not a 500 that drops the connection."""
    why = ("an integer in the request does not fit in 64 bits" if isinstance(exc, OverflowError)
           else "the request is nested too deeply")
    error = bad_request(why)
    return JSONResponse(error.body(), status_code=400)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error serving %s %s", request.method, request.url.path)
    error = APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
    return JSONResponse(error.body(), status_code=500)


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *worker_routes(),
    ]


def worker_routes() -> list[Route]:
    """SGLang's worker endpoints that a router (the SGLang Model Gateway) calls (gateway/worker_routes.py)."""
    return [
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/get_load", get_load, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["POST"]),
        Route("/health_generate", health_generate, methods=["GET"]),
    ]


class RequestCounter:
    """ASGI middleware: ``agentserve:http_requests_total{path, status}`` (known routes only: no label for
    every path a scanner tries)."""

    def __init__(self, app: ASGIApp, backend: Backend, paths: frozenset[str]) -> None:
        self.app = app
        self.backend = backend
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            metrics = self.backend.metrics
            if metrics is not None:
                path = scope["path"] if scope["path"] in self.paths else "other"
                metrics.http_requests.labels(path=path, status=str(status[0])).inc()


def build_app(options: GatewayOptions) -> Starlette:
    backend = Backend(options)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        backend.start()
        try:
            yield
        finally:
            await backend.stop()

    handlers: dict[Any, Any] = {APIError: _api_error, HTTPException: _http_error, OverflowError: _bad_value,
                                RecursionError: _bad_value, Exception: _unexpected}
    table = routes()
    app = Starlette(routes=table, exception_handlers=handlers, lifespan=lifespan)
    app.state.backend = backend
    if options.api_key:
        app.add_middleware(APIKeyCheck, api_key=options.api_key)
    app.add_middleware(RequestCounter, backend=backend, paths=frozenset(r.path for r in table))
    return app
