"""The loop's one round trip per turn (worker/poll.py), against a real redis-server."""

from __future__ import annotations

import redis

from schemas import keys
from worker.poll import Poller


def _queue(conn: redis.Redis, name: str, ids: list[str]) -> tuple[str, str]:
    pair = (f"rq:queue:{name}", f"rq:queue:{name}:intermediate")
    for job_id in ids:
        conn.hset(f"rq:job:{job_id}", mapping={"origin": name})
        conn.rpush(pair[0], job_id)
    return pair


def test_it_takes_jobs_in_queue_order_up_to_room_and_parks_them_in_the_intermediate_lists(redis_conn):
    high, low = _queue(redis_conn, "high", ["h1", "h2"]), _queue(redis_conn, "low", ["l1", "l2"])
    poll = Poller(redis_conn, "w").poll([high, low], 3, "rq:job:", check_cancels=False)
    assert [(t.queue_index, t.job_id) for t in poll.taken] == [(0, "h1"), (0, "h2"), (1, "l1")]
    assert poll.taken[0].fields == {b"origin": b"high"}
    assert redis_conn.lrange(high[1], 0, -1) == [b"h1", b"h2"] and redis_conn.lrange(low[1], 0, -1) == [b"l1"]
    assert redis_conn.lrange(low[0], 0, -1) == [b"l2"]
    assert Poller(redis_conn, "w").poll([high, low], 0, "rq:job:", check_cancels=False).taken == []


def test_it_finds_exactly_the_running_jobs_that_have_a_cancel_key_among_many(redis_conn):
    poller = Poller(redis_conn, "w")
    running = [f"job-{i}" for i in range(1200)]  # more than one EXISTS chunk
    redis_conn.sadd(poller.running_key, *running)
    assert poller.poll([], 0, "rq:job:", check_cancels=True).cancelled == set()
    for job_id in ("job-3", "job-700", "job-1199", "not-running"):
        redis_conn.set(keys.cancel_key(job_id), 1)
    assert poller.poll([], 0, "rq:job:", check_cancels=True).cancelled == {"job-3", "job-700", "job-1199"}
    assert poller.poll([], 0, "rq:job:", check_cancels=False).cancelled == set()
    other = Poller(redis_conn, "other-worker")  # each worker looks at its own running set only
    assert other.poll([], 0, "rq:job:", check_cancels=True).cancelled == set()


def test_ended_jobs_leave_the_running_set_with_the_next_poll_before_its_cancel_check(redis_conn):
    poller = Poller(redis_conn, "w")
    running = [f"job-{i}" for i in range(1500)]  # more than one SREM chunk of the script
    redis_conn.sadd(poller.running_key, *running)
    for job_id in running:
        redis_conn.set(keys.cancel_key(job_id), 1)
    poller.ended(running[:1400])
    poller.started(["job-5"])  # taken again after it ended: running, whatever its last attempt left
    assert poller.poll([], 0, "rq:job:", check_cancels=True).cancelled == {"job-5", *running[1400:]}
    assert redis_conn.scard(poller.running_key) == 101
    poller.ended(["job-5"])
    assert poller.poll([], 0, "rq:job:", check_cancels=False).cancelled == set()
    assert not redis_conn.sismember(poller.running_key, "job-5")
    assert poller.poll([], 0, "rq:job:", check_cancels=True).cancelled == set(running[1400:])
    poller.ended(running[1400:1450])
    poller.remove_ended()  # a stopping worker's, without a poll
    assert redis_conn.scard(poller.running_key) == 50
