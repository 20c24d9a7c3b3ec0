"""The gateway's per-process parts, built once at start-up and shared by every route: the Redis
client, authentication, the fleet view, admission, the file store. None of them holds state that
another replica would need: everything that matters is in Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import anyio
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sse_starlette import EventSourceResponse

from producer.aio import AsyncClient
from producer.api.admission import Admission
from producer.api.auth import ApiError, Authenticator, Tenant
from producer.api.batches import BatchStore
from producer.api.files import FileStore
from producer.api.fleet import Fleet
from producer.api.settings import GatewaySettings
from producer.done_listener import stop_reader
from producer.errors import InvalidRequest, WaitTimeout, broker_errors
from producer.wire import target_queue
from schemas import GenerationRequest, GenerationResult
from schemas.durability import NotReplicated

__all__ = ["Gateway", "current_tenant", "event_stream", "gateway", "wait_unless_disconnected"]

T = TypeVar("T")
SSE_CUT_AFTER_S = 2.0  # past the shutdown grace (event_stream)


@dataclass
class Gateway:
    settings: GatewaySettings
    client: AsyncClient
    auth: Authenticator
    fleet: Fleet
    admission: Admission
    files: FileStore
    batches: BatchStore

    @classmethod
    def build(cls, settings: GatewaySettings) -> "Gateway":
        client = AsyncClient(settings.redis_url, limits=settings.limits, priorities=settings.priorities)
        connection = client.connection
        files = FileStore(connection, settings)
        return cls(settings, client, Authenticator(settings), Fleet(connection, settings.presence_cache_s, settings.models),
                   Admission(connection, settings.tenant_max_in_flight, settings.max_queue_depth, settings.durability),
                   files, BatchStore(connection, files))

    async def close(self) -> None:
        await self.client.close()

    def check_priority(self, priority: Optional[str]) -> None:
        if priority is not None and priority not in self.settings.priorities:
            raise ApiError(400, f"priority: {priority!r} is not one of {list(self.settings.priorities)}",
                           param="priority")

    def new_job_id(self, tenant: Tenant) -> str:
        """A fresh id for one of the tenant's jobs: it names the tenant."""
        return f"{tenant.tag}-{uuid.uuid4().hex}"

    async def submit(self, tenant: Tenant, request: GenerationRequest, priority: Optional[str],
                     job_id: Optional[str] = None, validated: bool = False, asynchronous: bool = False) -> str:
        """Route, admit and enqueue one of the tenant's requests (admission and enqueue in one atomic
        Redis call); its job id (which names the tenant). `validated`: the request was validated
        against the gateway's limits already (`to_generation_request`). `asynchronous`: nobody waits on
        the answer, so a declared model with no live worker is taken (Fleet.may_wait)."""
        self.check_priority(priority)
        queue = target_queue(request, None, priority)
        await self.fleet.require(request.model, queue, asynchronous=asynchronous)
        job_id, enqueue = await self.client._plan_submit(
            request, job_id=job_id or self.new_job_id(tenant), priority=priority, result_ttl=self.settings.result_ttl,
            timeout=self.settings.job_timeout_s, validated=validated)
        with broker_errors():
            try:
                await self.admission.admit_one(tenant, job_id, queue, enqueue)
            except NotReplicated as exc:
                raise await self._not_durable(job_id, exc, kept=asynchronous) from None
        return job_id

    async def _not_durable(self, job_id: str, exc: NotReplicated, kept: bool) -> ApiError:
        """503 for a job that too few replicas confirmed in time (MLXQ_API_DURABLE_REPLICAS): kept when
        submitted asynchronously, named so that it can be looked up; else cancelled, as nobody would
        read its answer."""
        if kept:
            what = f"it runs unless the primary fails before a replica has it (GET /v1/jobs/{job_id} tells)"
        else:
            await self.cancel_quietly(job_id)
            what = "it was cancelled; try again"
        return ApiError(503, f"The job {job_id} was enqueued, but {exc.confirmed} of the {exc.wanted} replica(s) asked "
                        f"for confirmed it within {self.settings.durable_timeout_ms} ms: {what}", "server_error",
                        code="not_durable")

    async def run_blocking(self, tenant: Tenant, requests: list[GenerationRequest], priority: Optional[str],
                           request: Request) -> tuple[list[str], Optional[list[GenerationResult]]]:
        """Submit the requests (validated already) as jobs and wait for their results, in order:
        (job ids, results), or (job ids, None) if the client went away (the jobs are cancelled).
        WaitTimeout after the gateway's request timeout, the jobs cancelled."""
        job_ids = [self.new_job_id(tenant) for _ in requests]
        reader = self.admission.settling(tenant)
        # Watched before they are submitted, so their ends are announced and the wait reads nothing until then.
        async with self.client._watch(job_ids) as watch:

            async def wait() -> dict[str, GenerationResult]:
                return await watch.wait(self.settings.request_timeout_s, read=reader, submitted_after=True)

            try:
                for job_id, generation in zip(job_ids, requests):
                    await self.submit(tenant, generation, priority, job_id, validated=True)
                results = await wait_unless_disconnected(request, wait())
            except (WaitTimeout, ApiError):  # answered without results: its jobs are cancelled, not run for nobody
                for job_id in job_ids:
                    await self.cancel_quietly(job_id)
                raise
            finally:
                with anyio.CancelScope(shield=True):
                    await reader.release_rest(job_ids)
        if results is None:  # the client went away: nobody will read the answer
            for job_id in job_ids:
                await self.cancel_quietly(job_id)
            return job_ids, None
        return job_ids, [results[job_id] for job_id in job_ids]

    async def cancel_quietly(self, job_id: str) -> None:
        """Cancel a job whose caller went away; shielded, since it runs while the request is being cancelled."""
        with anyio.CancelScope(shield=True):
            try:
                await self.client.cancel(job_id)
            except Exception:  # the job may have ended or expired meanwhile; nothing to undo
                pass


