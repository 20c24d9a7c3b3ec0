"""A job's result key as `GET /v1/jobs/{id}` serves it: the worker's JSON as it is, in pieces read from
Redis as the client takes them, so a large result is never held whole (docs/gateway.md, "Large results").

The result's status, which the answer names before the result, comes from its head: a worker writes a
result's short fields (id, custom_id, model, status) first. A result that fits in the head is validated
whole, as any other read of it is; a larger one is passed on as its worker wrote it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Optional, get_args

import pydantic_core
import redis.asyncio as aioredis

from producer.errors import MlxqError
from producer.wire import parse_result
from schemas import keys
from schemas.result import Status

__all__ = ["HEAD_BYTES", "StoredResult", "open_result"]

HEAD_BYTES = 64 * 1024  # read first; a result this small is read whole
PIECE_BYTES = 1 << 20  # then read this much at a time
# A key that expires sooner than this is read whole at once: it must not vanish half-way through an answer.
MIN_TTL_MS = 60_000


@dataclass(frozen=True)
class StoredResult:
    status: str
    size: int  # bytes of its JSON
    pieces: AsyncIterator[bytes]  # the JSON, in order


async def open_result(connection: aioredis.Redis, job_id: str) -> Optional[StoredResult]:
    """The job's result key, opened for reading; None while there is none. MlxqError for a result whose
    status cannot be read, or that fits in the head and does not validate."""
    key = keys.result_key(job_id)
    async with connection.pipeline(transaction=False) as pipe:
        pipe.strlen(key)
        pipe.pttl(key)
        pipe.getrange(key, 0, HEAD_BYTES - 1)
        size, ttl_ms, head = await pipe.execute()
    if not size:
        return None
    if size <= len(head):
        return StoredResult(parse_result(job_id, head).status, size, _given(head))
    status = _head_status(head)
    if status is None or 0 <= ttl_ms < MIN_TTL_MS:
        whole: Optional[bytes] = await connection.get(key)
        if whole is None:
            return None
        if status is None:  # not the worker's field order: read it all, as any other read does
            status = parse_result(job_id, whole).status
        return StoredResult(status, len(whole), _given(whole))
    return StoredResult(status, size, _ranges(connection, job_id, head, size))


def _head_status(head: bytes) -> Optional[str]:
    try:
        partial = pydantic_core.from_json(head, allow_partial=True)
    except ValueError:
        raise MlxqError("malformed result: its head is not JSON") from None
    status = partial.get("status") if isinstance(partial, dict) else None
    return status if status in get_args(Status) else None


async def _given(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), PIECE_BYTES):
        yield data[start:start + PIECE_BYTES]


async def _ranges(connection: aioredis.Redis, job_id: str, head: bytes, size: int) -> AsyncIterator[bytes]:
    yield head
    key = keys.result_key(job_id)
    at = len(head)
    while at < size:
        piece: bytes = await connection.getrange(key, at, min(at + PIECE_BYTES, size) - 1)
        if not piece:  # it expired after all: the answer ends short of its Content-Length, which clients see
            raise MlxqError(f"the result of job {job_id} expired while it was being sent")
        yield piece
        at += len(piece)
