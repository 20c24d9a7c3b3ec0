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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import producer.aio
import producer.aio_stream
import producer.stream_hub
from producer import AsyncClient, GenerationResult, InvalidRequest
from producer.stream_hub import StreamHub
from producer.wire import parse_event_id
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


def test_entries_the_hub_read_past_what_a_reader_saw_by_itself_are_still_given(redis_url: str) -> None:
    """A reader's own read (AsyncJobStream's state check) may end before entries the hub buffered for it
    meanwhile: skipping to the last entry it saw keeps the ones after it. (A streamed chat lost a token
    to this in the tenant-attack suite: the hub had advanced past the reader's read.)"""
    async def scenario() -> None:
        async with _hub(redis_url) as (connection, hub):
            following = hub.follow("s", "0-0")
            ids = [await connection.xadd("s", {"v": str(i)}) for i in range(3)]
            for _ in range(200):  # the hub reads them into the following's buffer, untaken
                if len(following.buffered) == 3:
                    break
                await asyncio.sleep(0.01)
            assert len(following.buffered) == 3
            following.skip_to(ids[1])  # the reader's own read returned entries 0 and 1
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


# ---------------------------------------------------------------- one reader's error is its own


def _client_ids(conn: redis.Redis, command: str) -> list[int]:
    """The ids of the server's clients whose last command was `command` (lower case)."""
    return [int(c["id"]) for c in conn.client_list() if c.get("cmd") == command]


async def _collect(hub: StreamHub, key: str, count: int) -> list[bytes]:
    following = hub.follow(key, "0-0")
    values: list[bytes] = []
    try:
        while len(values) < count:
            values += [fields[b"v"] for _, fields in await hub.take(following, 1.0)]
    finally:
        hub.close(following)
    return values


def test_a_stream_whose_read_fails_costs_only_itself(redis_url: str, redis_conn: redis.Redis) -> None:
    """A followed key that stops being a stream fails the shared read: that stream's reader gets the
    error, the others get every entry, in order, and the hub reads on."""
    async def scenario() -> None:
        async with _hub(redis_url) as (connection, hub):
            await connection.xadd("broken", {"v": "0"})
            good = {key: asyncio.create_task(_collect(hub, key, 20)) for key in ("a", "b")}
            broken = asyncio.create_task(_collect(hub, "broken", 20))
            for i in range(10):
                for key in good:
                    await connection.xadd(key, {"v": f"{key}{i}"})
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            redis_conn.delete("broken")
            redis_conn.set("broken", "not a stream")  # XREAD of it now fails: WRONGTYPE
            for i in range(10, 20):
                for key in good:
                    await connection.xadd(key, {"v": f"{key}{i}"})
                await asyncio.sleep(0.01)
            with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
                await broken
            for key, task in good.items():
                assert await task == [f"{key}{i}".encode() for i in range(20)]
            assert "broken" not in hub._following

    run(scenario)


def test_client_unblock_with_an_error_costs_no_stream(redis_url: str, redis_conn: redis.Redis) -> None:
    """Another client ends the hub's blocking read with an error (`CLIENT UNBLOCK <id> ERROR`), again
    and again: every stream still gets every entry, in order."""
    async def scenario() -> None:
        async with _hub(redis_url) as (connection, hub):
            readers = {key: asyncio.create_task(_collect(hub, key, 40)) for key in ("a", "b", "c")}
            await asyncio.sleep(0.2)
            unblocked = 0
            for i in range(40):
                for blocked in _client_ids(redis_conn, "xread"):
                    unblocked += redis_conn.execute_command("CLIENT", "UNBLOCK", blocked, "ERROR")
                for key in readers:
                    await connection.xadd(key, {"v": f"{key}{i}"})
                await asyncio.sleep(0.02)
            for key, task in readers.items():
                assert await task == [f"{key}{i}".encode() for i in range(40)]
            assert unblocked > 0  # the attack reached the hub's read

    run(scenario)