def event_stream(gw: Gateway, events: Callable[[anyio.Event], AsyncIterator[Any]],
                 headers: Optional[dict[str, str]] = None) -> EventSourceResponse:
    """An SSE response of `events(shutdown)`. On SIGTERM `shutdown` is set and the stream gets the
    gateway's shutdown grace to end; one cut after it leaves its job running (its generator sees
    `shutdown` set where a disconnect would have cancelled the job)."""
    shutdown = anyio.Event()
    # sse-starlette's own cut comes after uvicorn's: uvicorn's breaks the connection, so a client sees
    # an error, where sse-starlette's would end the stream as if the answer were whole.
    return EventSourceResponse(events(shutdown), headers=headers, ping=15, shutdown_event=shutdown,
                               shutdown_grace_period=gw.settings.shutdown_grace_s + SSE_CUT_AFTER_S)


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway  # type: ignore[no-any-return]


_bearer = HTTPBearer(auto_error=False, description="An API key of the gateway (MLXQ_API_KEYS)")


async def current_tenant(request: Request,
                         credentials: Optional[HTTPAuthorizationCredentials] = Depends(_bearer)) -> Tenant:
    # A coroutine, though it awaits nothing: FastAPI runs a plain function's dependency in a thread pool,
    # a hand-off per request that cost more than the check itself.
    header = f"{credentials.scheme} {credentials.credentials}" if credentials else None
    return gateway(request).auth.tenant(header)


def invalid(exc: InvalidRequest) -> ApiError:
    return ApiError(400, str(exc), param=exc.field)


async def wait_unless_disconnected(request: Request, work: Awaitable[T]) -> Optional[T]:
    """Run `work` until it ends or the client disconnects; None (and `work` cancelled) in the second case."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        await stop_reader(task)
    return task.result() if task in done else None
