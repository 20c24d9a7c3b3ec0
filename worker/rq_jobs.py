"""A job's start and end in RQ's terms, for a worker that runs many jobs at once.

RQ's own worker starts a job (`prepare_execution`, `prepare_job_execution`) and ends it
(`perform_job`'s success and failure paths) one at a time. `RQJobs` writes the same state for a
whole poll's jobs in one round trip at their start (on the loop's thread), and ends each job the way
`perform_job` would, through the worker's rq handlers, after its result key is written (on the
bookkeeping thread). worker/rq_batch.py holds the batched writes themselves.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from rq import Queue, Retry
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.timeouts import JobTimeoutException, TimerDeathPenalty
from rq.utils import now, utcformat
from rq.worker import WorkerStatus

from schemas import GenerationResult, keys
from schemas.command_batch import CommandBatch
from worker.allowlist import callback_names, refusal
from worker.intake import Unreadable, read_job
from worker.job_ending import Ending
from worker.loop_interfaces import InFlight, StartedJob
from worker.poll import Poller, TakenJob, WorkerQueues
from worker.rq_batch import Registries, Success, create_execution, delete_execution, end_successes, record_execution
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from rq import SimpleWorker

log = logging.getLogger("mlxq.worker")

SOLO_META = "mlxq_solo"  # set on a job re-queued after an engine failure: it then runs alone


def _wanted_version(job: Job) -> int:
    """The lowest weight version a job's request may run on (`min_weight_version`), 0 if none."""
    try:
        request = job.kwargs.get("request")
        wanted = request.get("min_weight_version") if isinstance(request, dict) else None
    except Exception:  # not readable as a request: admission fails it, whatever its version
        return 0
    return wanted if isinstance(wanted, int) and not isinstance(wanted, bool) else 0


class JobFailed(Exception):
    """Carries a failed GenerationResult's error into RQ's failure path (callbacks, exc_info)."""


