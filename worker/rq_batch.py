"""rq's per-job writes at the start and end of a job, for many jobs in one round trip.

A batching worker starts and ends jobs by the hundred per step, and rq's helpers (one WATCH,
SMEMBERS and MULTI/EXEC per finished job, and new registry objects on every property access) are too
slow for that (docs/design-notes.md). The same writes, built from rq's public pieces, go here into
the caller's batch (a CommandBatch), with one registry object per queue.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rq.executions import Execution, ExecutionRegistry
from rq.job import Job, JobStatus
from rq.registry import FinishedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.utils import utcformat
from rq.worker import BaseWorker

from schemas.command_batch import CommandBatch, failed_writes


class Registries:
    """The started and finished registries of each queue, built once."""

    def __init__(self, worker: BaseWorker) -> None:
        self._worker = worker
        self._built: dict[tuple[type, str], Any] = {}

    def started(self, queue_name: str) -> StartedJobRegistry:
        return self._get(StartedJobRegistry, queue_name)

    def finished(self, queue_name: str) -> FinishedJobRegistry:
        return self._get(FinishedJobRegistry, queue_name)

    def _get(self, registry_class: type, queue_name: str) -> Any:
        key = (registry_class, queue_name)
        if key not in self._built:
            self._built[key] = registry_class(queue_name, connection=self._worker.connection,
                                              job_class=self._worker.job_class, serializer=self._worker.serializer)
        return self._built[key]


def new_execution_id() -> str:
    """32 random hex digits, like rq's `uuid4().hex`, without uuid4's os.urandom call, which lets go of
    the GIL (docs/design-notes.md). Execution ids must be unique, not secret; `random` is seeded from
    os.urandom."""
    return f"{random.getrandbits(128):032x}"


def create_execution(job: Job, ttl: int, batch: CommandBatch, worker_name: str, registries: Registries) -> Execution:
    """What `Execution.create` writes."""
    execution = Execution(id=new_execution_id(), job_id=job.id, connection=job.connection, worker_name=worker_name)
    record_execution(job, execution, ttl, batch, registries)
    return execution


def record_execution(job: Job, execution: Execution, ttl: int, batch: CommandBatch, registries: Registries) -> None:
    """An execution's records: its hash, the job's execution registry and the queue's started registry."""
    execution.save(ttl=ttl, pipeline=batch)
    ExecutionRegistry(job_id=job.id, connection=batch).add(execution=execution, ttl=ttl, pipeline=batch)
    registries.started(job.origin).add_execution(execution, pipeline=batch, ttl=ttl, xx=False)


def delete_execution(job: Job, execution: Execution, batch: CommandBatch, registries: Registries) -> None:
    """What `Execution.delete` writes."""
    batch.delete(execution.key)
    registries.started(job.origin).remove_execution(execution=execution, pipeline=batch)
    ExecutionRegistry(job_id=job.id, connection=batch).remove(execution=execution, pipeline=batch)


@dataclass
class Success:
    job: Job
    execution: Execution
    return_value: Any


def end_successes(worker: BaseWorker, successes: list[Success], registries: Registries,
                  pause: Callable[[], None] = lambda: None) -> list[Success]:
    """What `handle_job_success` writes, for every success in one atomic call, unless one of the
    jobs has dependents: those need rq's own path, which enqueues the dependents under its own
    WATCH, so then all are handed back for `handle_job_success` one at a time. (Jobs do not repeat:
    worker/intake.py drops rq's repeats.) `pause` is called before each job's writes are built and
    before the call."""
    if not successes:
        return []
    batch = CommandBatch(worker.connection)
    owners: list[Optional[str]] = []
    for success in successes:
        pause()
        _write_success(worker, success, batch, registries)
        owners += [success.job.id] * (len(batch) - len(owners))
    worker.set_current_job_id(None, pipeline=batch)
    pause()
    replies = batch.execute(unless_exists=[s.job.dependents_key for s in successes], raise_errors=False)
    if replies is None:
        return successes
    # A job whose hash a producer changed (WRONGTYPE) costs only its own records, named alone.
    failed = failed_writes(replies, owners)
    for success in successes:
        job = success.job
        if job.id in failed:
            worker.log.warning("Job %s: its RQ records were not all written (%s): a key of it was changed by "
                               "someone else; its result stands", job.id, failed[job.id])
        else:
            worker.log.info("Successfully completed job %s in %ss on worker %s", job.id,
                            job.ended_at - job.started_at, worker.name)
    return []


def _write_success(worker: BaseWorker, success: Success, batch: CommandBatch, registries: Registries) -> None:
    job, execution = success.job, success.execution
    worker.increment_successful_job_count(pipeline=batch)
    worker.increment_total_working_time(job.ended_at - job.started_at, batch)
    result_ttl = job.get_result_ttl(worker.default_result_ttl)
    if result_ttl != 0:
        job.set_status(JobStatus.FINISHED, pipeline=batch)
        batch.hset(job.key, "ended_at", utcformat(job.ended_at))  # what rq's job.save() changes here
        Result.create(job, Result.Type.SUCCESSFUL, result_ttl, return_value=success.return_value,
                      worker_name=worker.name, pipeline=batch, execution_id=execution.id,
                      execution_started_at=execution.created_at, execution_ended_at=job.ended_at)
        registries.finished(job.origin).add(job, result_ttl, batch)
    job.cleanup(result_ttl, pipeline=batch, remove_from_queue=False)
    delete_execution(job, execution, batch, registries)
