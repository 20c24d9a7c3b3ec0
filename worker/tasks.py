"""The allowlisted job function.

Under `BatchWorker` this function is never called: the worker recognises its path and feeds the
request to the batch scheduler. Under a stock `rq worker -w rq.SimpleWorker -S
rq.serializers.JSONSerializer` it runs one request at a time, on a model loaded once per process.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from rq import get_current_job

from schemas import keys
from worker.publish import Publication, publish_results
from worker.settings import WorkerSettings

_scheduler: Optional[Any] = None


class GenerationFailed(Exception):
    pass


def _process_scheduler() -> Any:
    global _scheduler
    if _scheduler is None:
        from worker.loading import build_scheduler

        _scheduler = build_scheduler(WorkerSettings.from_env(max_num_seqs=1))
    return _scheduler


def generate(request: Any) -> dict[str, Any]:
    job = get_current_job()
    job_id = job.id if job is not None else f"local-{time.time_ns()}"
    if job is not None and job.connection.exists(keys.result_key(job_id)):
        # rq's own dequeue has no claim check: a job that ended once is not run again here either.
        raise GenerationFailed(f"JobAlreadyEnded: job {job_id} has a result already; a job runs once and its "
                               "result is never replaced")
    enqueued_at = job.enqueued_at.timestamp() if job is not None and job.enqueued_at else None
    scheduler = _process_scheduler()
    result = scheduler.admit(job_id, request, enqueued_at=enqueued_at)
    try:
        while result is None:
            ended = scheduler.step()
            result = ended[0].result() if ended else None
    finally:
        if result is None:  # interrupted (RQ's timeout, a signal): free the engine for the next job
            scheduler.cancel(job_id)
    if job is not None:
        publish_results(job.connection, [Publication(result, keys.result_key_ttl(job.result_ttl))])
    if result.status != "finished":
        error = result.error
        raise GenerationFailed(f"{error.type}: {error.message}" if error else result.status)
    return result.model_dump(mode="json")
