"""Each tenant's storage quota for Files: reserved atomically at upload (413 in OpenAI's error shape naming
the quota), released when a file is deleted or expires, batch outputs counted but never refused; against a
real redis-server, a real gateway and a fake-engine worker process."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator

import openai
import pytest
import redis
import redis.asyncio as aioredis

from mlxq.redis_server import RedisServer
from producer.api.auth import ApiError, Tenant
from producer.api.quota import StorageQuota
from tests.gateway import key_entry, running_gateway, wait_live
from tests.workers import start_fake_worker, stop

KEYS = {"acme": "sk-acme-quota", "globex": "sk-globex-quota", "initech": "sk-initech-quota"}
QUOTA = 3000


def test_reservations_are_atomic_and_expired_files_are_released(redis_url: str) -> None:
    async def run() -> None:
        connection = aioredis.Redis.from_url(redis_url)
        quota = StorageQuota(connection, 1000)
        acme, globex = Tenant("acme"), Tenant("globex")
        now = time.time()
        outcomes = await asyncio.gather(*(quota.reserve(acme, f"file-{i}", 100, now + 3600) for i in range(25)),
                                        return_exceptions=True)
        assert sum(o is None for o in outcomes) == 10
        assert all(isinstance(o, ApiError) and o.status == 413 for o in outcomes if o is not None)
        assert await quota.used(acme) == 1000 and await quota.used(globex) == 0  # tenants apart
        kept = next(f"file-{i}" for i, outcome in enumerate(outcomes) if outcome is None)
        await quota.release(acme, kept)
        await quota.release(acme, kept)  # released once
        assert await quota.used(acme) == 900
        await quota.reserve(acme, "soon", 100, now + 5)
        with pytest.raises(ApiError):
            await quota.reserve(acme, "more", 50, now + 3600)
        assert await quota.used(acme, now=now + 6) == 900  # "soon" expired
        await quota.reserve(acme, "more", 50, now + 3600, now=now + 6)
        await quota.reserve(acme, "output", 5000, now + 3600, force=True)  # a batch's output: counted, not refused
        assert await quota.used(acme, now=now + 6) == 5950
        await connection.aclose()

    asyncio.run(run())


@pytest.fixture(scope="module")
def base() -> Iterator[tuple[str, redis.Redis]]:
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        worker = start_fake_worker(server.url, "--model", "fake", step_delay_s=0.0)
        try:
            wait_live(conn, "fake")
            entries = ",".join(key_entry(t, k) for t, k in KEYS.items())
            with running_gateway(server.url, api_keys=entries, file_quota_bytes=QUOTA, batch_drive_interval_s=0.1,
                                 batch_max_in_flight=1) as url:
                yield url, conn
        finally:
            output = stop(worker)
            conn.close()
        print(output[-3000:])


def _client(base: str, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=KEYS[tenant], max_retries=0)


def _line(custom_id: str = "a") -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "fake", "messages": [{"role": "user", "content": "x"}],
                                "max_tokens": 40}}).encode()


def _file(size: int) -> bytes:
    data = _line()
    return data + b" " * (size - len(data) - 1) + b"\n"


def test_uploads_past_the_quota_are_refused_until_files_are_deleted(base: tuple[str, redis.Redis]) -> None:
    url, _ = base
    acme, globex = _client(url), _client(url, "globex")
    first = acme.files.create(file=("a.jsonl", io.BytesIO(_file(2000))), purpose="batch")
    with pytest.raises(openai.APIStatusError) as refused:
        acme.files.create(file=("b.jsonl", io.BytesIO(_file(1500))), purpose="batch")
    assert refused.value.status_code == 413
    error = refused.value.body
    assert error["code"] == "storage_quota_exceeded" and error["param"] == "file" and error["type"]
    assert f"quota of {QUOTA} bytes" in error["message"] and "3500 bytes" in error["message"]
    globex.files.create(file=("g.jsonl", io.BytesIO(_file(2000))), purpose="batch")  # its own quota
    acme.files.delete(first.id)
    second = acme.files.create(file=("b.jsonl", io.BytesIO(_file(1500))), purpose="batch")

    # A batch's output counts too.
    batch = acme.batches.create(input_file_id=second.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := acme.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    assert batch.status == "completed", batch
    output = acme.files.retrieve(batch.output_file_id)
    with pytest.raises(openai.APIStatusError) as refused:
        acme.files.create(file=("c.jsonl", io.BytesIO(_file(QUOTA - 1500 - output.bytes + 1))), purpose="batch")
    assert refused.value.status_code == 413
    acme.files.create(file=("c.jsonl", io.BytesIO(_file(QUOTA - 1500 - output.bytes))), purpose="batch")


def test_a_batch_stops_sending_lines_once_its_tenants_files_fill_the_quota(base: tuple[str, redis.Redis]) -> None:
    url, _ = base
    client = _client(url, "initech")
    data = b"".join(_line(f"line-{i}") + b"\n" for i in range(8))
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    assert batch.status == "completed" and batch.request_counts.total == 8
    output = client.files.retrieve(batch.output_file_id)
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    sent = batch.request_counts.completed
    assert 1 <= sent < 8 and len(errors) == 8 - sent
    assert {e["error"]["code"] for e in errors} == {"storage_quota_exceeded"}
    assert f"storage quota of {QUOTA} bytes" in errors[0]["error"]["message"]
    # it stopped as soon as the quota was full: one line's output (the one job in flight) past it at most
    per_line = output.bytes / sent
    assert uploaded.bytes + output.bytes - per_line < QUOTA