def test_a_lost_connection_is_read_again_without_failing_a_stream(redis_url: str, redis_conn: redis.Redis) -> None:
    async def scenario() -> None:
        async with _hub(redis_url) as (connection, hub):
            reader = asyncio.create_task(_collect(hub, "s", 20))
            await asyncio.sleep(0.2)
            for i in range(20):
                if i in (5, 12):
                    for blocked in _client_ids(redis_conn, "xread"):
                        redis_conn.client_kill_filter(_id=blocked)
                await connection.xadd("s", {"v": str(i)})
                await asyncio.sleep(0.02)
            assert await reader == [str(i).encode() for i in range(20)]

    run(scenario)


def test_a_wake_stream_someone_else_broke_turns_wakes_into_polls(redis_url: str, redis_conn: redis.Redis,
                                                                 monkeypatch) -> None:
    """The hub's wake stream overwritten with a string by another client: the hub reads on, polling,
    and a stream followed afterwards still gets its entries."""
    monkeypatch.setattr(producer.stream_hub, "block_slice", lambda left, socket_timeout: 60.0)

    async def scenario() -> None:
        async with _hub(redis_url) as (connection, hub):
            first = asyncio.create_task(_collect(hub, "first", 3))
            await asyncio.sleep(0.2)
            assert hub.wakes_allowed is True
            redis_conn.set(hub._wake_key, "not a stream")
            second = asyncio.create_task(_collect(hub, "second", 3))  # its wake fails; the read then does
            for i in range(3):
                await connection.xadd("first", {"v": str(i)})
                await connection.xadd("second", {"v": str(i)})
                await asyncio.sleep(0.05)
            assert await asyncio.wait_for(second, 10) == [b"0", b"1", b"2"]
            assert await asyncio.wait_for(first, 10) == [b"0", b"1", b"2"]
            assert hub.wakes_allowed is False

    run(scenario)


@pytest.mark.parametrize("bad", ["99999999999999999999", "18446744073709551616-0", "1-18446744073709551616",
                                 "1²", "１-0", "-1", "1-", "1--2", " 1", "1 ", "1-2-3", "0x10", "1e3", "", "$", ">",
                                 "+", "1-*"])
def test_a_position_redis_would_refuse_is_refused_when_followed(redis_url: str, bad: str) -> None:
    async def scenario() -> None:
        async with _hub(redis_url) as (_, hub):
            with pytest.raises(InvalidRequest, match="last_event_id"):
                hub.follow("s", bad)
            assert not hub._following

    run(scenario)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.from_regex(r"\A[0-9]{1,21}(-[0-9]{1,21})?\Z"), st.text(max_size=24)))
def test_every_event_id_accepted_is_one_redis_reads(redis_conn: redis.Redis, text: str) -> None:
    """What `parse_event_id` accepts, Redis's XREAD takes; what it refuses is an InvalidRequest."""
    try:
        major, minor = parse_event_id(text)
    except InvalidRequest as exc:
        assert exc.field == "last_event_id"
        return
    redis_conn.xread({"s": text}, count=1)
    redis_conn.xread({"s": f"{major}-{minor}"}, count=1)


def test_an_undecodable_done_channel_leaves_the_done_listener_working(redis_url: str, redis_conn: redis.Redis,
                                                                     monkeypatch) -> None:
    """A publish on `mlxq:done:<bytes that are not UTF-8>` (any producer may publish there) does not end
    the client's done subscription: a wait after it is still woken by its job's done message (with the
    safety poll a minute away, nothing else could end it)."""
    monkeypatch.setattr(producer.aio, "SAFETY_POLL_S", 60.0)

    async def scenario() -> None:
        async with AsyncClient(redis_url) as client:
            job_id = await client.submit({"prompt": "x"})
            waiting = asyncio.create_task(client.wait(job_id, timeout=20))
            await asyncio.sleep(0.3)
            redis_conn.publish(keys.done_channel("").encode() + b"\xff\xfe", b"x")
            await asyncio.sleep(0.2)
            result = GenerationResult(id=job_id, status="finished", choices=[])
            redis_conn.set(keys.result_key(job_id), result.model_dump_json())
            redis_conn.publish(keys.done_channel(job_id), job_id)
            assert (await asyncio.wait_for(waiting, 10)).status == "finished"
            assert client._listener._task is not None and not client._listener._task.done()

    run(scenario)
