"""`POST /v1/messages`: Anthropic's Messages API, blocking and streaming, over the same queue
(producer/anthropic_messages.py says what translates). Every error on this path comes in Anthropic's
shape (the app's handlers reshape them: `is_anthropic_path`). The API key may come as Anthropic's
clients send it (`x-api-key`) or as a bearer token.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal, Optional

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from producer.anthropic_messages import (MESSAGES_PATH, MessagesRequest, MessageStreamWriter, anthropic_error,
                                         build_message, to_generation_request)
from producer.api.auth import ApiError, Tenant
from producer.api.gateway import Gateway, event_stream, gateway, invalid
from producer.errors import InvalidRequest, MlxqError, WaitTimeout
from producer.openai_responses import merge_token_events, result_error

__all__ = ["is_anthropic_path", "router"]

router = APIRouter()


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Optional[str] = None
    stop_sequence: Optional[str] = None
    usage: MessageUsage


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicErrorBody, "description": description}
    for status, description in ((400, "Invalid request"), (401, "Missing or unknown API key"),
                                (404, "Unknown model"), (413, "Body too large"),
                                (429, "Queue too deep, or the tenant's jobs in flight at the cap"),
                                (503, "No live worker serves the model"), (504, "No result in time"))
}
_STREAMED = {"text/event-stream": {"schema": {"type": "string"}, "description": "with stream=true: Anthropic's events"}}


def is_anthropic_path(path: str) -> bool:
    return path.rstrip("/") == MESSAGES_PATH


_bearer = HTTPBearer(auto_error=False, description="An API key of the gateway (MLXQ_API_KEYS)")
_api_key = APIKeyHeader(name="x-api-key", auto_error=False, description="The same key, as Anthropic's clients send it")


async def messages_tenant(request: Request, credentials: Optional[HTTPAuthorizationCredentials] = Depends(_bearer),
                          key: Optional[str] = Depends(_api_key)) -> Tenant:
    header = f"{credentials.scheme} {credentials.credentials}" if credentials else (f"Bearer {key}" if key else None)
    return gateway(request).auth.tenant(header)


def _error(status: int, message: str, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(anthropic_error(status, message), status_code=status, headers=headers)


@router.post(MESSAGES_PATH, response_model=Message, responses={**_ERRORS, 200: {"content": _STREAMED}})
async def messages(body: MessagesRequest, request: Request, tenant: Tenant = Depends(messages_tenant)) -> Any:
    gw = gateway(request)
    try:
        generation = to_generation_request(body, gw.settings.limits)
    except InvalidRequest as exc:
        raise invalid(exc) from None
    if body.stream:
        job_id = await gw.submit(tenant, generation, None, validated=True)
        return event_stream(gw, lambda shutdown: _events(gw, tenant, body, job_id, shutdown),
                            headers={"x-mlxq-job-id": job_id})
    try:
        job_ids, results = await gw.run_blocking(tenant, [generation], None, request)
    except WaitTimeout:
        raise ApiError(504, f"no result within {gw.settings.request_timeout_s} s; the job was cancelled") from None
    if results is None:
        return _error(499, "client disconnected")
    headers = {"x-mlxq-job-id": job_ids[0]}
    failed = result_error(results[0])
    if failed is not None:
        return _error(failed[0], failed[1]["error"]["message"], headers)
    if results[0].status == "cancelled":
        return _error(500, "the request was cancelled before it ended", headers)
    return JSONResponse(build_message(body, job_ids[0], results[0]), headers=headers)


async def _events(gw: Gateway, tenant: Tenant, body: MessagesRequest, job_id: str,
                  shutdown: anyio.Event) -> AsyncIterator[dict[str, Any]]:
    """The SSE events of one streamed Message; a disconnect cancels the job, the gateway's shutdown does not."""
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
        # Cut at shutdown, the job runs on, holding its slot until its result exists (admission's sweep
        # then frees it).
        runs_on = not ended and shutdown.is_set()
        if not ended and not runs_on:
            await gw.cancel_quietly(job_id)
        if not runs_on:
            with anyio.CancelScope(shield=True):
                await gw.admission.release(tenant, [job_id])
