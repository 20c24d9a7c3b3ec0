"""A FastAPI backend in front of mlxq: submit and wait, submit and poll, or stream tokens to the browser
as server-sent events. Run: `MLXQ_REDIS_URL=redis://... uvicorn examples.fastapi_app.app:app`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field
from sse_starlette import EventSourceResponse

from producer import AsyncClient, InvalidRequest, JobNotFound, WaitTimeout

client: Optional[AsyncClient] = None


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    global client
    client = AsyncClient()  # MLXQ_REDIS_URL, else redis://localhost:6379/0
    yield
    await client.close()


app = FastAPI(title="mlxq example backend", lifespan=lifespan)


class Ask(BaseModel):
    prompt: str = Field(max_length=10_000)
    max_tokens: int = Field(64, ge=1, le=1024)
    model: Optional[str] = None  # a served model's name; None: any worker on the default queue


def request_for(ask: Ask, stream: bool = False) -> dict[str, Any]:
    return {"prompt": ask.prompt, "max_tokens": ask.max_tokens, "model": ask.model, "stream": stream}


async def submit(ask: Ask, stream: bool = False) -> str:
    assert client is not None
    try:
        return await client.submit(request_for(ask, stream))
    except InvalidRequest as exc:  # the field is named: hand it back as a 422
        raise HTTPException(422, str(exc)) from None


@app.post("/generate")
async def generate(ask: Ask) -> dict[str, Any]:
    """Submit and wait: the answer in one request (a worker has up to 60 s)."""
    assert client is not None
    job_id = await submit(ask)
    try:
        result = await client.wait(job_id, timeout=60)
    except WaitTimeout:
        await client.cancel(job_id)
        raise HTTPException(504, f"job {job_id} did not end within 60 s") from None
    return {"id": job_id, "status": result.status, "text": result.choices[0].text if result.choices else "",
            "usage": result.usage.model_dump()}


@app.post("/jobs", status_code=202)
async def create_job(ask: Ask) -> dict[str, str]:
    """Submit; the browser polls GET /jobs/{id} or reads GET /jobs/{id}/events."""
    return {"id": await submit(ask, stream=True)}


@app.get("/jobs/{job_id}")
async def get_job(job_id: str) -> dict[str, Any]:
    assert client is not None
    try:
        # The status first, then the result: a job that ends between the two reads has its result read
        # (the other order could answer "finished" with no text).
        status = await client.status(job_id)
        result = await client.result(job_id)
        status = result.status if result is not None else status
    except JobNotFound:
        raise HTTPException(404, f"no job {job_id}") from None
    return {"id": job_id, "status": status,
            "text": result.choices[0].text if result is not None and result.choices else None}


@app.get("/jobs/{job_id}/events")
async def job_events(job_id: str) -> EventSourceResponse:
    """The job's tokens as they are made (it must have been submitted with stream: POST /jobs does)."""
    assert client is not None

    async def events() -> AsyncIterator[dict[str, str]]:
        async for event in client.stream(job_id, timeout=60):
            yield {"event": event["event"], "data": json.dumps(event)}

    return EventSourceResponse(events())