class RQJobs:
    def __init__(self, worker: "SimpleWorker", poller: Poller, registries: Registries, settings: WorkerSettings
                 ) -> None:
        self._worker = worker
        self._poller = poller
        self._registries = registries
        self._settings = settings
        self.queues: Optional[WorkerQueues] = None  # the worker's, once its run starts

    # --- a job's start, on the loop's thread -------------------------------------------------
    def start_jobs(self, taken: list[TakenJob], weight_version: int
                   ) -> tuple[list[StartedJob], list[tuple[Unreadable, Queue]]]:
        """Read the jobs taken (worker/intake.py) and record the start of those that read, the RQ way
        (execution, started registry, status, heartbeats: what `prepare_execution` and
        `prepare_job_execution` write), all in one atomic round trip. A job that asks for newer weights
        than `weight_version` goes back to the head of its queue in the same call, and the worker then
        leaves that queue alone until its weights change. A Redis error means nothing was written: the
        same jobs can be started again."""
        started: list[tuple[Job, Queue, list[str]]] = []
        unreadable: list[tuple[Unreadable, Queue]] = []
        too_new: list[tuple[Job, int]] = []
        for item in taken:
            queue = self._worker.queues[item.queue_index]
            read = read_job(item.raw_id, item.fields, self._worker.connection, self._settings.max_job_bytes)
            if isinstance(read, Unreadable):
                unreadable.append((read, queue))
            elif _wanted_version(read) > weight_version:
                too_new.append((read, item.queue_index))
            else:
                assert isinstance(item.fields, dict)
                started.append((read, queue, callback_names(item.fields)))
        batch = CommandBatch(self._worker.connection)
        for job, index in reversed(too_new):  # back to the head of their queues, in their order
            batch.lrem(self._worker.queues[index].intermediate_queue.key, 1, job.id)
            batch.lpush(self._worker.queues[index].key, job.id)
        executions, cancel_replies = [], []
        if started:
            ttl = self._settings.heartbeat_ttl_s
            for job, queue, _ in started:
                executions.append(create_execution(job, ttl, batch, self._worker.name, self._registries))
                job.prepare_for_execution(self._worker.name, pipeline=batch)  # status, started_at, heartbeat
                batch.lrem(queue.intermediate_queue.key, 1, job.id)
                batch.delete(queue.intermediate_queue.get_first_seen_key(job.id))  # a sweep's mark: not stuck
                batch.persist(job.key)  # as Job.perform does: a job with ttl= must not expire mid-run
                batch.exists(keys.cancel_key(job.id))
                cancel_replies.append(len(batch) - 1)
            batch.sadd(self._poller.running_key, *(job.id for job, _, _ in started))
            self._worker.set_state(WorkerStatus.BUSY, pipeline=batch)
            self._worker.set_current_job_id(started[-1][0].id, pipeline=batch)
            self._worker.set_current_job_working_time(0, pipeline=batch)
            self._worker.heartbeat(ttl, pipeline=batch)
            batch.expire(self._poller.running_key, ttl)
        replies = batch.execute() if len(batch) else []
        assert replies is not None
        if too_new:
            self._poller.ended([job.id for job, _ in too_new])
            assert self.queues is not None
            self.queues.hold(index for _, index in too_new)
        return [self._started(job, queue, callbacks, execution, bool(replies[at]))
                for (job, queue, callbacks), execution, at in zip(started, executions, cancel_replies)], unreadable

    def drop_taken(self, taken: list[TakenJob], running: list[InFlight]) -> None:
        """Entries of jobs running here already, taken again: out of their intermediate lists. The
        `running` runs of those jobs (not ending yet) are recorded again: a sweep sends a job back to
        its queue once its run's records are gone (lost in a failover, or expired while this worker
        was cut off), and a run without them was later taken for another worker's and dropped
        unwritten, while the copy that would have run it again had been dropped here: the job was lost."""
        batch = CommandBatch(self._worker.connection)
        for item in taken:
            batch.lrem(self._worker.queues[item.queue_index].intermediate_queue.key, 1, item.raw_id)
        self._record_runs(batch, [(inflight.job, inflight.execution) for inflight in running])
        batch.execute()
        for item in taken:  # (after the writes: a reader of the log finds the run recorded again)
            log.warning("job %s came off a queue again while it runs here: that copy was dropped (a job runs once)",
                        item.job_id)

    def record_again(self, endings: Sequence[Ending]) -> None:
        """The records of ending runs whose records were gone, written again (the bookkeeping thread's
        side of `drop_taken`, for runs that ended while their copy was taken here)."""
        batch = CommandBatch(self._worker.connection)
        self._record_runs(batch, [(ending.job, ending.execution) for ending in endings])
        batch.execute()

    def _record_runs(self, batch: CommandBatch, runs: list[tuple[Job, Execution]]) -> None:
        ttl = self._settings.heartbeat_ttl_s
        for job, execution in runs:
            record_execution(job, execution, ttl, batch, self._registries)
            job.prepare_for_execution(self._worker.name, pipeline=batch)
        if runs:
            batch.sadd(self._poller.running_key, *(job.id for job, _ in runs))

    def _started(self, job: Job, queue: Queue, callbacks: list[str], execution: Execution, cancelled: bool
                 ) -> StartedJob:
        refused = refusal(job, callbacks, self._settings.callback_allowlist)
        inflight = InFlight(job, queue, execution, deadline=None)
        if refused is None:
            inflight.callbacks_allowed = True
            inflight.payload = job.kwargs["request"]
            inflight.solo = bool(job.meta.get(SOLO_META))
        timeout = job.timeout if job.timeout is not None else self._worker.queue_class.DEFAULT_TIMEOUT
        enqueued_at = job.enqueued_at.timestamp() if isinstance(job.enqueued_at, datetime) else None
        return StartedJob(inflight, enqueued_at, timeout, refused, cancelled)

    # --- a job's end (worker/job_ending.py RQEnds), on the bookkeeping thread --------------
    def finish_successes(self, endings: Sequence[Ending], pause: Callable[[], None]) -> None:
        """End finished RQ jobs the way `perform_job` would, after their result keys are written,
        all in one transaction where rq allows it. rq's return value is the result key's own JSON
        text, not a second encoding. Callbacks get a thread-safe timeout."""
        successes = []
        for ending in endings:
            pause()
            job = ending.job
            job.ended_at = now()
            return_value = ending.outcome.encoded()
            try:
                if job.success_callback:  # the callback gets the result as a dict
                    job.execute_success_callback(TimerDeathPenalty, json.loads(return_value))
            except Exception:
                self._worker.log.exception("Job %s: success callback failed", job.id)
            successes.append(Success(job, ending.execution, return_value))
        left = {id(s.job) for s in end_successes(self._worker, successes, self._registries, pause=pause)}
        for ending, success in zip(endings, successes):
            if id(success.job) in left:  # rq's own path: dependents to enqueue
                success.job._result = success.return_value
                with self._as_current(ending.execution):
                    self._worker.handle_job_success(job=success.job, queue=ending.queue,
                                            started_job_registry=ending.queue.started_job_registry)

    def finish_failure(self, ending: Ending, result: GenerationResult) -> None:
        """End a failed or cancelled RQ job the way `perform_job` would, after its result key is
        written; a refused job's callbacks never run. Callbacks get a thread-safe timeout."""
        job, queue = ending.job, ending.queue
        job.ended_at = now()
        job.failure_ttl = keys.failure_ttl(job.failure_ttl, job.result_ttl)  # not RQ's year
        with self._as_current(ending.execution):
            if result.status == "cancelled":
                if ending.callbacks_allowed:
                    with contextlib.suppress(Exception):
                        job.execute_stopped_callback(TimerDeathPenalty)
                self._end_cancelled(job, queue)
                return
            job._status = JobStatus.FAILED
            error = result.error
            exc: Exception = (
                JobTimeoutException(error.message) if error and error.type == "JobTimeoutException"
                else JobFailed(f"{error.type}: {error.message}" if error else "failed")
            )
            if ending.callbacks_allowed:
                with contextlib.suppress(Exception):
                    job.execute_failure_callback(TimerDeathPenalty, type(exc), exc, None)
            self._worker.handle_job_failure(job=job, queue=queue, exc_string=f"{type(exc).__name__}: {exc}",
                                    started_job_registry=queue.started_job_registry)

    def forget(self, ending: Ending) -> None:
        """This worker's run of a job another run has ended (or is running): only its own execution
        leaves the registries; the job's state is the other run's."""
        batch = CommandBatch(self._worker.connection)
        delete_execution(ending.job, ending.execution, batch, self._registries)
        batch.srem(self._poller.running_key, ending.job_id)
        batch.execute()

    def _end_cancelled(self, job: Job, queue: Queue) -> None:
        """What rq's failure path writes for a stopped job (status STOPPED, its execution gone), but
        recorded in the queue's canceled registry for as long as its result lives, not among the failed,
        and not counted in the worker's failed jobs: a cancellation is not a failure."""
        worker = self._worker
        with worker.connection.pipeline() as pipe:
            job.set_status(JobStatus.STOPPED, pipeline=pipe)
            pipe.hset(job.key, "ended_at", utcformat(job.ended_at))
            worker.cleanup_execution(job, pipeline=pipe)
            ttl = keys.result_key_ttl(job.result_ttl)
            queue.canceled_job_registry.add(job, ttl=ttl if ttl is not None else -1, pipeline=pipe)
            job.cleanup(ttl=ttl if ttl is not None else -1, pipeline=pipe, remove_from_queue=False)
            if job.started_at and job.ended_at:
                worker.increment_total_working_time(job.ended_at - job.started_at, pipe)
            pipe.execute()

    def requeue(self, ending: Ending, alone: bool) -> None:
        """Back to its queue without counting against its retries; `alone`: it runs alone next time."""
        job = ending.job
        job.meta[SOLO_META] = alone
        job.save_meta()
        self._worker.connection.srem(self._poller.running_key, job.id)
        job.ended_at = now()
        with self._as_current(ending.execution):
            self._worker.handle_job_retry(job=job, queue=ending.queue, retry=Retry(max=(job.number_of_retries or 0) + 1),
                                  started_job_registry=ending.queue.started_job_registry, execution=ending.execution)

    @contextlib.contextmanager
    def _as_current(self, execution: Execution) -> Iterator[None]:
        """rq's handlers read the job's execution from `self.execution`; only the bookkeeping thread
        calls them (maintenance included), one job at a time."""
        self._worker.execution = execution
        try:
            yield
        finally:
            self._worker.execution = None
