"""Jobs of dead workers: RQ notices them by their expired heartbeats in the started registry.
`sweep_abandoned` writes a failed result key for each one that will not be retried (the
contract: a result key before RQ marks the job ended), then lets RQ's own cleanup retry or
fail them. Busy workers run it every MLXQ_SWEEP_INTERVAL_S; `mlxq info --cleanup` runs it too.
"""

from __future__ import annotations

import time
from typing import Iterable

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.registry import StartedJobRegistry

from schemas import ErrorInfo, GenerationResult, Timings, keys
from schemas.result import request_echo
from schemas.serializer import JSON_SERIALIZER
from worker.publish import Publication, publish_results


def sweep_abandoned(connection: redis.Redis, queues: Iterable[Queue], skip: frozenset[str] = frozenset()) -> list[str]:
    """Retry or fail every job whose worker stopped heart-beating. Returns the ids handled."""
    handled: list[str] = []
    now = time.time()
    for queue in queues:
        registry = StartedJobRegistry(queue.name, connection=connection, serializer=JSON_SERIALIZER)
        expired = [job_id for job_id in registry.get_expired_job_ids(now) if job_id not in skip]
        if not expired:
            continue
        results = []
        for job_id in expired:
            try:
                job = Job.fetch(job_id, connection=connection, serializer=JSON_SERIALIZER)
            except NoSuchJobError:
                continue
            if not job.should_retry:
                results.append(Publication(abandoned_result(job), keys.result_key_ttl(job.result_ttl)))
        publish_results(connection, results)
        registry.cleanup(now)
        handled += expired
    return handled


def abandoned_result(job: Job) -> GenerationResult:
    try:
        request = job.kwargs.get("request")
    except Exception:  # not JSON: nothing to echo
        request = None
    echo = request_echo(request)
    started = job.started_at.timestamp() if job.started_at else None
    return GenerationResult(
        id=job.id,
        custom_id=echo.get("custom_id"),
        model=echo.get("model"),
        status="failed",
        worker=job.worker_name,
        timings=Timings(enqueued_at=job.enqueued_at.timestamp() if job.enqueued_at else None, started_at=started,
                        finished_at=time.time()),
        error=ErrorInfo(
            type="AbandonedJobError",
            message="the worker running this job stopped (crashed or was killed) and the job has no retries left",
        ),
    )
