"""The producer package and its CLI verbs, against a real redis-server. Every test that takes the
`client` or `new_client` fixture runs twice: with `Client` and with `AsyncClient` (tests/clients.py)."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
from redis.connection import Connection
from rq.job import Job
from rq.registry import CanceledJobRegistry
from rq.serializers import JSONSerializer

import producer
import producer.aio
import producer.client
import producer.errors
from mlxq import producer_commands
from mlxq.redis_server import free_port
from producer import (
    BrokerError,
    Client,
    GenerationResult,
    InvalidRequest,
    JobNotFound,
    MlxqError,
    RequestLimits,
    WaitTimeout,
)
from producer.pubsub import BURST_GAP_S, read_burst
from schemas import keys
from tests.clients import client, kind, new_client  # noqa: F401  (fixtures: each test runs with both clients)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def no_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Push the waiters' safety poll out of reach: a prompt return must come from pub/sub."""
    monkeypatch.setattr(producer.client, "SAFETY_POLL_S", 60.0)
    monkeypatch.setattr(producer.aio, "SAFETY_POLL_S", 60.0)


def finish(conn: redis.Redis, job_id: str, status: str = "finished", text: str = "ok", publish: bool = True) -> None:
    """Do what a worker does when a job ends: write the result key, then publish the id."""
    result = GenerationResult(
        id=job_id,
        status=status,  # type: ignore[arg-type]
        choices=[{"index": 0, "text": text, "token_ids": [1, 2], "finish_reason": "stop"}] if status == "finished" else [],
    )
    conn.set(keys.result_key(job_id), result.model_dump_json(), ex=60)
    if publish:
        conn.publish(keys.done_channel(job_id), job_id)


def job_data(conn: redis.Redis, job_id: str) -> list[Any]:
    raw = conn.hget(Job.key_for(job_id), "data")
    assert raw is not None
    return json.loads(zlib.decompress(raw))  # RQ zlib-compresses the serializer's bytes


# ---------------------------------------------------------------- submitting


def test_routing_by_model_and_explicit_queue(client: Any, redis_conn: redis.Redis) -> None:
    with_model = client.submit({"prompt": "a", "model": "qwen"})
    without = client.submit({"prompt": "b"})
    explicit = client.submit({"prompt": "c", "model": "qwen"}, queue="urgent")
    assert redis_conn.lrange("rq:queue:mlxq:qwen", 0, -1) == [with_model.encode()]
    assert redis_conn.lrange("rq:queue:mlxq", 0, -1) == [without.encode()]
    assert redis_conn.lrange("rq:queue:urgent", 0, -1) == [explicit.encode()]


def test_priorities_pick_sibling_queues(client: Any, redis_conn: redis.Redis) -> None:
    high = client.submit({"prompt": "a", "model": "qwen"}, priority="high")
    low = client.submit_many([{"prompt": "b"}], priority="low")[0]
    default = client.submit({"prompt": "c", "model": "qwen"}, priority="default")
    explicit = client.submit({"prompt": "d"}, queue="urgent", priority="high")
    assert redis_conn.lrange("rq:queue:mlxq:qwen@high", 0, -1) == [high.encode()]
    assert redis_conn.lrange("rq:queue:mlxq@low", 0, -1) == [low.encode()]
    assert redis_conn.lrange("rq:queue:mlxq:qwen", 0, -1) == [default.encode()]
    assert redis_conn.lrange("rq:queue:urgent@high", 0, -1) == [explicit.encode()]
    with pytest.raises(InvalidRequest) as info:
        client.submit({"prompt": "e"}, priority="urgent")
    assert info.value.field == "priority" and "high" in str(info.value)


def test_a_borrowed_connection_stays_open() -> None:
    conn = fakeredis.FakeRedis()
    c = Client(connection=conn)
    job_id = c.submit({"prompt": "b"})
    assert conn.lrange("rq:queue:mlxq", 0, -1) == [job_id.encode()]
    c.close()
    conn.ping()


