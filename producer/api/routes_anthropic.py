"""`POST /v1/messages`: Anthropic's Messages API, blocking and streaming, over the same queue
(producer/anthropic_messages.py says what translates). Errors come in Anthropic's shape. The API key
may come as Anthropic's clients send it (`x-api-key`) or as a bearer token.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Optional

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from producer.anthropic_messages import (MessagesRequest, MessageStreamWriter, anthropic_error, build_message,
                                         parse_messages_request, to_generation_request)
from producer.api.auth import ApiError, Tenant
from producer.api.gateway import Gateway, gateway
from producer.errors import InvalidRequest, MlxqError, WaitTimeout
from producer.openai_responses import merge_token_events, result_error

__all__ = ["router"]

router = APIRouter()


def _error(status: int, message: str, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(anthropic_error(status, message), status_code=status, headers=headers)


@router.post("/v1/messages", responses={200: {"description": "An Anthropic Message, or with stream=true its SSE events"}})
async def messages(request: Request) -> Any:
    gw = gateway(request)
    try:
        tenant = _tenant(gw, request)
        try:
            body = parse_messages_request(json.loads(await request.body() or b"null"))
            generation = to_generation_request(body, gw.settings.limits)
        except json.JSONDecodeError as exc:
            return _error(400, f"body: not JSON: {exc}")
        except InvalidRequest as exc:
            return _error(400, str(exc))
        if body.stream:
            job_id = await gw.submit(tenant, generation, None, validated=True)
            return EventSourceResponse(_events(gw, tenant, body, job_id), headers={"x-mlxq-job-id": job_id}, ping=15)
        try:
            job_ids, results = await gw.run_blocking(tenant, [generation], None, request)
        except WaitTimeout:
            return _error(504, f"no result within {gw.settings.request_timeout_s} s; the job was cancelled")
    except ApiError as exc:
        return _error(exc.status, str(exc), exc.headers)
    if results is None:
        return _error(499, "client disconnected")
    headers = {"x-mlxq-job-id": job_ids[0]}
    failed = result_error(results[0])
    if failed is not None:
        return _error(failed[0], failed[1]["error"]["message"], headers)
    if results[0].status == "cancelled":
        return _error(500, "the request was cancelled before it ended", headers)
    return JSONResponse(build_message(body, job_ids[0], results[0]), headers=headers)


def _tenant(gw: Gateway, request: Request) -> Tenant:
    authorization = request.headers.get("authorization")
    key = request.headers.get("x-api-key")
    return gw.auth.tenant(authorization if authorization or key is None else f"Bearer {key}")


async def _events(gw: Gateway, tenant: Tenant, body: MessagesRequest, job_id: str) -> AsyncIterator[dict[str, Any]]:
    """The SSE events of one streamed Message; a disconnect cancels the job."""
    writer = MessageStreamWriter(body, job_id)
    ended = False
    try:
        for name, data in writer.opening():
            yield {"event": name, "data": json.dumps(data)}
        try:
            stream = gw.client.stream(job_id, timeout=gw.settings.request_timeout_s)
            async for first in stream:
                out: list[tuple[str, dict[str, Any]]] = []
                for event in merge_token_events([first, *stream.take_ready()]):
                    if event["event"] == "token":
                        out += writer.token(event)
                        continue
                    ended = True
                    result = await gw.client.result(job_id) if event["event"] == "end" else None
                    failed = result_error(result) if result is not None else None
                    if result is None or failed is not None or result.status != "finished":
                        message = failed[1]["error"]["message"] if failed else f"the job ended: {event}"
                        out.append(("error", anthropic_error(failed[0] if failed else 500, message)))
                    else:
                        out += writer.closing(result)
                    break
                for name, data in out:
                    yield {"event": name, "data": json.dumps(data)}
                if ended:
                    break
        except MlxqError as exc:
            yield {"event": "error", "data": json.dumps(anthropic_error(500, f"{type(exc).__name__}: {exc}"))}
    finally:
        if not ended:
            await gw.cancel_quietly(job_id)
        with anyio.CancelScope(shield=True):
            await gw.admission.release(tenant, [job_id])
