"""Due retries back on their queues (worker/retry_policy.py enqueue_due_retries), against a real
redis-server: a Redis error at any of the move's calls loses no retry and queues none twice; an entry
that cannot run comes back for its failed result key instead of vanishing."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from rq import Queue, Retry
from rq.job import Job, JobStatus

from schemas import keys
from schemas.redis_busy import ServerBusy
from schemas.serializer import JSON_SERIALIZER
from worker.intake import Unreadable
from worker.retry_policy import enqueue_due_retries

MAX_JOB_BYTES = 1 << 20


class BusyAtCall(redis.Redis):
    """A client whose `busy_at`-th call (a command, or a pipeline's execute) is answered BUSY, unrun,
    as when a producer's script holds the server (schemas/redis_busy.py)."""

    def __init__(self, url: str, busy_at: int) -> None:
        super().__init__(connection_pool=redis.ConnectionPool.from_url(url))
        self.calls, self.busy_at = 0, busy_at

    def _count(self) -> None:
        self.calls += 1
        if self.calls == self.busy_at:
            raise ServerBusy("BUSY Redis is busy running a script")

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self._count()
        return super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        def counted(raise_on_error: bool = True) -> Any:
            self._count()
            return execute(raise_on_error)

        pipe.execute = counted  # type: ignore[method-assign]
        return pipe


def _due_retry(conn: redis.Redis) -> Job:
    """A job that failed and waits in its queue's scheduled registry, due a second ago."""
    queue = Queue("retries", connection=conn, serializer=JSON_SERIALIZER)
    job = queue.enqueue(keys.JOB_FUNCTION, request={"prompt": "x", "max_tokens": 2}, retry=Retry(max=2, interval=5))
    conn.lrem(queue.key, 0, job.id)  # taken, run, failed:
    queue.schedule_job(job, datetime.now(timezone.utc) - timedelta(seconds=1))
    return job


def test_a_redis_error_at_any_call_of_a_retrys_move_loses_it_not_and_queues_it_once(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    busy_at = 1
    while True:
        conn.flushall()
        job = _due_retry(conn)
        queue = Queue("retries", connection=conn, serializer=JSON_SERIALIZER)
        flaky = BusyAtCall(redis_url, busy_at)
        try:
            enqueue_due_retries(flaky, [Queue("retries", connection=flaky, serializer=JSON_SERIALIZER)], MAX_JOB_BYTES)
        except redis.ConnectionError:
            pass
        conn.delete(keys.retry_claim_key(job.id))  # a claim left by the failed pass lapses (RETRY_CLAIM_TTL_S)
        moved, unreadable = enqueue_due_retries(conn, [queue], MAX_JOB_BYTES)
        where = f"BUSY at call {busy_at}"
        assert conn.lrange(queue.key, 0, -1) == [job.id.encode()], where
        assert queue.scheduled_job_registry.get_job_ids() == [] and unreadable == [], where
        assert Job.fetch(job.id, connection=conn, serializer=JSON_SERIALIZER).get_status() == JobStatus.QUEUED, where
        assert not conn.exists(keys.retry_claim_key(job.id)), where
        if flaky.calls < busy_at:  # the pass made fewer calls: every one of them has failed once
            assert moved == [] and busy_at > 3
            break
        busy_at += 1


def test_a_retry_another_worker_is_moving_is_left_to_it(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    job = _due_retry(conn)
    queue = Queue("retries", connection=conn, serializer=JSON_SERIALIZER)
    conn.set(keys.retry_claim_key(job.id), 1)
    assert enqueue_due_retries(conn, [queue], MAX_JOB_BYTES) == ([], [])
    assert queue.scheduled_job_registry.get_job_ids() == [job.id] and conn.llen(queue.key) == 0


@pytest.mark.parametrize("broken", [{"timeout": "abc"}, {"created_at": "garbage"}])
def test_a_due_entry_that_cannot_run_comes_back_to_end_failed(redis_url: str, broken: dict[str, Any]) -> None:
    conn = redis.Redis.from_url(redis_url)
    job = _due_retry(conn)
    conn.hset(job.key, mapping=broken)
    queue = Queue("retries", connection=conn, serializer=JSON_SERIALIZER)
    moved, unreadable = enqueue_due_retries(conn, [queue], MAX_JOB_BYTES)
    assert moved == [] and [(bad.job_id, q.name) for bad, q in unreadable] == [(job.id, "retries")]
    assert isinstance(unreadable[0][0], Unreadable) and unreadable[0][0].message
    assert queue.scheduled_job_registry.get_job_ids() == [] and conn.llen(queue.key) == 0