def test_job_on_the_wire_is_json(client: Any, redis_conn: redis.Redis) -> None:
    job_id = client.submit(
        {"prompt": "hello", "max_tokens": 5, "logit_bias": {"7": 1.5}, "metadata": {"k": "v"}},
        timeout=60,
        ttl=300,
        result_ttl=900,
        retry=2,
    )
    func, instance, args, kwargs = job_data(redis_conn, job_id)
    assert (func, instance, args) == (keys.JOB_FUNCTION, None, [])
    # Only the fields the caller set, JSON-typed.
    assert kwargs == {"request": {"prompt": "hello", "max_tokens": 5, "logit_bias": {"7": 1.5}, "metadata": {"k": "v"}}}
    raw = redis_conn.hgetall(Job.key_for(job_id))
    assert raw[b"timeout"] == b"60" and raw[b"result_ttl"] == b"900" and raw[b"ttl"] == b"300"
    assert raw[b"retries_left"] == b"2"
    assert b"hello" not in raw[b"description"]  # the prompt is not copied into the description
    job = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
    assert job.func_name == "worker.tasks.generate" and job.origin == "mlxq"


def test_submit_accepts_a_model_instance(client: Any, redis_conn: redis.Redis) -> None:
    request = producer.GenerationRequest.model_validate({"prompt_token_ids": [1, 2, 3], "seed": 4})
    job_id = client.submit(request, job_id="my-job_1")
    assert job_id == "my-job_1"
    assert job_data(redis_conn, job_id)[3] == {"request": {"prompt_token_ids": [1, 2, 3], "seed": 4}}


@pytest.mark.parametrize(
    ("request_", "kwargs", "field"),
    [
        ({"prompt": "x", "max_tokens": 0}, {}, "max_tokens"),
        ({"prompt": "x", "temperature": 9}, {}, "temperature"),
        ({"prompt": "x", "bogus": 1}, {}, "bogus"),
        ({"max_tokens": 3}, {}, "prompt"),
        ({"prompt": "x"}, {"job_id": "has space"}, "job_id"),
        ({"prompt": "x"}, {"result_ttl": 0}, "result_ttl"),
        ({"prompt": "x"}, {"ttl": -1}, "ttl"),
        ({"prompt": "x"}, {"retry": -1}, "retry"),
    ],
)
def test_invalid_request_enqueues_nothing(
    client: Any, redis_conn: redis.Redis, request_: dict[str, Any], kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        client.submit(request_, **kwargs)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)
    assert redis_conn.dbsize() == 0


def test_limits_are_checked_before_enqueue(new_client: Any, redis_url: str, redis_conn: redis.Redis) -> None:
    c = new_client(redis_url, limits=RequestLimits(max_tokens=100))
    with pytest.raises(InvalidRequest, match="max_tokens") as info:
        c.submit({"prompt": "x", "max_tokens": 101})
    assert info.value.field == "max_tokens"
    assert redis_conn.dbsize() == 0
    c.submit({"prompt": "x", "max_tokens": 100})


