"""StreamHub: an AsyncClient's streams read with one blocking XREAD (producer/stream_hub.py), on the
session's redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

import producer.aio_stream
import producer.stream_hub
from producer import AsyncClient
from producer.stream_hub import StreamHub
from schemas import keys
from schemas.events import TokenStreamEvent, encode_event


def run(coroutine: Callable[[], Awaitable[Any]], timeout: float = 30) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine(), timeout))


@contextlib.asynccontextmanager
async def _hub(url: str) -> AsyncIterator[tuple[aioredis.Redis, StreamHub]]:
    connection = aioredis.Redis.from_url(url)
    hub = StreamHub(connection)
    try:
        yield connection, hub
    finally:
        await hub.close_all()
        await connection.aclose()


async def _read_all(hub: StreamHub, key: str, count: int) -> list[bytes]:
    following = hub.follow(key, "0-0")
    values: list[bytes] = []
    while len(values) < count:
        values += [fields[b"v"] for _, fields in await hub.take(following, 1.0)]
    hub.close(following)
    return values


def test_many_streams_each_get_their_own_entries_once_and_in_order(redis_url: str) -> None:
    async def scenario() -> None:
        async with _hub(redis_url) as (connection, hub):
            streams = {f"s{i}": [f"{i}:{k}".encode() for k in range(30)] for i in range(40)}
            readers = {key: asyncio.create_task(_read_all(hub, key, len(values))) for key, values in streams.items()}
            await asyncio.sleep(0.05)
            order = [(key, value) for key, values in streams.items() for value in values]
            random.Random(3).shuffle(order)
            cursor = {key: 0 for key in streams}
            for key, _ in order:  # each stream's values in their order, streams interleaved at random
                await connection.xadd(key, {"v": streams[key][cursor[key]]})
                cursor[key] += 1
            for key, task in readers.items():
                assert await task == streams[key]
            assert hub.wakes_allowed is True  # this server lets the hub write its wake stream

    run(scenario)


def test_a_stream_followed_while_the_read_blocks_joins_it_at_once(redis_url: str, monkeypatch) -> None:
    """With reads that block for a minute, a second stream's entry still arrives: the hub's read
    is woken for it (an entry in its wake stream)."""
    monkeypatch.setattr(producer.stream_hub, "block_slice", lambda left, socket_timeout: 60.0)

    async def scenario() -> None:
        async with _hub(redis_url) as (connection, hub):
            first = hub.follow("first", "0-0")
            await asyncio.sleep(0.2)  # the hub now blocks on "first" alone
            second = hub.follow("second", "0-0")
            await connection.xadd("second", {"v": "x"})
            entries = await asyncio.wait_for(hub.take(second, 60), 10)
            assert [fields[b"v"] for _, fields in entries] == [b"x"]
            hub.close(first)
            hub.close(second)

    run(scenario)


def test_without_its_wake_stream_the_hub_polls(redis_url: str, redis_conn: redis.Redis) -> None:
    """An ACL user without the wake streams' keys (mlxq:wake:*): the hub's reads block briefly
    instead, and deliver."""
    redis_conn.acl_setuser("no-wake", enabled=True, passwords=["+pw"], keys=["~s", "~t"], commands=["+@all"])
    url = redis_url.replace("redis://", "redis://no-wake:pw@")

    async def scenario() -> None:
        async with _hub(url) as (connection, hub):
            following = hub.follow("s", "0-0")
            await asyncio.sleep(0.1)
            assert hub.wakes_allowed is False
            later = hub.follow("t", "0-0")
            await connection.xadd("t", {"v": "y"})
            entries = await asyncio.wait_for(hub.take(later, 60), 10)
            assert [fields[b"v"] for _, fields in entries] == [b"y"]
            hub.close(following)
            hub.close(later)

    try:
        run(scenario)
    finally:
        redis_conn.acl_deluser("no-wake")


def test_entries_a_reader_saw_by_itself_are_not_given_again(redis_url: str) -> None:
    async def scenario() -> None:
        async with _hub(redis_url) as (connection, hub):
            ids = [await connection.xadd("s", {"v": str(i)}) for i in range(3)]
            following = hub.follow("s", "0-0")
            following.skip_to(ids[1])
            entries = await hub.take(following, 5)
            assert [fields[b"v"] for _, fields in entries] == [b"2"]

    run(scenario)


def test_tokens_arrive_while_the_job_runs_and_an_abandoned_stream_is_let_go(redis_url: str, redis_conn: redis.Redis,
                                                                            monkeypatch) -> None:
    """Through AsyncClient.stream: entries come from the hub as they are written (the job's state is
    not read meanwhile), and a stream iterated halfway then dropped stops being followed."""
    monkeypatch.setattr(producer.aio_stream, "STATE_CHECK_S", 600.0)

    async def scenario() -> None:
        async with AsyncClient(redis_url) as client:
            job_id = await client.submit({"prompt": "x", "stream": True})
            stream = client.stream(job_id, timeout=30)
            for i in range(3):
                redis_conn.xadd(keys.stream_key(job_id),
                                encode_event(TokenStreamEvent(index=0, token_ids=[i], text=str(i))))
                event = await asyncio.wait_for(stream.__anext__(), 10)
                assert event["token_ids"] == [i]
            assert client._streams._following  # followed while iterated
            del stream, event
            gc.collect()
            assert not client._streams._following

    run(scenario)


@pytest.mark.parametrize("streams", [64])
def test_one_connection_serves_every_stream(redis_url: str, redis_conn: redis.Redis, streams: int) -> None:
    """Streams waiting on silent jobs hold no connection each: the client's pool stays small."""
    async def scenario() -> None:
        async with AsyncClient(redis_url) as client:
            job_ids = [await client.submit({"prompt": "x", "stream": True}) for _ in range(streams)]
            iterators = [client.stream(job_id, timeout=30) for job_id in job_ids]
            pending = [asyncio.create_task(it.__anext__()) for it in iterators]
            await asyncio.sleep(1.5)
            in_use = len(client.connection.connection_pool._in_use_connections)
            for job_id in job_ids:
                redis_conn.xadd(keys.stream_key(job_id), encode_event(TokenStreamEvent(index=0, token_ids=[1], text="a")))
            events = await asyncio.gather(*pending)
            assert all(event["token_ids"] == [1] for event in events)
            assert in_use <= 3, in_use  # the hub's read, the done subscription, maybe one command

    run(scenario)
