"""Jobs of dead workers: RQ notices them by their expired heartbeats in the started registry.

`sweep_abandoned` reads each expired job defensively (worker/intake.py), strips the callbacks the
allowlist refuses (rq's cleanup would import and call them), caps its retries (worker/retry_policy.py),
writes a failed result key for each one that will not be retried (the contract: a result key before
RQ marks the job ended), then lets RQ's own cleanup retry or fail them. A job hash that cannot be read
leaves the registry here with a failed result: rq's cleanup would trip on it. Busy workers run it
every MLXQ_SWEEP_INTERVAL_S; `mlxq info --cleanup` runs it too. One worker of the fleet sweeps at a
time (`sweep_lock`), and rq's registry maintenance runs under the same lock.

A dead worker's jobs that it took off their queues but never started have no heartbeat: they wait in
the queues' intermediate lists, where rq's cleanup would fail them without a result key.
`Housekeeping.clear_intermediate_lists` puts them back at the head of their queues first.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Optional

import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from schemas import ErrorInfo, GenerationResult, Timings, keys
from schemas.result import request_echo
from schemas.scripts import Script
from schemas.serializer import JSON_SERIALIZER
from worker import retry_policy
from worker.allowlist import allowed, callbacks
from worker.intake import Unreadable, fetch_job_fields, read_job
from worker.publish import Publication, publish_results
from worker.settings import WorkerSettings

log = logging.getLogger("mlxq.worker")

# A sweeper that dies or stalls (a frozen process) holding the sweep lock holds up the others' sweeps
# at most this long; a sweep takes milliseconds to a second or two.
SWEEP_LOCK_TTL_S = 10

# The first sweep looks this far back for jobs cancelled while queued, each later one from the one
# before less this, so a cancel made while no worker ran still gets its result key.
CANCELLED_SCAN_MARGIN_S = 3600


# Lua: the job ARGV[1], still queued (its hash KEYS[4]), out of the intermediate list KEYS[1] and back
# at the head of its queue KEYS[2], its first-seen mark KEYS[3] gone; 0 where a worker started it meanwhile.
RETURN_STRANDED_LUA = """
if redis.call('HGET', KEYS[4], 'status') ~= 'queued' then return 0 end
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3])
return 1
"""


class Housekeeping:
    """A worker's share of the fleet's upkeep, run on its bookkeeping thread: dead workers' jobs,
    result keys of jobs cancelled while queued, due retries back to their queues, and the entries of
    the intermediate lists that rq's own cleanup would trip on or fail."""

    def __init__(self, connection: redis.Redis, queues: list[Queue], settings: WorkerSettings,
                 refuse: Callable[[list[tuple[Unreadable, Queue]]], None]) -> None:
        self._connection, self._queues, self._settings, self._refuse = connection, queues, settings, refuse
        self._cancelled_since = time.time() - CANCELLED_SCAN_MARGIN_S

    def sweep(self, running: frozenset[str], then: Optional[Callable[[], None]] = None) -> bool:
        """Sweep (`running`: this worker's jobs, started or not), then run `then` (rq's registry
        maintenance), under the fleet's sweep lock; False (nothing done) while another worker holds
        it: that one sweeps now, and this one next time."""
        with sweep_lock(self._connection) as held:
            if not held:
                return False
            swept = sweep_abandoned(self._connection, self._queues, self._settings, skip=running)
            if swept:
                log.warning("recovered %d job(s) of dead workers: %s", len(swept), swept)
            since, self._cancelled_since = self._cancelled_since, time.time() - CANCELLED_SCAN_MARGIN_S
            finish_cancelled(self._connection, self._queues, since, self._settings.max_job_bytes)
            self.clear_intermediate_lists(running)
            if then is not None:
                then()
            return True

    def enqueue_due_retries(self) -> None:
        _, refused = retry_policy.enqueue_due_retries(self._connection, self._queues, self._settings.max_job_bytes)
        if refused:
            self._refuse(refused)

    def clear_intermediate_lists(self, running: frozenset[str]) -> None:
        """The entries of the queues' intermediate lists that rq's cleanup, which runs next, would trip
        on or fail without a result key. An unreadable job ends failed. A job taken off its queue and
        never started (its worker died between the two, or stopped with Redis away) goes back to the
        head of its queue once rq's rule calls it stuck: first seen there over a minute ago. The jobs
        in `running` (this worker's, started or not) are left alone."""
        limit = self._settings.max_job_bytes
        for queue in self._queues:
            refused, stranded = [], []
            for raw_id in self._connection.lrange(queue.intermediate_queue.key, 0, -1):
                job_id = raw_id.decode(errors="replace")
                if job_id in running:
                    continue
                fields = fetch_job_fields(self._connection, job_id, limit)
                read = None if fields is None else read_job(raw_id, fields, self._connection, limit)
                if isinstance(read, Unreadable):
                    refused.append((read, queue))
                elif read is not None and read.get_status(refresh=False) == JobStatus.QUEUED:
                    # set_first_seen is rq's own mark (true where it was not there), should_be_cleaned_up its rule
                    if not queue.intermediate_queue.set_first_seen(job_id) and \
                            queue.intermediate_queue.should_be_cleaned_up(job_id):
                        stranded.append(job_id)
            if refused:
                self._refuse(refused)
            for job_id in stranded:
                self._return_stranded(queue, job_id)

    def _return_stranded(self, queue: Queue, job_id: str) -> None:
        intermediate = queue.intermediate_queue
        returned = Script(self._connection, RETURN_STRANDED_LUA)(
            keys=[intermediate.key, queue.key, intermediate.get_first_seen_key(job_id), Job.key_for(job_id)],
            args=[job_id])
        if returned:
            log.warning("job %s was taken off queue %s and never started (its worker stopped in between): back at "
                        "the head of its queue", job_id, queue.name)


