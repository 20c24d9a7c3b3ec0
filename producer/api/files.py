"""OpenAI Files for batches: uploads checked against OpenAI's limits (200 MB, 50,000 lines) and the tenant's
storage quota (producer/api/quota.py), and the batches' output and error files, each with an expiry.

A file's metadata is a Redis key (so every replica sees it) that expires with the file. Its contents
live in Redis as a list of its lines, or, with `MLXQ_API_FILES_DIR`, in a file of that directory
(shared by every replica, e.g. over NFS); files whose metadata expired are removed from the
directory by the next upload's sweep. Either way a download returns the uploaded bytes exactly.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal, Optional

import anyio
import redis.asyncio as aioredis
from pydantic import BaseModel

from producer.api import keys as api_keys
from producer.api.auth import ApiError, Tenant, not_found
from producer.api.quota import StorageQuota
from producer.api.settings import GatewaySettings

__all__ = ["FileDeleted", "FileList", "FileObject", "FileRecord", "FileStore"]

PUSH_LINES = 2000  # lines per RPUSH of an upload
READ_LINES = 2000  # lines per LRANGE of a download, at most
READ_BYTES = 4 * 1024 * 1024  # ... and about this many bytes
SWEEP_EVERY_S = 600.0
MAX_FILE_TTL_S = 30 * 24 * 3600  # the longest expiry an upload or a batch's output may ask for


class FileObject(BaseModel):
    """OpenAI's File object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: Optional[int] = None
    status_details: Optional[str] = None


