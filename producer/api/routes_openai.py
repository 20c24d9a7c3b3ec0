"""`POST /v1/chat/completions`, `POST /v1/completions` (blocking and `stream=true`) and `GET /v1/models`.

A client that disconnects, from a blocking request or a stream, cancels its job.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal, Union

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from sse_starlette import EventSourceResponse

from producer.api.auth import ERRORS, Tenant
from producer.api.gateway import Gateway, current_tenant, gateway, invalid, wait_unless_disconnected
from producer.errors import InvalidRequest, MlxqError, WaitTimeout
from producer.lean_results import parse_result_lean
from producer.openai_requests import ChatCompletionRequest, CompletionRequest, OpenAIRequest, to_generation_request
from producer.openai_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    ChunkWriter,
    Completion,
    error_body,
    merge_token_events,
    response_entries,
    response_pieces,
    result_error,
)
from schemas import GenerationRequest, GenerationResult

__all__ = ["router"]

router = APIRouter()

STREAM_ABOVE_ENTRIES = 8192  # a response with more logprob entries than this is sent as it is made

_STREAMED = {"text/event-stream": {"schema": {"type": "string"}, "description": "with stream=true: SSE chunks"}}


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlxq"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(request: Request, tenant: Tenant = Depends(current_tenant)) -> ModelList:
    """The models live workers serve (their aliases and hub ids), from their heartbeats."""
    models = await gateway(request).fleet.models()
    return ModelList(data=[ModelObject(id=m.name, created=m.created) for m in sorted(models.values(), key=lambda m: m.name)])


@router.post("/v1/chat/completions", response_model=Union[ChatCompletion, ChatCompletionChunk],
             responses={**ERRORS, 200: {"content": _STREAMED}})
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           tenant: Tenant = Depends(current_tenant)) -> Any:
    return await _serve(gateway(request), tenant, body, request)


@router.post("/v1/completions", response_model=Completion, responses={**ERRORS, 200: {"content": _STREAMED}})
async def completions(body: CompletionRequest, request: Request, tenant: Tenant = Depends(current_tenant)) -> Any:
    return await _serve(gateway(request), tenant, body, request)


async def _serve(gw: Gateway, tenant: Tenant, body: OpenAIRequest, request: Request) -> Any:
    try:
        generation = to_generation_request(body, gw.settings.limits)
    except InvalidRequest as exc:
        raise invalid(exc) from None
    created = int(time.time())
    if body.stream:
        job_id = await gw.submit(tenant, generation, body.priority, validated=True)
        return EventSourceResponse(_chunks(gw, tenant, body, job_id, created), headers={"x-mlxq-job-id": job_id},
                                   ping=15)
    return await _blocking(gw, tenant, body, generation, request, created)


async def _blocking(gw: Gateway, tenant: Tenant, body: OpenAIRequest, generation: GenerationRequest,
                    request: Request, created: int) -> Any:
    """Submit the job, wait for its result, answer it (or the error it ended with)."""
    job_id = gw.new_job_id(tenant)
    headers = {"x-mlxq-job-id": job_id}
    reader = gw.admission.settling(tenant)
    # Watched before it is submitted, so its end is announced and the wait reads nothing until then.
    async with gw.client._watch([job_id]) as watch:

        async def wait() -> GenerationResult:
            return (await watch.wait(gw.settings.request_timeout_s, read=reader, submitted_after=True))[job_id]

        await gw.submit(tenant, generation, body.priority, job_id, validated=True)
        try:
            result = await wait_unless_disconnected(request, wait())
        except WaitTimeout:
            await gw.cancel_quietly(job_id)
            return JSONResponse(error_body(f"no result within {gw.settings.request_timeout_s} s; the job was cancelled",
                                           "timeout", code="timeout"), status_code=504, headers=headers)
        finally:
            with anyio.CancelScope(shield=True):
                await reader.release_rest([job_id])
    if result is None:  # the client went away: nobody will read the answer
        await gw.cancel_quietly(job_id)
        return JSONResponse(error_body("client disconnected", code="client_disconnected"), status_code=499)
    failed = result_error(result)
    if failed is not None:
        return JSONResponse(failed[1], status_code=failed[0], headers=headers)
    pieces = response_pieces(body, job_id, result, created)
    if response_entries(result) <= STREAM_ABOVE_ENTRIES:
        return Response(b"".join(pieces), media_type="application/json", headers=headers)
    # Made piece by piece on a worker thread as the client reads it (docs/gateway.md, "Large results").
    return StreamingResponse(pieces, media_type="application/json", headers=headers)


async def _chunks(gw: Gateway, tenant: Tenant, body: OpenAIRequest, job_id: str, created: int) -> AsyncIterator[bytes]:
    """The SSE messages of one streamed response; cancelling the iteration (a disconnect) cancels the
    job. The events read together go out in one write, each choice's tokens in one chunk."""
    writer = ChunkWriter(body, job_id, created)
    ended = False
    try:
        opening = writer.opening()
        if opening:
            yield _sse(*opening)
        try:
            stream = gw.client.stream(job_id, timeout=gw.settings.request_timeout_s)
            async for first in stream:
                messages = []
                for event in merge_token_events([first, *stream.take_ready()]):
                    if event["event"] == "token":
                        messages.append(writer.token(event))
                        continue
                    ended = True
                    if event["event"] == "restart":  # what was sent cannot be taken back: say so, let the job run
                        messages.append(error_body(f"the job restarted ({event['reason']}); its result will be "
                                                   f"at /v1/jobs/{job_id}", "server_error", code="JobRestarted"))
                    else:
                        state = (await gw.client._read_states([job_id], parse_result_lean))[0]
                        result = await gw.client._settled(state)
                        messages += writer.closing(result) if result is not None else []
                    break
                yield _sse(*messages)
                if ended:
                    break
        except MlxqError as exc:
            yield _sse(error_body(str(exc), "server_error", code=type(exc).__name__))
        yield b"data: [DONE]\r\n\r\n"
    finally:
        if not ended:
            await gw.cancel_quietly(job_id)
        await _release(gw, tenant, job_id)


def _sse(*messages: dict[str, Any]) -> bytes:
    """SSE `data:` messages of JSON objects, as one write (line ends as sse-starlette writes them)."""
    return b"".join(b"data: " + json.dumps(message).encode() + b"\r\n\r\n" for message in messages)


async def _release(gw: Gateway, tenant: Tenant, job_id: str) -> None:
    with anyio.CancelScope(shield=True):
        await gw.admission.release(tenant, [job_id])
