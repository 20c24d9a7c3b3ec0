"""The loop's one round trip per turn (worker/poll.py), against a real redis-server."""

from __future__ import annotations

import pytest
import redis

from schemas import keys
from schemas.redis_busy import ServerBusy
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
    assert redis_conn.lrange(low[0], 0, -1) == [b"l2"] and poll.left == 1
    looked = Poller(redis_conn, "w").poll([high, low], 0, "rq:job:", check_cancels=False)
    assert looked.taken == [] and looked.left == 1  # a full worker still learns that a job waits
    assert Poller(redis_conn, "w").poll([high, low], 5, "rq:job:", check_cancels=False).left == 0


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


def test_workers_of_a_group_share_a_burst_out_and_the_least_loaded_takes_what_waits(redis_conn):
    queue = _queue(redis_conn, "q", [f"j{i}" for i in range(10)])
    first, second = Poller(redis_conn, "w1", group="g"), Poller(redis_conn, "w2", group="g")
    second.stay_in_group()  # idle, blocked in rq's dequeue: still counted
    assert len(first.poll([queue], 10, "rq:job:", check_cancels=False).taken) == 5
    assert redis_conn.scard(first.running_key) == 5  # counted by the sibling's very next poll
    assert len(second.poll([queue], 10, "rq:job:", check_cancels=False).taken) == 5

    more = _queue(redis_conn, "q", ["k1", "k2", "k3"])
    second.ended(["j5", "j6", "j7", "j8"])  # the second worker's jobs ended: it has room to spare
    second.poll([], 0, "rq:job:", check_cancels=False)  # (they leave its running set with its next poll)
    assert first.poll([more], 10, "rq:job:", check_cancels=False).taken == []  # 5 running: over its share
    assert [t.job_id for t in second.poll([more], 10, "rq:job:", check_cancels=False).taken] == ["k1", "k2", "k3"]


def test_a_member_that_stopped_polling_leaves_the_group_and_one_that_stops_leaves_at_once(redis_conn):
    queue = _queue(redis_conn, "q", [f"j{i}" for i in range(6)])
    redis_conn.hset(keys.group_key("g"), "gone", int(redis_conn.time()[0]) - 60)  # a killed worker's entry
    leaving = Poller(redis_conn, "leaving", group="g")
    leaving.stay_in_group()
    leaving.leave_group()
    worker = Poller(redis_conn, "w", group="g", member_ttl_s=20)
    assert len(worker.poll([queue], 10, "rq:job:", check_cancels=False).taken) == 6
    assert redis_conn.hkeys(keys.group_key("g")) == [b"w"]
    alone = Poller(redis_conn, "alone")  # no group: as many as it has room for
    assert len(alone.poll([_queue(redis_conn, "r", ["x", "y"])], 10, "rq:job:", check_cancels=False).taken) == 2


class _BusyOnce:
    """The connection, but its first RPUSH is answered as a server running a script answers (BUSY)."""

    def __init__(self, connection: redis.Redis) -> None:
        self._connection, self.refused = connection, False

    def __getattr__(self, name: str):
        return getattr(self._connection, name)

    def rpush(self, *args):
        if not self.refused:
            self.refused = True
            raise ServerBusy("BUSY Redis is busy running a script")
        return self._connection.rpush(*args)


def test_an_idle_wait_that_meets_busy_after_its_pop_takes_that_job_on_the_next_wait(redis_conn):
    """With several queues the idle wait pops (BLPOP), then parks the id on the intermediate list: a
    BUSY reply in between must not lose the job, which is on neither list then."""
    high, low = _queue(redis_conn, "high", []), _queue(redis_conn, "low", ["l1"])
    poller = Poller(redis_conn, "w")
    poller._connection = _BusyOnce(redis_conn)
    with pytest.raises(ServerBusy):
        poller.wait([high, low], "rq:job:", 1)
    assert redis_conn.llen(low[0]) == 0 and redis_conn.llen(low[1]) == 0  # held by the poller alone
    taken = poller.wait([high, low], "rq:job:", 1)
    assert taken is not None and (taken.queue_index, taken.raw_id) == (1, b"l1")
    assert redis_conn.lrange(low[1], 0, -1) == [b"l1"]
    assert poller.wait([high, low], "rq:job:", 1) is None  # nothing else: it was taken once


def test_an_id_popped_before_an_error_goes_back_to_its_queue_if_that_queue_is_held_by_the_next_wait(redis_conn):
    high, low = _queue(redis_conn, "high", []), _queue(redis_conn, "low", ["l1", "l2"])
    poller = Poller(redis_conn, "w")
    poller._connection = _BusyOnce(redis_conn)
    with pytest.raises(ServerBusy):
        poller.wait([high, low], "rq:job:", 1)
    assert poller.wait([high], "rq:job:", 0.1) is None  # the low queue is held now
    assert redis_conn.lrange(low[0], 0, -1) == [b"l1", b"l2"] and redis_conn.llen(low[1]) == 0
    taken = poller.wait([high, low], "rq:job:", 1)
    assert taken is not None and (taken.queue_index, taken.raw_id) == (1, b"l1")
