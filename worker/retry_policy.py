"""When a failed job runs again: never after a deterministic refusal, at most `max_retries` times
after anything else. A job that failed itself (a timeout, an error in its own sequence) waits an
exponentially growing pause first (rq's retry intervals, raised to mlxq's backoff); one whose worker
failed it (shut down cold, killed) goes back at once. Due retries go back to their queues
(`enqueue_due_retries`), since no rq scheduler process runs beside a batch worker.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Optional

import redis
from rq import Queue
from rq.job import Job, JobStatus

from schemas import keys
from schemas.scripts import Script
from worker.intake import Unreadable, fetch_job_fields, read_job

log = logging.getLogger("mlxq.worker")

# Errors that the same job would meet again on any worker: retrying them only loads the queue.
DETERMINISTIC_ERRORS = frozenset({
    "InvalidRequest", "InvalidJob", "FunctionNotAllowed", "CallbackNotAllowed", "DeserializationError",
})
# The worker's failures, not the job's: such a job goes back to its queue at once (still counted).
WORKER_FAILURES = frozenset({"WorkerShutdown", "AbandonedJobError"})
MAX_BACKOFF_S = 60
# A worker that claimed a due retry and went away before moving it holds it up this long.
RETRY_CLAIM_TTL_S = 30


def backoff_s(first_s: float, retries_used: int) -> int:
    """The pause before retry number `retries_used + 1`: first_s, doubling, at most MAX_BACKOFF_S,
    in whole seconds (rq's retry intervals are), at least one."""
    return max(1, min(MAX_BACKOFF_S, math.ceil(first_s * 2**retries_used)))


def apply(job: Job, error_type: Optional[str], max_retries: int, first_backoff_s: float) -> None:
    """Set the job's retries for rq's failure path (which reads `retries_left` and the interval)."""
    if error_type in DETERMINISTIC_ERRORS or not job.retries_left:
        job.retries_left = 0
        return
    job.retries_left = min(job.retries_left, max_retries)
    if error_type in WORKER_FAILURES:
        return
    asked = job.get_retry_interval() if job.retry_intervals else 0
    job.retry_intervals = [max(asked, backoff_s(first_backoff_s, max_retries - job.retries_left))]


def cap_stored_retries(connection: redis.Redis, job_ids: Iterable[str], max_retries: int) -> None:
    """Lower `retries_left` in job hashes that ask for more (before rq's own cleanup retries them)."""
    script = Script(
        connection,
        "for _, key in ipairs(KEYS) do "
        "local left = tonumber(redis.call('HGET', key, 'retries_left') or '') "
        "if left and left > tonumber(ARGV[1]) then redis.call('HSET', key, 'retries_left', ARGV[1]) end end")
    ids = [Job.key_for(job_id) for job_id in job_ids]
    if ids:
        script(keys=ids, args=[max_retries])


def enqueue_due_retries(connection: redis.Redis, queues: Iterable[Queue], max_job_bytes: int
                        ) -> tuple[list[str], list[tuple[Unreadable, Queue]]]:
    """Move retries whose pause is over from each queue's scheduled registry back to the queue: the
    ids moved, and the entries that cannot run (for a failed result key). A worker claims an id first
    (`keys.retry_claim_key`), so workers never enqueue one twice; the id leaves the registry only
    after its job is queued, so a Redis error in between loses no retry: the job is still scheduled
    (taken again once the claim lapses) or queued already (then its entry just goes)."""
    moved: list[str] = []
    unreadable: list[tuple[Unreadable, Queue]] = []
    for queue in queues:
        registry = queue.scheduled_job_registry
        for job_id in registry.get_jobs_to_schedule(int(time.time())):
            claim = keys.retry_claim_key(job_id)
            if not connection.set(claim, 1, nx=True, ex=RETRY_CLAIM_TTL_S):
                continue  # another worker is moving it
            fields = fetch_job_fields(connection, job_id, max_job_bytes)
            job = None if fields is None else read_job(job_id.encode(), fields, connection, max_job_bytes)
            if isinstance(job, Unreadable):
                log.warning("not retrying job %s: %s", job_id, job.message)
                unreadable.append((job, queue))
            elif job is not None and job.get_status(refresh=False) == JobStatus.SCHEDULED:
                queue.enqueue_job(job)
                moved.append(job_id)
            connection.zrem(registry.key, job_id)
            connection.delete(claim)
    return moved, unreadable