@contextmanager
def sweep_lock(connection: redis.Redis, wait_s: float = 0) -> Iterator[bool]:
    """Whether this caller holds the fleet's sweep lock for the block (waiting for it up to `wait_s`
    seconds). The sweep reads a job, then
    rq's cleanup writes the job's whole hash from that read and pushes it back on its queue: two
    workers sweeping at once each sent it back (it ran twice) and each decremented its retries, and
    one's stale hash overwrote the run another worker had started meanwhile."""
    lock = connection.lock(keys.SWEEP_LOCK_KEY, timeout=SWEEP_LOCK_TTL_S)
    held = lock.acquire(blocking=wait_s > 0, blocking_timeout=wait_s or None)
    try:
        yield bool(held)
    finally:
        if held:
            try:
                lock.release()
            except redis.exceptions.LockError:  # it expired meanwhile (and may be another's now)
                pass


def sweep_abandoned(connection: redis.Redis, queues: Iterable[Queue], settings: WorkerSettings,
                    skip: frozenset[str] = frozenset()) -> list[str]:
    """Retry or fail every job whose worker stopped heart-beating. Returns the ids handled. Run it
    holding `sweep_lock`."""
    handled: list[str] = []
    now = time.time()
    for queue in queues:
        registry = StartedJobRegistry(queue.name, connection=connection, serializer=JSON_SERIALIZER)
        expired = [job_id for job_id in registry.get_expired_job_ids(now) if job_id not in skip]
        if not expired:
            continue
        results = [result for result in (_prepare(connection, registry, job_id, settings) for job_id in expired)
                   if result is not None]
        for result, _ in results:
            assert result.error is not None
            log.warning("job %s failed: %s: %s", result.id, result.error.type, result.error.message)
        publish_results(connection, [Publication(r, keys.result_key_ttl(ttl)) for r, ttl in results])
        registry.cleanup(now)
        handled += expired
    return handled