class CountingConnection(Connection):
    """Counts writes to the socket: one per direct command, one per pipeline execute."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        super().send_packed_command(command, check_health)


def test_submit_many_is_one_round_trip(redis_url: str, redis_conn: redis.Redis) -> None:
    conn = redis.Redis.from_url(redis_url, connection_class=CountingConnection)
    c = Client(connection=conn)
    c.submit({"prompt": "warm-up"})  # opens the connection; RQ reads the server version once
    CountingConnection.sends = 0
    requests = [{"prompt": f"p{i}", "model": ["a", "b", None][i % 3]} for i in range(30)]
    ids = c.submit_many(requests)
    assert CountingConnection.sends == 1
    assert len(ids) == len(set(ids)) == 30
    assert redis_conn.llen("rq:queue:mlxq:a") == 10
    assert redis_conn.llen("rq:queue:mlxq:b") == 10
    assert redis_conn.llen("rq:queue:mlxq") == 11
    # Order of ids matches the order of requests.
    assert [job_data(redis_conn, i)[3]["request"]["prompt"] for i in ids] == [f"p{i}" for i in range(30)]
    conn.close()


def test_submit_many_is_all_or_nothing(client: Any, redis_conn: redis.Redis) -> None:
    requests: list[dict[str, Any]] = [{"prompt": f"p{i}"} for i in range(5)]
    requests[3]["max_tokens"] = 0
    with pytest.raises(InvalidRequest) as info:
        client.submit_many(requests)
    assert info.value.field == "requests[3].max_tokens"
    assert "requests[3].max_tokens:" in str(info.value)
    assert redis_conn.dbsize() == 0
    with pytest.raises(InvalidRequest, match=r"job_ids\[1\]"):
        client.submit_many(requests[:2], job_ids=["same", "same"])
    assert redis_conn.dbsize() == 0
    assert client.submit_many([]) == []


def test_submit_many_with_explicit_queue(client: Any, redis_conn: redis.Redis) -> None:
    ids = client.submit_many([{"prompt": "a", "model": "m"}, {"prompt": "b"}], queue="batch", job_ids=["j1", "j2"])
    assert ids == ["j1", "j2"]
    assert redis_conn.lrange("rq:queue:batch", 0, -1) == [b"j1", b"j2"]


# ---------------------------------------------------------------- reading


def test_status_and_result(client: Any, redis_conn: redis.Redis) -> None:
    job_id = client.submit({"prompt": "x"})
    assert client.status(job_id) == "queued"
    assert client.result(job_id) is None
    redis_conn.hset(Job.key_for(job_id), "status", "started")
    assert client.status(job_id) == "started"
    finish(redis_conn, job_id, text="done")
    assert client.status(job_id) == "finished"
    result = client.result(job_id)
    assert result is not None and result.choices[0].text == "done"


def test_result_key_status_wins_and_outlives_the_job(client: Any, redis_conn: redis.Redis) -> None:
    job_id = client.submit({"prompt": "x"})
    finish(redis_conn, job_id, status="cancelled")
    assert client.status(job_id) == "cancelled"  # RQ still says queued
    redis_conn.delete(Job.key_for(job_id))
    assert client.status(job_id) == "cancelled"
    assert client.result(job_id).status == "cancelled"  # type: ignore[union-attr]


def test_unknown_job(client: Any) -> None:
    for call in (client.status, client.result, client.cancel, lambda i: client.wait(i, timeout=1)):
        with pytest.raises(JobNotFound) as info:
            call("nope")
        assert isinstance(info.value, KeyError)
        assert "nope" in str(info.value)


def test_job_ended_by_rq_without_a_result(client: Any, redis_conn: redis.Redis) -> None:
    job_id = client.submit({"prompt": "x", "custom_id": "c1"})
    redis_conn.lpop("rq:queue:mlxq")
    redis_conn.hset(Job.key_for(job_id), "status", "failed")  # e.g. RQ's abandoned-job cleanup
    result = client.result(job_id)
    assert result is not None and result.status == "failed" and result.custom_id == "c1"
    assert result.error is not None and result.error.type == "NoResult"
    assert client.wait(job_id, timeout=5).status == "failed"


# ---------------------------------------------------------------- waiting


def test_wait_returns_promptly_after_publish(client: Any, redis_conn: redis.Redis, no_polling: None) -> None:
    job_id = client.submit({"prompt": "x"})
    written = threading.Event()

    def worker() -> None:
        conn = redis.Redis.from_url(client.url)
        time.sleep(0.2)
        conn.publish(keys.done_channel(job_id), job_id)  # a stray message: no result yet
        time.sleep(0.3)
        finish(conn, job_id, text="late")
        written.set()
        conn.close()

    thread = threading.Thread(target=worker)
    start = time.monotonic()
    thread.start()
    result = client.wait(job_id, timeout=30)
    elapsed = time.monotonic() - start
    thread.join()
    assert written.is_set()
    assert result.choices[0].text == "late"
    assert 0.45 <= elapsed < 10


def test_wait_falls_back_to_polling_without_a_message(
    client: Any, redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(producer.client, "SAFETY_POLL_S", 0.3)
    monkeypatch.setattr(producer.aio, "SAFETY_POLL_S", 0.3)
    job_id = client.submit({"prompt": "x"})
    timer = threading.Timer(0.2, finish, (redis_conn, job_id), {"publish": False})
    start = time.monotonic()
    timer.start()
    result = client.wait(job_id, timeout=30)
    assert result.status == "finished"
    assert time.monotonic() - start < 10


def test_wait_for_a_finished_job_needs_no_time(client: Any, redis_conn: redis.Redis) -> None:
    job_id = client.submit({"prompt": "x"})
    finish(redis_conn, job_id, status="failed")
    assert client.wait(job_id, timeout=0).status == "failed"


def test_wait_timeout(client: Any) -> None:
    job_id = client.submit({"prompt": "x"})
    start = time.monotonic()
    with pytest.raises(WaitTimeout) as info:
        client.wait(job_id, timeout=0.5)
    elapsed = time.monotonic() - start
    assert 0.45 <= elapsed < 5
    assert isinstance(info.value, TimeoutError)
    assert info.value.pending == (job_id,)
    with pytest.raises(WaitTimeout):
        client.wait(job_id, timeout=0)


def test_wait_many(client: Any, redis_conn: redis.Redis, no_polling: None) -> None:
    ids = client.submit_many([{"prompt": f"p{i}"} for i in range(4)])
    finish(redis_conn, ids[0], text="t0")
    timers = [threading.Timer(0.1 * i, finish, (redis_conn, job_id), {"text": f"t{i}"}) for i, job_id in enumerate(ids)]
    for timer in timers[1:]:
        timer.start()
    start = time.monotonic()
    results = client.wait_many(ids + [ids[0]], timeout=30)
    assert time.monotonic() - start < 10
    assert list(results) == ids
    assert [results[i].choices[0].text for i in ids] == ["t0", "t1", "t2", "t3"]
    with pytest.raises(JobNotFound):
        client.wait_many([ids[0], "missing"], timeout=1)
    other = client.submit({"prompt": "never"})
    with pytest.raises(WaitTimeout) as info:
        client.wait_many([ids[1], other], timeout=0.3)
    assert info.value.pending == (other,)


def test_wait_many_survives_a_read_that_times_out_mid_message(
        client: Any, kind: str, redis_conn: redis.Redis, no_polling: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py raises TimeoutError when only part of a message has arrived (and its reconnects can
    drop messages): the waiter re-reads every job instead of failing, and misses none."""
    ids = client.submit_many([{"prompt": f"p{i}"} for i in range(6)])
    pubsub_class = redis.client.PubSub if kind == "sync" else redis.asyncio.client.PubSub
    real_get_message = pubsub_class.get_message
    calls = {"messages": 0}

    def lose_one(message: Any) -> Any:
        if message is not None and message["type"] in ("message", "pmessage"):
            calls["messages"] += 1
            if calls["messages"] == 2:  # this message and the ones behind it are lost mid-read
                raise redis.TimeoutError("Timeout reading from socket")
        return message

    def flaky_get_message(self: Any, *args: Any, **kwargs: Any) -> Any:
        return lose_one(real_get_message(self, *args, **kwargs))

    async def flaky_get_message_async(self: Any, *args: Any, **kwargs: Any) -> Any:
        return lose_one(await real_get_message(self, *args, **kwargs))

    monkeypatch.setattr(pubsub_class, "get_message", flaky_get_message if kind == "sync" else flaky_get_message_async)
    timer = threading.Timer(0.2, lambda: [finish(redis_conn, job_id, text=job_id) for job_id in ids])
    timer.start()
    start = time.monotonic()
    results = client.wait_many(ids, timeout=30)
    assert time.monotonic() - start < 10  # not the 60 s safety poll
    assert calls["messages"] >= 2
    assert {job_id: r.choices[0].text for job_id, r in results.items()} == {job_id: job_id for job_id in ids}