class FileList(BaseModel):
    """OpenAI's page of files (`GET /v1/files`)."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: Optional[str] = None
    last_id: Optional[str] = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class FileRecord(FileObject):
    tenant_tag: str
    lines: int  # non-empty lines
    on_disk: bool = False

    def public(self) -> FileObject:
        return FileObject.model_validate(self.model_dump(include=set(FileObject.model_fields)))


def lines_per_read(size: int, lines: int) -> int:
    """Lines of a file of `size` bytes and `lines` lines to read from Redis at once: READ_LINES, fewer
    where its lines are long, so that a read holds about READ_BYTES (a batch output's lines can be
    megabytes each; one line is read whole, whatever its size)."""
    return max(1, min(READ_LINES, READ_BYTES * max(lines, 1) // max(size, 1)))


def split_lines(data: bytes) -> list[bytes]:
    """The pieces between newlines, the last one too: b"\\n".join(pieces) == data."""
    return data.split(b"\n")


def check_jsonl(pieces: list[bytes], max_lines: int) -> int:
    """The number of non-empty lines; ApiError 400 for a line that is not a JSON object, or too many."""
    count = 0
    for number, piece in enumerate(pieces, start=1):
        if not piece.strip():
            continue
        count += 1
        if count > max_lines:
            raise ApiError(400, f"file: more than {max_lines} lines", param="file", code="too_many_lines")
        try:
            item = json.loads(piece)
        except (ValueError, RecursionError):
            raise ApiError(400, f"file: line {number} is not valid JSON", param="file", code="invalid_jsonl") from None
        if not isinstance(item, dict):
            raise ApiError(400, f"file: line {number} is not a JSON object", param="file", code="invalid_jsonl")
    return count


class FileStore:
    def __init__(self, connection: aioredis.Redis, settings: GatewaySettings) -> None:
        self._connection = connection
        self._settings = settings
        self._dir = Path(settings.files_dir) if settings.files_dir else None
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
        self._swept_at = 0.0
        self.quota = StorageQuota(connection, settings.file_quota_bytes)

    def ttl(self, seconds: Optional[int]) -> int:
        if seconds is None:
            return self._settings.file_ttl_s
        if not 3600 <= seconds <= 30 * 24 * 3600:
            raise ApiError(400, "expires_after.seconds: must be between 3600 and 2592000", param="expires_after")
        return seconds

    async def create(self, tenant: Tenant, filename: str, purpose: str, data: bytes,
                     ttl_s: Optional[int] = None) -> FileRecord:
        """Store an upload; the checks of its purpose ("batch": JSON lines), of the limits and of the tenant's
        storage quota first (its bytes are reserved before any is written, released if writing fails)."""
        if purpose != "batch":
            raise ApiError(400, f"purpose: only 'batch' files are accepted, got {purpose!r}", param="purpose")
        if len(data) > self._settings.file_max_bytes:
            raise ApiError(413, f"file: {len(data)} bytes exceeds the limit of {self._settings.file_max_bytes}",
                           param="file", code="file_too_large")
        ttl = self.ttl(ttl_s)
        pieces = split_lines(data)
        lines = await asyncio.to_thread(check_jsonl, pieces, self._settings.file_max_lines)
        if lines == 0:
            raise ApiError(400, "file: holds no request lines", param="file", code="empty_file")
        file_id = f"file-{uuid.uuid4().hex}"
        await self.quota.reserve(tenant, file_id, len(data), time.time() + ttl)
        try:
            return await self._store(tenant, file_id, filename[:256] or "upload.jsonl", "batch", pieces, len(data),
                                     lines, ttl)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.quota.release(tenant, file_id)
            raise

    async def create_from_list(self, tenant: Tenant, filename: str, list_key: str, lines: int, size: int,
                               ttl_s: int) -> FileRecord:
        """A batch's output or error file, from the list of its `lines` lines (`size` bytes with their
        newlines) that it wrote; the list is consumed. Its bytes count against the tenant's quota, which
        never refuses it."""
        file_id = f"file-{uuid.uuid4().hex}"
        await self.quota.reserve(tenant, file_id, size, time.time() + ttl_s, force=True)
        if self._dir is None:
            pieces_key = api_keys.file_data(file_id)
            async with self._connection.pipeline() as pipe:
                pipe.rpush(list_key, b"")  # the newline after the last line
                pipe.rename(list_key, pieces_key)
                pipe.expire(pieces_key, ttl_s)
                await pipe.execute()
            return await self._record(tenant, file_id, filename, "batch_output", size, lines, ttl_s, on_disk=False)
        path = self._dir / file_id
        step = lines_per_read(size, lines)
        with path.open("wb") as handle:
            for start in range(0, lines, step):
                chunk = await self._connection.lrange(list_key, start, start + step - 1)
                await asyncio.to_thread(handle.write, b"".join(line + b"\n" for line in chunk))
        await self._connection.delete(list_key)
        return await self._record(tenant, file_id, filename, "batch_output", size, lines, ttl_s, on_disk=True)

    async def _store(self, tenant: Tenant, file_id: str, filename: str, purpose: str, pieces: list[bytes], size: int,
                     lines: int, ttl_s: int) -> FileRecord:
        if self._dir is not None:
            await asyncio.to_thread((self._dir / file_id).write_bytes, b"\n".join(pieces))
            await self._sweep()
        else:
            key = api_keys.file_data(file_id)
            for start in range(0, len(pieces), PUSH_LINES):
                await self._connection.rpush(key, *pieces[start : start + PUSH_LINES])
            await self._connection.expire(key, ttl_s)
        return await self._record(tenant, file_id, filename, purpose, size, lines, ttl_s, on_disk=self._dir is not None)

    async def _record(self, tenant: Tenant, file_id: str, filename: str, purpose: str, size: int, lines: int,
                      ttl_s: int, *, on_disk: bool) -> FileRecord:
        now = int(time.time())
        record = FileRecord(id=file_id, bytes=size, created_at=now, filename=filename, purpose=purpose,  # type: ignore[arg-type]
                            expires_at=now + ttl_s, tenant_tag=tenant.tag, lines=lines, on_disk=on_disk)
        index = api_keys.tenant_files(tenant.tag)
        async with self._connection.pipeline(transaction=False) as pipe:
            pipe.set(api_keys.file_record(file_id), record.model_dump_json(), ex=ttl_s)
            pipe.zadd(index, {file_id: time.time()})
            # The index outlives every file in it: none asks for more than this.
            pipe.expire(index, max(ttl_s, self._settings.file_ttl_s, MAX_FILE_TTL_S))
            await pipe.execute()
        return record

    async def list(self, tenant: Tenant, purpose: Optional[str], limit: int, order: str,
                   after: Optional[str]) -> FileList:
        """The tenant's files that have not expired, newest first (or oldest with order "asc"), from
        the one after `after`; ids whose metadata expired leave the index here."""
        index = api_keys.tenant_files(tenant.tag)
        ids = [raw.decode() for raw in (await self._connection.zrange(index, 0, -1, desc=order != "asc"))]
        if after is not None and after not in ids:
            raise not_found("file", after)
        ids = ids[ids.index(after) + 1:] if after is not None else ids
        records: list[FileRecord] = []
        gone: list[str] = []
        for start in range(0, len(ids), READ_LINES):
            chunk = ids[start : start + READ_LINES]
            for file_id, raw in zip(chunk, await self._connection.mget([api_keys.file_record(i) for i in chunk])):
                if raw is None:
                    gone.append(file_id)
                    continue
                record = FileRecord.model_validate_json(raw)
                if purpose is None or record.purpose == purpose:
                    records.append(record)
            if len(records) > limit:
                break
        if gone:
            await self._connection.zrem(index, *gone)
        data = [r.public() for r in records[:limit]]
        return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                        has_more=len(records) > limit)

    async def delete(self, tenant: Tenant, file_id: str) -> FileDeleted:
        """Remove the tenant's file, contents and metadata (404 for another tenant's)."""
        record = await self.get(tenant, file_id)
        async with self._connection.pipeline(transaction=False) as pipe:
            pipe.delete(api_keys.file_record(file_id), api_keys.file_data(file_id))
            pipe.zrem(api_keys.tenant_files(tenant.tag), file_id)
            await pipe.execute()
        if record.on_disk and self._dir is not None:
            await asyncio.to_thread((self._dir / file_id).unlink, True)
        await self.quota.release(tenant, file_id)
        return FileDeleted(id=file_id)

    async def get(self, tenant: Tenant, file_id: str) -> FileRecord:
        """The tenant's file, else 404 (also for another tenant's)."""
        raw = await self._connection.get(api_keys.file_record(file_id))
        if raw is None:
            raise not_found("file", file_id)
        record = FileRecord.model_validate_json(raw)
        if record.tenant_tag != tenant.tag:
            raise not_found("file", file_id)
        return record

    async def content(self, record: FileRecord) -> AsyncIterator[bytes]:
        """The file's bytes, in pieces."""
        if record.on_disk:
            assert self._dir is not None
            with (self._dir / record.id).open("rb") as handle:
                while chunk := await asyncio.to_thread(handle.read, 1 << 20):
                    yield chunk
            return
        key = api_keys.file_data(record.id)
        count = await self._connection.llen(key)
        step = lines_per_read(record.bytes, count)
        for start in range(0, count, step):
            pieces = await self._connection.lrange(key, start, start + step - 1)
            last = start + len(pieces) >= count
            yield b"\n".join(pieces) + (b"" if last else b"\n")

    async def read_lines(self, record: FileRecord, start: int, offset: int, count: int
                         ) -> list[tuple[int, bytes, int]]:
        """Up to `count` pieces from piece `start` (which begins at byte `offset` of a file on disk), as
        (piece number, bytes, byte offset after it; 0 in Redis) triples."""
        if not record.on_disk:
            pieces = await self._connection.lrange(api_keys.file_data(record.id), start, start + count - 1)
            return [(start + i, p, 0) for i, p in enumerate(pieces)]
        path = Path(self._dir or ".") / record.id

        def read() -> list[tuple[int, bytes, int]]:
            with path.open("rb") as handle:
                handle.seek(offset)
                out = []
                for i in range(count):
                    piece = handle.readline()
                    if not piece:
                        break
                    out.append((start + i, piece.rstrip(b"\n"), handle.tell()))
                return out

        return await asyncio.to_thread(read)

    async def _sweep(self) -> None:
        """Remove contents whose metadata expired (at most every SWEEP_EVERY_S per process)."""
        if self._dir is None or time.monotonic() - self._swept_at < SWEEP_EVERY_S:
            return
        self._swept_at = time.monotonic()
        names = [p.name for p in self._dir.iterdir() if p.name.startswith("file-")]
        if not names:
            return
        async with self._connection.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.exists(api_keys.file_record(name))
            exists = await pipe.execute()
        cutoff = time.time() - 3600  # an upload's contents are written before its metadata
        for name, present in zip(names, exists):
            path = self._dir / name
            if not present and path.stat().st_mtime < cutoff:
                path.unlink(missing_ok=True)
