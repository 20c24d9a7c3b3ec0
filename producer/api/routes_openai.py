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

from producer.api.auth import ERRORS, Tenant
from producer.api.gateway import Gateway, current_tenant, event_stream, gateway, invalid
from producer.errors import InvalidRequest, MlxqError, WaitTimeout
from producer.lean_results import parse_result_lean
from producer.openai_requests import ChatCompletionRequest, CompletionRequest, OpenAIRequest, to_generation_requests
from producer.openai_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    ChunkWriter,
    Completion,
    build_response,
    dump,
    error_body,
    merge_completions,
    merge_token_events,
    response_entries,
    response_pieces,
    result_error,
)
from schemas import GenerationRequest

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
        generations = to_generation_requests(body, gw.settings.limits)
    except InvalidRequest as exc:
        raise invalid(exc) from None
    created = int(time.time())
    if body.stream:
        job_id = await gw.submit(tenant, generations[0], body.priority, validated=True)
        return event_stream(gw, lambda shutdown: _chunks(gw, tenant, body, job_id, created, shutdown),
                            headers={"x-mlxq-job-id": job_id})
    return await _blocking(gw, tenant, body, generations, request, created)


async def _blocking(gw: Gateway, tenant: Tenant, body: OpenAIRequest, generations: list[GenerationRequest],
                    request: Request, created: int) -> Any:
    """Submit the jobs (one, or one per prompt), wait for their results, answer them (or the first
    error one ended with)."""
    try:
        job_ids, results = await gw.run_blocking(tenant, generations, body.priority, request)
    except WaitTimeout:
        return JSONResponse(error_body(f"no result within {gw.settings.request_timeout_s} s; the job was cancelled",
                                       "timeout", code="timeout"), status_code=504)
    headers = {"x-mlxq-job-id": ",".join(job_ids)}
    if results is None:
        return JSONResponse(error_body("client disconnected", code="client_disconnected"), status_code=499)
    for result in results:
        failed = result_error(result)
        if failed is not None:
            return JSONResponse(failed[1], status_code=failed[0], headers=headers)
    if len(results) > 1:  # one completion request's several prompts, answered as one
        responses = [build_response(body, job_id, result, created) for job_id, result in zip(job_ids, results)]
        return JSONResponse(dump(merge_completions(responses, body.n)), headers=headers)  # type: ignore[arg-type]
    pieces = response_pieces(body, job_ids[0], results[0], created)
    if response_entries(results[0]) <= STREAM_ABOVE_ENTRIES:
        return Response(b"".join(pieces), media_type="application/json", headers=headers)
    # Made piece by piece on a worker thread as the client reads it (docs/gateway.md, "Large results").
    return StreamingResponse(pieces, media_type="application/json", headers=headers)


async def _chunks(gw: Gateway, tenant: Tenant, body: OpenAIRequest, job_id: str, created: int,
                  shutdown: anyio.Event) -> AsyncIterator[bytes]:
    """The SSE messages of one streamed response. Cancelling the iteration (a disconnect) or running out
    of time cancels the job; a failed read of its stream, or the gateway's shutdown, does not. The
    events read together go out in one write, each choice's tokens in one chunk."""
    writer = ChunkWriter(body, job_id, created)
    ended = runs_on = False
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
                        messages += writer.token_chunks(event)
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
        except WaitTimeout as exc:  # as a blocking request's: the job is cancelled (below)
            yield _sse(error_body(f"{exc}; the job was cancelled", "timeout", code="timeout"))
        except MlxqError as exc:  # the stream's read failed, not the job: it runs on, holding its slot
            runs_on = True  # until its result exists (admission's sweep then frees it)
            yield _sse(error_body(f"{exc}; the job goes on, its result will be at /v1/jobs/{job_id}",
                                  "server_error", code=type(exc).__name__))
        yield b"data: [DONE]\r\n\r\n"
    finally:
        runs_on = runs_on or (not ended and shutdown.is_set())  # cut at shutdown: as a failed read
        if not ended and not runs_on:
            await gw.cancel_quietly(job_id)
        if not runs_on:
            await _release(gw, tenant, job_id)


def _sse(*messages: dict[str, Any]) -> bytes:
    """SSE `data:` messages of JSON objects, as one write (line ends as sse-starlette writes them)."""
    return b"".join(b"data: " + json.dumps(message).encode() + b"\r\n\r\n" for message in messages)


async def _release(gw: Gateway, tenant: Tenant, job_id: str) -> None:
    with anyio.CancelScope(shield=True):
        await gw.admission.release(tenant, [job_id])