def test_read_burst_takes_what_arrived_and_reports_a_broken_read() -> None:
    class Script:
        def __init__(self, replies: list[Any]) -> None:
            self.replies, self.timeouts = replies, []

        def get_message(self, timeout: float) -> Any:
            self.timeouts.append(timeout)
            reply = self.replies.pop(0)
            if isinstance(reply, Exception):
                raise reply
            return reply

    whole = Script([{"type": "message", "data": b"a"}, {"type": "message", "data": b"b"}, None])
    assert read_burst(whole, 1.5) == ([{"type": "message", "data": b"a"}, {"type": "message", "data": b"b"}], True)  # type: ignore[arg-type]
    assert whole.timeouts == [1.5, BURST_GAP_S, BURST_GAP_S]
    broken = Script([{"type": "message", "data": b"a"}, redis.TimeoutError("partial")])
    assert read_burst(broken, 1.5) == ([{"type": "message", "data": b"a"}], False)  # type: ignore[arg-type]
    assert read_burst(Script([None]), 0.1) == ([], True)  # type: ignore[arg-type]


# ---------------------------------------------------------------- cancelling


def test_cancel_a_queued_job(client: Any, redis_conn: redis.Redis) -> None:
    job_id = client.submit(
        {"prompt": "x", "model": "m", "custom_id": "c7", "metadata": {"user": "u"}}, result_ttl=1234
    )
    assert client.cancel(job_id) is True
    assert redis_conn.llen("rq:queue:mlxq:m") == 0
    assert redis_conn.get(keys.cancel_key(job_id)) == b"1"
    assert 86000 < redis_conn.ttl(keys.cancel_key(job_id)) <= 86400
    assert 1200 < redis_conn.ttl(keys.result_key(job_id)) <= 1234
    stored = GenerationResult.model_validate_json(redis_conn.get(keys.result_key(job_id)))  # type: ignore[arg-type]
    assert (stored.status, stored.choices, stored.custom_id, stored.model) == ("cancelled", [], "c7", "m")
    assert stored.metadata == {"user": "u"}
    assert stored.timings.enqueued_at is not None
    job = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == "canceled"
    assert job_id in CanceledJobRegistry("mlxq:m", connection=redis_conn)
    assert client.status(job_id) == "cancelled"
    assert client.wait(job_id, timeout=5).status == "cancelled"
    assert client.cancel(job_id) is False  # already ended


