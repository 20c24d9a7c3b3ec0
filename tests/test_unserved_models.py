"""Lines for models nobody serves: a batch's lines get the model check chat and jobs make (no queue is made
for a made-up model), queues that hold nothing and that nobody serves age out of RQ's registry, and the
fleet views list what matters however many queues are registered. Real redis-server, a real gateway and
fake-engine worker processes."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis
from rq.registry import CanceledJobRegistry, FailedJobRegistry, ScheduledJobRegistry, StartedJobRegistry

from mlxq.redis_server import RedisServer
from producer.api import keys as api_keys
from producer.fleet_queues import MAX_LISTED, QueuePruner
from producer.fleet_stats import read_snapshot
from tests.gateway import announce, running_gateway, wait_live
from tests.workers import start_fake_worker, stop, wait_for

QUEUES = "rq:queues"


def _registered(conn: redis.Redis) -> set[str]:
    return {raw.decode().removeprefix("rq:queue:") for raw in conn.smembers(QUEUES)}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, redis.Redis]]:
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        worker = start_fake_worker(server.url, "--model", "fake", step_delay_s=0.01)
        try:
            wait_live(conn, "fake")
            with running_gateway(server.url, batch_drive_interval_s=0.1, batch_max_in_flight=1, presence_cache_s=0.2,
                                 history_interval_s=0.5) as base:
                yield base, conn
        finally:
            output = stop(worker)
            conn.close()
        print(output[-3000:])


def _line(custom_id: str, model: str, max_tokens: int = 3) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": custom_id}], "max_tokens": max_tokens}}


def _batch(client: openai.OpenAI, lines: list[dict[str, Any]], **settings: Any) -> Any:
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def _ended(client: openai.OpenAI, batch_id: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    return batch


def test_a_batch_naming_a_model_nobody_serves_fails_validation_and_makes_no_queue(
        served: tuple[str, redis.Redis]) -> None:
    base, conn = served
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
    lines = [_line("ok-1", "fake"), *(_line(f"junk-{i}", f"made-up-{i % 3}") for i in range(6)), _line("ok-2", "fake")]
    batch = _ended(client, _batch(client, lines).id)
    assert batch.status == "failed"
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [
        (n, "model_not_found", "body.model") for n in range(2, 8)]
    assert "'made-up-0' does not exist" in batch.errors.data[0].message
    assert not {name for name in _registered(conn) if "made-up" in name} and not conn.keys("rq:queue:mlxq:made-up*")
    # the same check as chat's: 404 naming the model
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="made-up-0", messages=[{"role": "user", "content": "x"}], max_tokens=2)


def test_a_model_gone_by_the_time_its_line_is_sent_gets_an_error_line(served: tuple[str, redis.Redis]) -> None:
    """Checked again as each line is sent: a model forgotten after the batch was validated."""
    base, conn = served
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
    announce(conn, "ghost-worker", "ghost", queues=["mlxq:ghost-elsewhere"])  # live, for the validation
    wait_for(lambda: "ghost" in [m.id for m in client.models.list()], what="the ghost model listed")
    # One line at a time: the ghost's line waits behind a slow one, while the ghost goes.
    ask = _batch(client, [_line("slow", "fake", max_tokens=150), _line("ghost", "ghost")])
    wait_for(lambda: client.batches.retrieve(ask.id).status == "in_progress", what="validated")
    conn.delete("mlxq:worker:ghost-worker")
    time.sleep(0.5)  # (a fleet read under way may still record it as seen)
    conn.hdel(api_keys.MODELS_SEEN, "ghost")
    batch = _ended(client, ask.id)
    assert batch.status == "completed" and batch.request_counts.completed == 1 and batch.request_counts.failed == 1
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("ghost", "model_not_found")]
    assert "mlxq:ghost" not in _registered(conn) and not conn.exists("rq:queue:mlxq:ghost")


def test_the_gateway_ages_empty_queues_nobody_serves_out_of_the_registry(served: tuple[str, redis.Redis]) -> None:
    base, conn = served
    http = httpx.Client(base_url=base.removesuffix("/v1"), timeout=30)
    job = http.post("/v1/jobs", json={"model": "fake", "prompt": "x", "max_tokens": 2}).json()["id"]
    wait_for(lambda: http.get(f"/v1/jobs/{job}").json()["status"] == "finished", what="the job")
    junk = [f"mlxq:junk-{i}" for i in range(3000)]
    # In one transaction: the gateway's upkeep, running meanwhile, must see each queue with its registries.
    with conn.pipeline() as pipe:
        pipe.sadd(QUEUES, *[f"rq:queue:{name}" for name in junk])
        pipe.sadd(QUEUES, "rq:queue:mlxq:waiting", "rq:queue:mlxq:retrying", "rq:queue:mlxq:taken")
        pipe.rpush("rq:queue:mlxq:waiting", "some-job")  # jobs still to run keep their queue registered
        pipe.zadd(ScheduledJobRegistry.key_template.format("mlxq:retrying"), {"a-retry": time.time() + 3600})
        pipe.zadd(StartedJobRegistry.key_template.format("mlxq:taken"), {"a-job": time.time() + 3600})
        pipe.zadd(FailedJobRegistry.key_template.format("mlxq:junk-0"), {"old": time.time() - 1, "new": time.time() + 99})
        pipe.zadd(CanceledJobRegistry.key_template.format("mlxq:junk-1"), {"gone": time.time() - 1})
        pipe.execute()
    wait_for(lambda: not _registered(conn) & set(junk), timeout=60, what="the junk queues aged out")
    left = _registered(conn)
    assert {"mlxq:waiting", "mlxq:retrying", "mlxq:taken"} <= left
    assert "mlxq:fake" in left  # served, though empty
    assert conn.zrange(FailedJobRegistry.key_template.format("mlxq:junk-0"), 0, -1) == [b"new"]  # expired entries go
    assert not conn.exists(CanceledJobRegistry.key_template.format("mlxq:junk-1"))
    # A queue taken out is registered again by its next job, and served.
    conn.srem(QUEUES, "rq:queue:mlxq:fake")
    job = http.post("/v1/jobs", json={"model": "fake", "prompt": "x", "max_tokens": 2}).json()["id"]
    wait_for(lambda: http.get(f"/v1/jobs/{job}").json()["status"] == "finished", what="the job")
    assert "mlxq:fake" in _registered(conn)
    for name in ("mlxq:waiting", "mlxq:retrying", "mlxq:taken"):
        conn.srem(QUEUES, f"rq:queue:{name}")
    conn.delete("rq:queue:mlxq:waiting")


def test_views_list_served_queues_and_the_deepest_with_jobs_however_many_are_registered(redis_url: str,
                                                                                        redis_conn: redis.Redis) -> None:
    conn = redis_conn
    conn.sadd(QUEUES, *[f"rq:queue:mlxq:junk-{i}" for i in range(20_000)])
    for i in range(MAX_LISTED + 5):  # more queues with jobs than a view lists: 5 with one job, then two each
        name = f"mlxq:busy-{i}" if i >= 5 else f"mlxq:shallow-{i}"
        conn.sadd(QUEUES, f"rq:queue:{name}")
        conn.rpush(f"rq:queue:{name}", *[f"job-{j}" for j in range(1 if i < 5 else 2)])
    announce(conn, "w1", "served-model")
    snapshot = read_snapshot(conn)
    names = {q.name for q in snapshot.queues}
    assert {"mlxq:served-model", "mlxq"} <= names  # served, though neither is registered
    assert {q.name for q in snapshot.queues if q.depth} == {f"mlxq:busy-{i}" for i in range(5, MAX_LISTED + 5)}
    assert not any(name.startswith(("mlxq:junk-", "mlxq:shallow-")) for name in names)  # the deepest are listed
    assert snapshot.queues_registered == 20_000 + MAX_LISTED + 5 and snapshot.queues_with_jobs == MAX_LISTED + 5
    assert snapshot.jobs_waiting == 5 + 2 * MAX_LISTED  # the queues not listed too
    assert read_snapshot(conn, ("mlxq:junk-7",)).queues[0].depth == 0  # a queue asked for by name is read

    async def prune_all() -> list[str]:
        connection = aioredis.Redis.from_url(redis_url)
        pruner = QueuePruner(connection, _served_nothing, interval_s=1, slices_per_round=1000)
        try:
            return await pruner.prune_round()
        finally:
            await connection.aclose()

    assert len(asyncio.run(prune_all())) == 20_000
    assert read_snapshot(conn).queues_registered == MAX_LISTED + 5


async def _served_nothing() -> set[str]:
    return set()
