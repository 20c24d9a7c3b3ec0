"""mlxq's own jobs over HTTP: `POST /v1/jobs` (a GenerationRequest, answered at once with the job's id),
`GET /v1/jobs/{id}` (status and result), `DELETE /v1/jobs/{id}` (cancel), `GET /v1/jobs/{id}/events` (its
token events as SSE, resumable with `Last-Event-ID`). A tenant sees only its own jobs: another's are 404.
Leaving the events stream does not cancel the job (it was submitted without waiting)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal, Optional

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from sse_starlette import ServerSentEvent

from producer.api.auth import ERRORS, Tenant, not_found
from producer.api.gateway import current_tenant, event_stream, gateway
from producer.api.stored_results import HEAD_BYTES, open_result
from producer.aio_stream import AsyncJobStream
from producer.errors import InvalidRequest, JobNotFound, MlxqError, broker_errors
from producer.openai_responses import encode, error_body
from producer.wire import public_status
from schemas import GenerationRequest, GenerationResult

__all__ = ["router"]

router = APIRouter()


class JobObject(BaseModel):
    id: str
    object: Literal["mlxq.job"] = "mlxq.job"
    status: str
    result: Optional[GenerationResult] = None
    cancelled: Optional[bool] = None  # DELETE: whether this call stopped it (False: it had ended)


def _owned(tenant: Tenant, job_id: str) -> str:
    if not tenant.owns_job(job_id):
        raise not_found("job", job_id)
    return job_id


@router.post("/v1/jobs", response_model=JobObject, responses=ERRORS)
async def create_job(body: GenerationRequest, request: Request, priority: Optional[str] = Query(None, max_length=32),
                     tenant: Tenant = Depends(current_tenant)) -> JobObject:
    """Enqueue a GenerationRequest (the contract's fields; `stream: true` to read its events)."""
    gw = gateway(request)
    job_id = await gw.submit(tenant, body, priority, asynchronous=True)
    return JobObject(id=job_id, status="queued")


@router.get("/v1/jobs/{job_id}", response_model=JobObject, responses=ERRORS)
async def get_job(job_id: str, request: Request, tenant: Tenant = Depends(current_tenant)) -> Any:
    """The job's status and, once it ended, its result: the result key's JSON as the worker wrote it,
    sent as it is read (docs/gateway.md, "Large results")."""
    client = gateway(request).client
    with broker_errors():
        stored = await open_result(client.connection, _owned(tenant, job_id))
    if stored is not None:
        opening = encode({"id": job_id, "object": "mlxq.job", "status": stored.status})[:-1] + b',"result":'
        closing = b',"cancelled":null}'
        if stored.size <= HEAD_BYTES:
            return Response(opening + b"".join([piece async for piece in stored.pieces]) + closing,
                            media_type="application/json")
        return StreamingResponse(_framed(opening, stored.pieces, closing), media_type="application/json",
                                 headers={"Content-Length": str(len(opening) + stored.size + len(closing))})
    try:  # no result key yet, or a job that ended without one: status and result from one read
        state = (await client._read_states([job_id]))[0]
        result = await client._settled(state)
    except JobNotFound:
        raise not_found("job", job_id) from None
    return JobObject(id=job_id, status=result.status if result is not None else public_status(state), result=result)


async def _framed(opening: bytes, pieces: AsyncIterator[bytes], closing: bytes) -> AsyncIterator[bytes]:
    yield opening
    async for piece in pieces:
        yield piece
    yield closing


@router.delete("/v1/jobs/{job_id}", response_model=JobObject, responses=ERRORS)
async def cancel_job(job_id: str, request: Request, tenant: Tenant = Depends(current_tenant)) -> JobObject:
    client = gateway(request).client
    try:
        cancelled = await client.cancel(_owned(tenant, job_id))
        status = await client.status(job_id)
    except JobNotFound:
        raise not_found("job", job_id) from None
    return JobObject(id=job_id, status=status, cancelled=cancelled)


@router.get("/v1/jobs/{job_id}/events", responses={**ERRORS, 200: {"content": {"text/event-stream": {}}}})
async def job_events(job_id: str, request: Request, tenant: Tenant = Depends(current_tenant),
                     last_event_id: Optional[str] = Header(None, alias="Last-Event-ID", max_length=64)) -> object:
    gw = gateway(request)
    try:
        await gw.client.status(_owned(tenant, job_id))
    except JobNotFound:
        raise not_found("job", job_id) from None
    try:  # checked here, before the response starts: a bad id is this request's 400, nobody else's error
        stream = gw.client.stream(job_id, timeout=gw.settings.request_timeout_s, last_event_id=last_event_id)
    except InvalidRequest as exc:
        message = str(exc).replace("last_event_id", "Last-Event-ID", 1)
        return JSONResponse(error_body(message, param="Last-Event-ID"), status_code=400)
    return event_stream(gw, lambda _shutdown: _events(stream))


async def _events(stream: AsyncJobStream) -> AsyncIterator[ServerSentEvent]:
    try:
        async for event in stream:
            yield ServerSentEvent(data=json.dumps(event), event=event["event"], id=stream.last_event_id)
    except MlxqError as exc:
        yield ServerSentEvent(data=json.dumps(error_body(str(exc), "server_error", code=type(exc).__name__)),
                              event="error")
