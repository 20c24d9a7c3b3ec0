"""Broker URLs (schemas/broker.py) and durable writes (schemas/durability.py): Sentinel URLs parsed and
refused with the reason, clients that follow them, and `durable=True` submits against a real primary with
and without a replica."""

from __future__ import annotations

import asyncio

import pytest
import redis

from mlxq.redis_server import RedisServer
from producer import AsyncClient, Client, NotDurable
from producer.errors import BrokerError
from schemas import broker
from schemas.durability import Durability, NotReplicated
from tests.sentinel import sentinel_set

REQUEST = {"prompt_token_ids": [1, 2, 3], "max_tokens": 4}


def test_a_sentinel_url_names_its_sentinels_service_db_and_credentials():
    url = broker.parse_sentinel_url("redis+sentinel://app:p%40ss@h1:26380,h2,[::1]:26381/prod/2?socket_timeout=1.5")
    assert url.sentinels == (("h1", 26380), ("h2", 26379), ("::1", 26381))
    assert (url.service_name, url.db, url.username, url.password) == ("prod", 2, "app", "p@ss")
    assert url.connection_kwargs() == {"db": 2, "username": "app", "password": "p@ss", "socket_timeout": 1.5}
    assert url.sentinel_kwargs() == {"socket_timeout": 1.5}
    plain = broker.parse_sentinel_url("redis+sentinel://h:1/svc?sentinel_password=s")
    assert (plain.db, plain.password, plain.sentinel_kwargs()) == (0, None, {"password": "s"})


@pytest.mark.parametrize("url, says", [
    ("redis+sentinel://h:1", "path is /service_name"),
    ("redis+sentinel://h:1/svc/db0", "db must be a number"),
    ("redis+sentinel://h:1/a/1/x", "path is /service_name"),
    ("redis+sentinel:///svc", "at least one sentinel"),
    ("redis+sentinel://h:99999/svc", "port must be a number"),
    ("redis+sentinel://h:1/svc?color=red", "unknown option 'color'"),
    ("redis+sentinel://h:1/svc?socket_timeout=soon", "socket_timeout"),
])
def test_a_bad_sentinel_url_is_refused_with_the_reason(url, says):
    with pytest.raises(ValueError, match=says):
        broker.parse_sentinel_url(url)
    with pytest.raises(BrokerError, match=says):
        Client(url)


def test_passwords_are_redacted_from_every_kind_of_url():
    assert broker.redact_url("redis+sentinel://u:secret@h1:1,h2:2/m/0") == "redis+sentinel://u:***@h1:1,h2:2/m/0"
    assert broker.redact_url("redis://:pw@host:6379/0") == "redis://:***@host:6379/0"
    assert broker.redact_url("redis://host:6379/0") == "redis://host:6379/0"
    assert "secret" not in repr(Client("redis+sentinel://u:secret@127.0.0.1:1/m"))


def test_a_plain_url_still_connects_as_before(redis_url):
    conn = broker.connect(redis_url)
    assert conn.ping()
    probe = broker.sibling(conn, socket_timeout=0.5)
    assert probe.ping() and probe.connection_pool.connection_kwargs["socket_timeout"] == 0.5
    conn.close()
    probe.close()


@pytest.mark.slow
def test_sentinel_clients_sync_async_and_probe_reach_the_primary_and_follow_a_failover():
    with sentinel_set(replicas=1, sentinels=3) as redis_set:
        sync = broker.connect(redis_set.url)
        probe = broker.sibling(sync, socket_timeout=1)
        sync.set("before", "1")
        assert sync.wait(1, 2000) == 1
        old = redis_set.crash_primary()
        new = redis_set.wait_for_new_primary(old)
        for _ in range(50):  # bounded: the first calls after the kill may meet the dead primary
            try:
                assert sync.get("before") == b"1" and probe.ping()
                break
            except redis.ConnectionError:
                asyncio.run(asyncio.sleep(0.2))
        assert sync.connection_pool.get_master_address()[1] == new

        async def async_side() -> bytes:
            conn = broker.connect_async(redis_set.url, max_connections=4)
            try:
                await conn.set("after", "2")
                return await conn.get("before")
            finally:
                await conn.aclose()

        assert asyncio.run(async_side()) == b"1"
        sync.close()
        probe.close()


def test_a_durable_submit_with_no_replica_says_the_job_is_not_safe_and_names_it(redis_url):
    client = Client(redis_url, durability=Durability(replicas=1, timeout_ms=50))
    with pytest.raises(NotDurable, match="0 of the 1 replica") as caught:
        client.submit(REQUEST, durable=True)
    (job_id,) = caught.value.job_ids
    assert client.status(job_id) == "queued"  # on the primary all the same
    assert client.submit(REQUEST)  # without durable: no wait

    async def aio() -> None:
        async with AsyncClient(redis_url, durability=Durability(1, 50)) as aclient:
            with pytest.raises(NotDurable):
                await aclient.submit(REQUEST, durable=True)
    asyncio.run(aio())
    client.close()


def test_a_durable_submit_returns_once_a_replica_has_the_job():
    with RedisServer(extra_args=["--repl-diskless-sync-delay", "0"]) as primary, \
            RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]) as replica:
        replica_conn = redis.Redis(port=replica.port)
        for _ in range(100):
            if replica_conn.info("replication")["master_link_status"] == "up":
                break
            asyncio.run(asyncio.sleep(0.05))
        client = Client(primary.url)
        job_id = client.submit(REQUEST, durable=True)
        # WAIT returned: the replica has the job already, no polling needed.
        assert replica_conn.hget(f"rq:job:{job_id}", "status") == b"queued"
        ids = client.submit_many([REQUEST] * 3, durable=True)
        assert all(replica_conn.exists(f"rq:job:{i}") for i in ids)

        async def aio() -> str:
            async with AsyncClient(primary.url) as aclient:
                return await aclient.submit(REQUEST, durable=True)
        assert replica_conn.exists(f"rq:job:{asyncio.run(aio())}")
        client.close()
        replica_conn.close()


def test_not_replicated_is_a_connection_error_that_names_the_shortfall():
    with pytest.raises(NotReplicated, match="1 of the 2 replica"):
        Durability(replicas=2, timeout_ms=10).check(1)
    assert issubclass(NotReplicated, redis.ConnectionError)  # the worker's bookkeeping retries it
    with pytest.raises(ValueError):
        Durability(replicas=0)