def test_cancel_wakes_a_waiter(client: Any, new_client: Any, redis_url: str, no_polling: None) -> None:
    job_id = client.submit({"prompt": "x"})
    got: list[GenerationResult] = []
    other = new_client(redis_url)
    waiter = threading.Thread(target=lambda: got.append(other.wait(job_id, timeout=30)))
    start = time.monotonic()
    waiter.start()
    time.sleep(0.3)
    client.cancel(job_id)
    waiter.join()
    assert got[0].status == "cancelled"
    assert time.monotonic() - start < 10


def test_cancel_a_job_a_worker_already_took(client: Any, redis_conn: redis.Redis) -> None:
    job_id = client.submit({"prompt": "x"})
    redis_conn.lpop("rq:queue:mlxq")  # popped but not yet marked started
    assert client.cancel(job_id) is True
    assert redis_conn.get(keys.cancel_key(job_id)) == b"1"  # the worker will see it
    assert redis_conn.get(keys.result_key(job_id)) is None  # and writes the result itself
    redis_conn.hset(Job.key_for(job_id), "status", "started")
    assert client.cancel(job_id) is True
    assert client.status(job_id) == "started"


def test_cancel_after_the_job_ended(client: Any, redis_conn: redis.Redis) -> None:
    job_id = client.submit({"prompt": "x"})
    finish(redis_conn, job_id)
    assert client.cancel(job_id) is False
    assert redis_conn.get(keys.cancel_key(job_id)) is None


# ---------------------------------------------------------------- connection and errors


