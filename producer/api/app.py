"""The gateway's FastAPI application: routes, OpenAI-shaped errors, body limits, and the batch driver
running beside the routes. `create_app(settings)`; `mlxq api` serves it with uvicorn, with the
deadlines of producer/api/http_deadlines.py (`uvicorn_options()`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Optional

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.api import (routes_anthropic, routes_control, routes_dashboard, routes_files, routes_jobs, routes_metrics,
                          routes_openai)
from producer.anthropic_messages import anthropic_error
from producer.api.auth import ApiError
from producer.api.batch_driver import BatchDriver
from producer.api.routes_anthropic import is_anthropic_path
from producer.api.gateway import Gateway
from producer.api.http_deadlines import STATE_KEY, HttpDeadlines
from producer.api.settings import GatewaySettings
from producer.done_listener import stop_reader
from producer.errors import BrokerError, InvalidRequest
from producer.openai_responses import error_body
from schemas.request import field_named_in

__all__ = ["create_app"]

log = logging.getLogger("mlxq.api")
MULTIPART_OVERHEAD = 1024 * 1024  # room for a file upload's form fields and boundaries


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        gw = Gateway.build(settings)
        app.state.gateway = gw
        driver = asyncio.get_running_loop().create_task(BatchDriver(gw, gw.batches).run(), name="mlxq-batch-driver")
        try:  # the lifespan state reaches uvicorn's connections: the deadlines of DeadlineProtocol
            yield {STATE_KEY: HttpDeadlines(settings.header_timeout_s, settings.body_timeout_s)}
        finally:
            # Cancelled until it ends: a single cancel that redis-py swallowed left the shutdown
            # waiting on the driver for good, and the driver running on.
            await stop_reader(driver)
            await gw.close()

    app = FastAPI(title="mlxq gateway", version="1", lifespan=lifespan,
                  description="OpenAI-compatible chat, completions, files and batches over mlxq's queue, and "
                              "mlxq's own jobs. See docs/gateway.md.")
    for router in (routes_openai.router, routes_anthropic.router, routes_jobs.router, routes_files.router, routes_control.router,
                   routes_metrics.router, routes_dashboard.router):
        app.include_router(router)
    _add_error_handlers(app)
    app.add_middleware(BodyLimit, default=settings.max_body_bytes,
                       uploads=settings.file_max_bytes + MULTIPART_OVERHEAD)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _answer(request.url.path, exc.status, exc.body, exc.headers)

    @app.exception_handler(InvalidRequest)
    async def invalid_request(request: Request, exc: InvalidRequest) -> JSONResponse:
        return _answer(request.url.path, 400, error_body(str(exc), param=exc.field))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
        param = ".".join(loc) or field_named_in(str(first.get("msg", "")))  # a model-level check names it first
        detail = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid")
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return _answer(request.url.path, 400, error_body(f"invalid request: {param or 'body'}: {detail}{more}",
                                                         param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Starlette's Allow names one route's methods; a path may have several
            methods = {m for route in app.routes if isinstance(route, APIRoute) and route.path_regex.match(request.url.path)
                       for m in route.methods if m != "HEAD"}
            headers = {"Allow": ", ".join(sorted(methods))}
        return _answer(request.url.path, exc.status_code, error_body(str(exc.detail), code=code), headers)

    @app.exception_handler(BrokerError)
    @app.exception_handler(redis.RedisError)  # one no producer call wrapped: Redis away (or busy) all the same
    async def broker_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("redis: %s", exc)
        return _answer(request.url.path, 503,
                       error_body("the queue's Redis cannot be reached", "server_error", code="broker_error"))


def _answer(path: str, status: int, body: dict[str, Any], headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """An error: in OpenAI's shape, or on Anthropic's route in Anthropic's."""
    if is_anthropic_path(path):
        body = anthropic_error(status, body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=headers)


class BodyLimit:
    """413 for a request body over its limit (uploads to /v1/files have their own), counted as it
    arrives; an upload must say its length (411 otherwise), a JSON body may be chunked."""

    def __init__(self, app: ASGIApp, default: int, uploads: int) -> None:
        self.app, self.default, self.uploads = app, default, uploads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return await self.app(scope, receive, send)
        upload = scope["path"].rstrip("/") == "/v1/files"
        limit = self.uploads if upload else self.default
        length = dict(scope["headers"]).get(b"content-length")
        if length is None and upload:
            return await _reply(send, 411, error_body("Content-Length is required for uploads", code="length_required"))
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _reply(send, 413, _too_large(limit), scope["path"])
        if length is not None:
            return await self.app(scope, receive, send)
        body, more = [], True  # chunked: read it all here, within the limit
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            if size > limit:
                return await _reply(send, 413, _too_large(limit), scope["path"])
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _too_large(limit: int) -> dict[str, Any]:
    return error_body(f"request body exceeds the limit of {limit} bytes", code="request_too_large")


async def _reply(send: Send, status: int, body: dict[str, Any], path: str = "") -> None:
    response = _answer(path, status, body)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
