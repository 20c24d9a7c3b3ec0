"""CommandBatch: redis-py's command methods recorded, run in one atomic server-side call, with
the replies and the end state a MULTI/EXEC pipeline gives."""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest
import redis

from schemas.command_batch import CommandBatch


def write_some(target: Any) -> None:
    """A mix of what the worker writes: strings with TTLs, hashes with floats, ints and raw bytes,
    sorted sets, a stream, a read in the middle, a missing key, a set with many members."""
    target.set("a", "1", ex=100)
    target.get("missing")
    target.hset("h", mapping={"x": 1.5, "y": "zé", "n": 7, "raw": b"\x00\xff\r\n", "big": 2**53 - 1, "neg": -3})
    target.hmget("h", ["x", "nope"])
    target.zadd("z", {"m1": 1764500000.123456, "m2": 2})
    target.zrem("z", "m2")
    target.sadd("s", *[f"id{i}" for i in range(300)])
    target.srem("s", "id0")
    target.expire("h", 50)
    target.hincrbyfloat("h", "t", 0.25)
    target.persist("a")
    target.publish("chan", "hello")
    target.exists("a")


def state(conn: redis.Redis) -> dict[str, Any]:
    return {
        "a": (conn.get("a"), conn.ttl("a")),
        "h": (conn.hgetall("h"), conn.ttl("h") > 0),
        "z": conn.zrange("z", 0, -1, withscores=True),
        "s": conn.smembers("s"),
    }


def test_same_replies_and_state_as_a_transaction(redis_conn: redis.Redis) -> None:
    with redis_conn.pipeline() as pipe:
        write_some(pipe)
        expected_replies = pipe.execute()
    expected_state = state(redis_conn)
    redis_conn.flushdb()

    batch = CommandBatch(redis_conn)
    write_some(batch)
    assert len(batch) == len(expected_replies)
    replies = batch.execute()

    assert state(redis_conn) == expected_state
    assert replies is not None
    # Raw replies (no redis-py response callbacks): the same values where those leave them as is.
    assert replies[1] is None and replies[3] == [b"1.5", None] and replies[-1] == 1
    assert replies[6] == expected_replies[6] == 300
    assert len(batch) == 0  # executed commands are gone; the batch can be reused


def test_a_failing_command_does_not_stop_the_others_and_is_raised(redis_conn: redis.Redis) -> None:
    redis_conn.set("str", "x")
    batch = CommandBatch(redis_conn)
    batch.lpush("str", "y")  # WRONGTYPE
    batch.set("after", "1")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        batch.execute()
    assert redis_conn.get("after") == b"1"


def test_guard_keys_cancel_the_whole_batch(redis_conn: redis.Redis) -> None:
    batch = CommandBatch(redis_conn)
    batch.set("x", "1")
    redis_conn.set("guard", "present")
    assert batch.execute(unless_exists=["nothing-here", "guard"]) is None
    assert redis_conn.get("x") is None

    redis_conn.delete("guard")
    batch.set("x", "1")
    assert batch.execute(unless_exists=["guard"]) == [b"OK"]
    assert redis_conn.get("x") == b"1"


def test_empty_batch_makes_no_call(redis_conn: redis.Redis) -> None:
    before = redis_conn.info("stats")["total_commands_processed"]
    assert CommandBatch(redis_conn).execute() == []
    # INFO itself is the only command processed in between.
    assert redis_conn.info("stats")["total_commands_processed"] == before + 1


def test_runs_after_the_server_forgot_its_scripts(redis_conn: redis.Redis) -> None:
    batch = CommandBatch(redis_conn)
    batch.set("k", "1")
    batch.execute()
    redis_conn.script_flush()  # as after a restart
    batch.set("k", "2")
    assert batch.execute() == [b"OK"]
    assert redis_conn.get("k") == b"2"


def test_a_server_without_scripting_gets_the_same_writes_as_a_transaction(redis_conn: redis.Redis) -> None:
    """fakeredis without lupa has no EVALSHA: producers' unit tests still enqueue through it."""
    with redis_conn.pipeline() as pipe:  # the reference: a MULTI/EXEC on the real server
        write_some(pipe)
        pipe.execute()
    expected = state(redis_conn)

    fake = fakeredis.FakeRedis()
    batch = CommandBatch(fake)
    write_some(batch)
    batch.execute()
    assert state(fake) == expected

    batch.set("x", "1")
    with pytest.raises(redis.ResponseError, match="unknown command"):  # guard keys need the script
        batch.execute(unless_exists=["guard"])