def test_url_from_environment(new_client: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXQ_REDIS_URL", redis_url)
    c = new_client(None)
    assert c.url == redis_url
    c.submit({"prompt": "x"})
    monkeypatch.delenv("MLXQ_REDIS_URL")
    assert new_client(None).url == "redis://127.0.0.1:6379/0"


def test_acl_user_in_url(new_client: Any, redis_url: str, redis_conn: redis.Redis) -> None:
    redis_conn.acl_setuser(
        "mlxq-producer", enabled=True, passwords=["+s3cret"], commands=["+@all"], keys=["*"], channels=["*"]
    )
    try:
        host = redis_url.removeprefix("redis://")
        c = new_client(f"redis://mlxq-producer:s3cret@{host}")
        job_id = c.submit({"prompt": "x"})
        assert c.status(job_id) == "queued"
        assert "s3cret" not in repr(c.client if hasattr(c, "client") else c)
        with pytest.raises(BrokerError):
            new_client(f"redis://mlxq-producer:wrong@{host}").submit({"prompt": "x"})
    finally:
        redis_conn.acl_deluser("mlxq-producer")


def test_broker_down_is_a_broker_error(new_client: Any) -> None:
    c = new_client(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(BrokerError) as info:
        c.submit({"prompt": "x"})
    assert isinstance(info.value, ConnectionError)
    assert isinstance(info.value.__cause__, redis.ConnectionError)
    for call in (lambda: c.wait("some-id", timeout=1), lambda: c.cancel("some-id"),
                 lambda: next(iter(c.stream("some-id", timeout=1)))):
        with pytest.raises(BrokerError):
            call()
    with pytest.raises(BrokerError):
        new_client("http://nope")


def test_error_hierarchy() -> None:
    for cls, builtin in (
        (InvalidRequest, ValueError),
        (JobNotFound, KeyError),
        (WaitTimeout, TimeoutError),
        (BrokerError, ConnectionError),
    ):
        assert issubclass(cls, MlxqError) and issubclass(cls, builtin)


def test_producer_imports_no_mlx_and_no_worker() -> None:
    code = (
        "import producer, sys; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'mlx_vlm', 'worker')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.parametrize("module", [producer, producer.client, producer.aio, producer.errors])
def test_every_public_name_is_in_all(module: Any) -> None:
    exported = set(module.__all__)
    assert all(hasattr(module, name) for name in exported)
    defined = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (getattr(value, "__module__", None) == module.__name__ or (module is producer and callable(value)))
    }
    assert defined <= exported, defined - exported


# ---------------------------------------------------------------- CLI


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="mlxq")
    producer_commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_submit_status_result_cancel(
    redis_url: str, redis_conn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("submit", "--url", redis_url, "--prompt", "hi", "--model", "m", "--max-tokens", "8", "--logprobs") == 0
    job_id = capsys.readouterr().out.strip()
    assert job_data(redis_conn, job_id)[3] == {
        "request": {"prompt": "hi", "model": "m", "max_tokens": 8, "logprobs": True}
    }
    assert redis_conn.lrange("rq:queue:mlxq:m", 0, -1) == [job_id.encode()]

    assert cli("status", job_id, "--url", redis_url) == 0
    assert capsys.readouterr().out.strip() == "queued"
    assert cli("result", job_id, "--url", redis_url) == 1
    assert "no result yet" in capsys.readouterr().err
    assert cli("cancel", job_id, "--url", redis_url) == 0
    assert "cancel requested" in capsys.readouterr().out
    assert cli("result", job_id, "--url", redis_url) == 1  # printed, but not finished
    assert json.loads(capsys.readouterr().out)["status"] == "cancelled"
    assert cli("status", "nope", "--url", redis_url) == 1
    assert "no such job: nope" in capsys.readouterr().err


def test_cli_invalid_input_exits_2(redis_url: str, redis_conn: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("submit", "--url", redis_url, "--prompt", "hi", "--max-tokens", "0") == 2
    err = capsys.readouterr().err
    assert "max_tokens" in err and len(err.strip().splitlines()) == 1
    assert cli("submit", "--url", redis_url, "--prompt-token-ids", "1,x") == 2
    assert "prompt_token_ids" in capsys.readouterr().err
    assert cli("submit", "--url", redis_url, "--messages", "[not json") == 2
    assert "messages" in capsys.readouterr().err
    assert redis_conn.dbsize() == 0


def test_cli_submit_json_and_messages(
    redis_url: str, redis_conn: redis.Redis, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps({"prompt": "from stdin", "n": 2, "seed": 1})))
    assert cli("submit", "--url", redis_url, "--json", "-", "--seed", "9", "--queue", "q") == 0
    job_id = capsys.readouterr().out.strip()
    assert job_data(redis_conn, job_id)[3]["request"] == {"prompt": "from stdin", "n": 2, "seed": 9}
    assert redis_conn.lrange("rq:queue:q", 0, -1) == [job_id.encode()]
    messages = '[{"role": "user", "content": "hi"}]'
    assert cli("submit", "--url", redis_url, "--messages", messages, "--temperature", "0") == 0
    job_id = capsys.readouterr().out.strip()
    assert job_data(redis_conn, job_id)[3]["request"]["messages"] == [{"role": "user", "content": "hi"}]


def test_cli_submit_wait(
    redis_url: str, redis_conn: redis.Redis, capsys: pytest.CaptureFixture[str], no_polling: None
) -> None:
    def finish_first_job() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            queued = redis_conn.lrange("rq:queue:mlxq", 0, -1)
            if queued:
                finish(redis_conn, queued[0].decode(), text="waited")
                return
            time.sleep(0.05)

    thread = threading.Thread(target=finish_first_job)
    thread.start()
    assert cli("submit", "--url", redis_url, "--prompt", "hi", "--wait", "20") == 0
    thread.join()
    out = capsys.readouterr()
    assert json.loads(out.out)["choices"][0]["text"] == "waited"
    assert "submitted" in out.err
    assert cli("submit", "--url", redis_url, "--prompt", "hi", "--wait", "0.2") == 1
    assert "no result after" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["submit", "status", "result", "cancel"])
def test_cli_help(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli(verb, "--help")
    assert info.value.code == 0
    assert "--url" in capsys.readouterr().out
