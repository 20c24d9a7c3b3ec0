"""OpenAI Batches: the records (`POST /v1/batches`, retrieve, list, cancel) in Redis. What moves a batch
forward is producer/api/batch_driver.py.

A batch is one Redis hash: `record`, the OpenAI Batch object as JSON (request counts excepted), written
by its creator and then by the driver alone; the driver's fields (`completed`/`failed` counts, bytes
written, the position in the input file, `stop`: why it is stopping); and `cancel_at`, the one field a
cancel writes, which the driver turns into the `cancelling` and `cancelled` states.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal, Optional

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field

from producer.api import keys as api_keys
from producer.api.auth import ApiError, Tenant, not_found
from producer.api.files import FileStore
from producer.batchfile import ENDPOINTS

__all__ = ["BatchCreate", "BatchList", "BatchObject", "BatchState", "BatchStore", "parse_window"]

FINAL = frozenset({"failed", "completed", "expired", "cancelled"})
KEEP_AFTER_S = 30 * 24 * 3600  # a batch's record outlives its completion window by this much
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([hms])$")


def parse_window(text: str) -> int:
    """Seconds of a completion window: OpenAI's "24h", or any "<N>h", "<N>m", "<N>s" up to a week."""
    match = _WINDOW.match(text)
    seconds = int(match[1]) * {"h": 3600, "m": 60, "s": 1}[match[2]] if match else 0
    if not 1 <= seconds <= 7 * 24 * 3600:
        raise ApiError(400, f"completion_window: expected e.g. '24h' (at most a week), got {text!r}",
                       param="completion_window")
    return seconds


class OutputExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=30 * 24 * 3600)


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str = "24h"
    metadata: Optional[dict[str, str]] = Field(None, max_length=16)
    output_expires_after: Optional[OutputExpiresAfter] = None


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]] = []


class BatchObject(BaseModel):
    """OpenAI's Batch object."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: Optional[BatchErrors] = None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: Optional[str] = None
    error_file_id: Optional[str] = None
    created_at: int
    in_progress_at: Optional[int] = None
    expires_at: Optional[int] = None
    finalizing_at: Optional[int] = None
    completed_at: Optional[int] = None
    failed_at: Optional[int] = None
    expired_at: Optional[int] = None
    cancelling_at: Optional[int] = None
    cancelled_at: Optional[int] = None
    request_counts: RequestCounts = RequestCounts()
    metadata: Optional[dict[str, str]] = None
    model: Optional[str] = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: Optional[str] = None
    last_id: Optional[str] = None
    has_more: bool = False


class BatchState:
    """A batch as its hash holds it: the object, and the driver's fields."""

    def __init__(self, batch_id: str, raw: dict[bytes, bytes]) -> None:
        self.id = batch_id
        self.object = BatchObject.model_validate_json(raw[b"record"])
        self.tenant = Tenant(raw[b"tenant"].decode())
        self.counts = {name: int(raw.get(name.encode(), b"0")) for name in
                       ("completed", "failed", "out_bytes", "err_bytes", "next_piece", "next_offset", "pieces")}
        self.stop: Optional[str] = raw[b"stop"].decode() if raw.get(b"stop") else None
        self.cancel_at = int(raw.get(b"cancel_at", b"0")) or None
        self.output_ttl_s = int(raw.get(b"output_ttl", b"0")) or None
        self.object.request_counts.completed = self.counts["completed"]
        self.object.request_counts.failed = self.counts["failed"]
        if self.cancel_at and self.object.status not in FINAL:
            self.object.status, self.object.cancelling_at = "cancelling", self.cancel_at


class BatchStore:
    def __init__(self, connection: aioredis.Redis, files: FileStore) -> None:
        self._connection = connection
        self._files = files

    async def create(self, tenant: Tenant, body: BatchCreate) -> BatchObject:
        if body.endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint: must be one of {list(ENDPOINTS)}, got {body.endpoint!r}", param="endpoint")
        window = parse_window(body.completion_window)
        source = await self._files.get(tenant, body.input_file_id)
        if source.purpose != "batch":
            raise ApiError(400, f"input_file_id: {source.id} is not a file of purpose 'batch'", param="input_file_id")
        now = int(time.time())
        batch = BatchObject(id=f"batch_{uuid.uuid4().hex}", endpoint=body.endpoint, input_file_id=source.id,
                            completion_window=body.completion_window, status="validating", created_at=now,
                            expires_at=now + window, metadata=body.metadata)
        key = api_keys.batch_record(batch.id)
        output_ttl = body.output_expires_after.seconds if body.output_expires_after else 0
        async with self._connection.pipeline() as pipe:
            pipe.hset(key, mapping={"record": batch.model_dump_json(), "tenant": tenant.name,
                                    "output_ttl": output_ttl})
            pipe.expire(key, window + KEEP_AFTER_S)
            pipe.zadd(api_keys.tenant_batches(tenant.tag), {batch.id: time.time()})
            pipe.expire(api_keys.tenant_batches(tenant.tag), window + KEEP_AFTER_S)
            pipe.sadd(api_keys.ACTIVE_BATCHES, batch.id)
            await pipe.execute()
        return batch

    async def load(self, batch_id: str) -> Optional[BatchState]:
        raw = await self._connection.hgetall(api_keys.batch_record(batch_id))
        return BatchState(batch_id, raw) if raw else None

    async def get(self, tenant: Tenant, batch_id: str) -> BatchState:
        state = await self.load(batch_id)
        if state is None or state.tenant.tag != tenant.tag:
            raise not_found("batch", batch_id)
        return state

    async def save(self, state: BatchState, **fields: Any) -> None:
        """Write the batch's object (and driver fields) back: the driver's call."""
        await self._connection.hset(api_keys.batch_record(state.id),
                                    mapping={"record": state.object.model_dump_json(), **fields})

    async def reading(self, file_id: str) -> Optional[str]:
        """The id of an unfinished batch whose input is `file_id`, if any (its driver still reads it)."""
        ids = [raw.decode() for raw in await self._connection.smembers(api_keys.ACTIVE_BATCHES)]
        if not ids:
            return None
        async with self._connection.pipeline(transaction=False) as pipe:
            for batch_id in ids:
                pipe.hget(api_keys.batch_record(batch_id), "record")
            records = await pipe.execute()
        for batch_id, raw in zip(ids, records):
            if raw is not None:
                batch = BatchObject.model_validate_json(raw)
                if batch.input_file_id == file_id and batch.status not in FINAL:
                    return batch_id
        return None

    async def cancel(self, tenant: Tenant, batch_id: str) -> BatchObject:
        """Ask for a batch to stop; the driver cancels its jobs and ends it `cancelled`."""
        state = await self.get(tenant, batch_id)
        if state.object.status not in FINAL and not state.cancel_at:
            await self._connection.hset(api_keys.batch_record(batch_id), "cancel_at", int(time.time()))
            state = await self.get(tenant, batch_id)
        return state.object

    async def list(self, tenant: Tenant, after: Optional[str], limit: int) -> BatchList:
        key = api_keys.tenant_batches(tenant.tag)
        start = 0
        if after is not None:
            rank = await self._connection.zrevrank(key, after)
            if rank is None:
                raise not_found("batch", after)
            start = rank + 1
        ids = [i.decode() for i in await self._connection.zrevrange(key, start, start + limit)]
        states = [await self.load(batch_id) for batch_id in ids[:limit]]
        data = [s.object for s in states if s is not None]
        return BatchList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                         has_more=len(ids) > limit)