def _prepare(connection: redis.Redis, registry: StartedJobRegistry, job_id: str, settings: WorkerSettings
             ) -> Optional[tuple[GenerationResult, Optional[int]]]:
    """Make one expired job safe for rq's cleanup; its failed result if it will not run again."""
    fields = fetch_job_fields(connection, job_id, settings.max_job_bytes)
    if fields is None:
        return None  # rq's cleanup drops the id
    if connection.exists(keys.result_key(job_id)):
        # Ended already (its worker wrote the result, then went away before ending it in RQ): running it
        # again would only make a result that is not kept. Out of the registry, ended as its result says.
        members = [m for m in connection.zrangebyscore(registry.key, 0, time.time())
                   if m.decode(errors="replace").partition(":")[0] == job_id]
        if members:
            connection.zrem(registry.key, *members)
        log.info("job %s of a dead worker has its result already: not run again", job_id)
        return None
    job = read_job(job_id.encode(), fields, connection, settings.max_job_bytes)
    if isinstance(job, Unreadable):
        connection.zrem(registry.key, job_id)
        log.warning("job %s of a dead worker cannot be read: %s", job_id, job.message)
        return _failed(job_id, job.payload, None, None, "InvalidJob", job.message), None
    assert isinstance(fields, dict)
    refused = [field for field, name in callbacks(fields).items() if not allowed(name, settings.callback_allowlist)]
    if refused:
        connection.hdel(job.key, *refused)
        log.warning("job %s: removed callbacks not on MLXQ_CALLBACK_ALLOWLIST before rq's cleanup: %s", job_id,
                    ", ".join(fields[f.encode()].decode(errors="replace") for f in refused))
    if job.retries_left:
        retry_policy.apply(job, "AbandonedJobError", settings.max_retries, settings.retry_backoff_s)
        capped: dict[str, Any] = {"retries_left": job.retries_left}
        if job.retry_intervals is not None:
            capped["retry_intervals"] = json.dumps(job.retry_intervals)
        connection.hset(job.key, mapping=capped)
    if job.should_retry:
        return None
    if job.failure_ttl is None:  # rq's cleanup would keep the failed job a year
        connection.hset(job.key, "failure_ttl", keys.failure_ttl(None, job.result_ttl))
    return abandoned_result(job), job.result_ttl


def finish_cancelled(connection: redis.Redis, queues: Iterable[Queue], since: float, max_job_bytes: int) -> list[str]:
    """Write the result keys of jobs cancelled while queued since `since` (Unix seconds) that have
    none: a producer under the documented ACL may not write result keys, so it only marks the job
    cancelled in RQ (its own client reads that as cancelled at once) and a worker writes the key."""
    finished: list[str] = []
    for queue in queues:
        job_ids = [raw.decode() for raw in connection.zrangebyscore(queue.canceled_job_registry.key, since, "+inf")]
        if not job_ids:
            continue
        with connection.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.exists(keys.result_key(job_id))
            have = pipe.execute()
        publications = []
        for job_id in (job_id for job_id, exists in zip(job_ids, have) if not exists):
            fields = fetch_job_fields(connection, job_id, max_job_bytes)
            job = None if fields is None else read_job(job_id.encode(), fields, connection, max_job_bytes)
            request = None if job is None or isinstance(job, Unreadable) else _request(job)
            result = cancelled_result(job_id, request, None if isinstance(job, Unreadable) else job)
            ttl = job.result_ttl if isinstance(job, Job) else None
            publications.append(Publication(result, keys.result_key_ttl(ttl)))
            finished.append(job_id)
        publish_results(connection, publications)
    return finished


def cancelled_result(job_id: str, request: Any, job: Optional[Job]) -> GenerationResult:
    echo = request_echo(request)
    enqueued = job.enqueued_at.timestamp() if job is not None and job.enqueued_at else None
    return GenerationResult(id=job_id, status="cancelled", timings=Timings(enqueued_at=enqueued,
                                                                            finished_at=time.time()), **echo)


def _request(job: Job) -> Any:
    try:
        return job.kwargs.get("request")
    except Exception:  # not JSON: nothing to echo
        return None


def abandoned_result(job: Job) -> GenerationResult:
    return _failed(job.id, _request(job), job.worker_name, job, "AbandonedJobError",
                   "the worker running this job stopped (crashed or was killed) and the job has no retries left")


def _failed(job_id: str, request: Any, worker_name: Optional[str], job: Optional[Job], error_type: str,
            message: str) -> GenerationResult:
    echo = request_echo(request)
    started = job.started_at.timestamp() if job is not None and job.started_at else None
    enqueued = job.enqueued_at.timestamp() if job is not None and job.enqueued_at else None
    return GenerationResult(id=job_id, custom_id=echo.get("custom_id"), model=echo.get("model"), status="failed",
                            worker=worker_name, timings=Timings(enqueued_at=enqueued, started_at=started,
                                                                finished_at=time.time()),
                            error=ErrorInfo(type=error_type, message=message))
