"""The Redis side of ending jobs: the bookkeeping thread's work on the ending records the batch loop
hands it.

Each hand-off becomes tasks on the bookkeeping thread (worker/bookkeeping.py), in order: the step's
stream deltas, the results (built here, each once, then their result keys, stream ends and done
nudges), then each job's end in RQ's terms (worker/rq_jobs.py). A job's result key is always
written before RQ marks it ended. While the gate is in force (worker/gate.py) the work goes a Redis
call's worth at a time and waits at the gate between them. Once a job is fully ended its record
goes back to the loop (`done`), which alone removes it from its table of running jobs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import redis
from rq import Queue
from rq.executions import Execution
from rq.job import Job

from schemas import GenerationResult, keys
from worker import retry_policy
from worker.bookkeeping import Bookkeeper
from worker.gate import RESULTS_PER_CALL, RQ_ENDS_PER_CALL, per_call
from worker.intake import Unreadable
from worker.metrics import WorkerMetrics
from worker.output import EndedJob, StreamDelta
from worker.redis_health import RedisHealth
from worker.rq_batch import Registries
from worker.publish import (Publication, WorkerStats, publish_results, publish_stream_deltas, refuse_unreadable,
                            restart_stream)
from worker.redis_health import REDIS_ERRORS
from worker.settings import WorkerSettings

log = logging.getLogger("mlxq.worker")


@dataclass(frozen=True)
class Ending:
    """One job's end, as the loop hands it over: nothing in it changes afterwards but the rq job,
    which only the bookkeeping thread touches from then on."""

    ended: Optional[EndedJob]  # None: not ended, re-queued to run alone after an engine failure
    job: Job
    queue: Queue
    execution: Execution
    streams: bool  # the job publishes a token stream, which its end event closes
    callbacks_allowed: bool  # its function and callbacks passed the allowlist: its callbacks may run
    entry: object  # the loop's own record of the job, handed back through `done`
    handed_at: float = 0.0  # time.monotonic() when the loop handed it over

    @property
    def job_id(self) -> str:
        return self.job.id

    @property
    def outcome(self) -> EndedJob:
        assert self.ended is not None, "a re-queued job has no outcome"
        return self.ended


class JobTally:
    """Jobs ended and tokens made since the worker started, and tokens in the last minute: published
    in the worker's stats hash (`jobs_finished`, `jobs_cancelled`, `jobs_failed_<type>`, `tokens`,
    `tokens_per_s_1m`, `updated_at`) for `mlxq stats`. A cancelled job is not a failure."""

    WINDOW_S = 60.0

    def __init__(self) -> None:
        self._counts: dict[str, int] = {"jobs_finished": 0, "tokens": 0}
        self._recent: deque[tuple[float, int]] = deque()  # (time.time(), completion tokens)

    def add(self, result: GenerationResult) -> None:
        if result.status == "cancelled":
            name = "jobs_cancelled"
        elif result.status == "failed" and result.error is not None:
            name = f"jobs_failed_{result.error.type}"
        else:
            name = "jobs_finished"
        self._counts[name] = self._counts.get(name, 0) + 1
        self._counts["tokens"] += result.usage.completion_tokens
        self._recent.append((time.time(), result.usage.completion_tokens))

    def counters(self) -> dict[str, float]:
        now = time.time()
        while self._recent and self._recent[0][0] < now - self.WINDOW_S:
            self._recent.popleft()
        return {**self._counts, "tokens_per_s_1m": sum(t for _, t in self._recent) / self.WINDOW_S,
                "updated_at": now}


class RQEnds(Protocol):
    """A job's end in RQ's terms (worker/rq_jobs.py RQJobs), called on the bookkeeping thread."""

    def finish_successes(self, endings: Sequence[Ending], pause: Callable[[], None]) -> None: ...

    def finish_failure(self, ending: Ending, result: GenerationResult) -> None: ...

    def requeue(self, ending: Ending, alone: bool) -> None: ...

    def record_again(self, endings: Sequence[Ending]) -> None: ...

    def forget(self, ending: Ending) -> None:
        """End this worker's part in a job whose result someone else wrote first: its execution
        goes, the job's hash and rq's registries stay as that first end left them."""
        ...


class JobEnding:
    def __init__(self, connection: redis.Redis, bookkeeper: Bookkeeper, rq: RQEnds, settings: WorkerSettings,
                 worker_name: str, metrics: Optional[WorkerMetrics] = None, health: Optional[RedisHealth] = None,
                 registries: Optional[Registries] = None) -> None:
        self._connection = connection
        self._health = health
        self._registries = registries
        self._metrics = metrics
        self._worker_name = worker_name
        self._bookkeeper = bookkeeper
        self._rq = rq
        self._settings = settings
        self.done: "queue.SimpleQueue[Ending]" = queue.SimpleQueue()
        self._tally = JobTally()  # the bookkeeping thread's
        # Jobs whose run this worker drops (bookkeeping thread only): their result key was there before
        # this worker's, or another worker took them while this one was cut off. Their first end stands,
        # in Redis and in rq, so this run ends without touching either.
        self._superseded: set[str] = set()
        # Running jobs whose stream key someone turned into another type (bookkeeping thread only):
        # said once in the log, not at every step.
        self._unwritable_streams: set[str] = set()
        # Whether an ending run stands, decided once under this lock by whichever thread comes first:
        # the loop, which took a copy of the job from a queue (then the run stands and the copy is
        # dropped), or this thread, which found the run's records gone (then the run is dropped and
        # the copy is the job's run). Marks stay until the loop forgets the run (`forget_marks`).
        self._marks_lock = threading.Lock()
        self._copy_taken: set[str] = set()
        self._run_dropped: set[str] = set()

    # --- the loop's side: each call queues tasks and returns at once ------------------------
    def hand_off(self, endings: list[Ending], deltas: Sequence[StreamDelta], stream_ttls: dict[str, Optional[int]],
                 stats: Optional[WorkerStats]) -> None:
        """This step's stream deltas and ended jobs: published, then ended in RQ."""
        if deltas:
            self._bookkeeper.submit(lambda: self._publish_deltas(list(deltas), stream_ttls))
        if not endings:
            return
        unpublished = list(endings)
        self._bookkeeper.submit(lambda: self._publish(unpublished, stats))
        finished = [e for e in endings if e.outcome.status == "finished"]
        if finished:
            self._bookkeeper.submit(lambda: self._end_finished(finished))
        for ending in endings:
            if ending.outcome.status != "finished":
                self._bookkeeper.submit(lambda ending=ending: self._end_failed(ending))

    def claim_copy(self, job_id: str) -> bool:
        """The loop took a copy of a job from a queue while the job's run here is ending: True if that
        run stands (its result will be written, its records again if they were gone; the copy is
        dropped), False if it was dropped already as taken by another worker (the copy runs instead:
        that worker was this one)."""
        with self._marks_lock:
            if job_id in self._run_dropped:
                return False
            self._copy_taken.add(job_id)
            return True

    def forget_marks(self, job_id: str) -> None:
        """The loop is done with the job's ending run."""
        with self._marks_lock:
            self._copy_taken.discard(job_id)
            self._run_dropped.discard(job_id)

    def requeue(self, ending: Ending, alone: bool = False) -> None:
        """A job that has not ended back to its queue, to run again: `alone` after it was in the engine
        when a step failed; else because the control plane asked (weights swapped, a pause)."""
        def requeue() -> None:
            def send_back() -> None:
                if ending.streams:
                    restart_stream(self._connection, ending.job_id, "the job went back to its queue to run again")
                self._rq.requeue(ending, alone)

            self._end_in_rq([ending], send_back)

        self._bookkeeper.submit(requeue)

    def refuse(self, refused: list[tuple[Unreadable, Queue]]) -> None:
        """Queue entries that cannot run: failed result keys, and out of their intermediate lists."""
        self._bookkeeper.submit(lambda: self.refuse_now(refused))

    def refuse_now(self, refused: list[tuple[Unreadable, Queue]]) -> None:
        """`refuse`, from the bookkeeping thread itself (its maintenance)."""
        refuse_unreadable(self._connection, refused, self._settings.served_alias, self._worker_name)

    # --- the bookkeeping thread's side ------------------------------------------------------
    def _publish_deltas(self, deltas: list[StreamDelta], stream_ttls: dict[str, Optional[int]]) -> None:
        for job_id, error in publish_stream_deltas(self._connection, deltas, stream_ttls).items():
            if job_id not in self._unwritable_streams:
                self._unwritable_streams.add(job_id)
                log.warning("job %s: its stream cannot be written (%s): its key was changed by someone else; "
                            "the job runs on to its result", job_id, error)

    def _publish(self, pending: list[Ending], stats: Optional[WorkerStats]) -> None:
        """Build the results (each once: EndedJob.result) and write their keys, RESULTS_PER_CALL a
        round trip while the gate is in force; the stats go with the first."""
        gate = self._bookkeeper.gate
        pending = self._drop_taken(pending)
        for chunk in per_call(pending, RESULTS_PER_CALL, gate):
            publications = []
            for ending in chunk:
                gate.wait()
                publications.append(self._publication(ending))
            gate.wait()
            if stats is not None:
                stats.counters.update(self._tally.counters())
            written_before = publish_results(self._connection, publications, stats=stats,
                                             durability=self._settings.result_durability)
            self._unwritable_streams.difference_update(ending.job_id for ending in chunk)
            stats = None
            for job_id in written_before:
                log.warning("job %s: another run of it wrote its result first (this worker was cut off while the "
                            "job was taken): this run is dropped, not ended in RQ", job_id)
            self._superseded |= written_before

    def _drop_taken(self, pending: list[Ending]) -> list[Ending]:
        """The endings still this worker's to write. A job that ran while Redis was away from this worker
        may have been taken meanwhile: its heartbeats lapsed, a live worker's sweep sent it back to its
        queue (or failed it) and its entry left the started registry, where heartbeats never put it back.
        Such a job is dropped unwritten (the other run's result stands); only those are checked. When
        the copy the sweep sent back was taken here (`claim_copy`), the run stands and is recorded again."""
        if self._health is None or self._registries is None:
            return pending
        suspect = [e for e in pending if self._health.lost_since(_started_at(e.job))]
        if not suspect:
            return pending
        with self._connection.pipeline(transaction=False) as pipe:
            for ending in suspect:
                pipe.zscore(self._registries.started(ending.job.origin).key, ending.execution.composite_key)
            scores = pipe.execute()
        gone = {e.job_id for e, score in zip(suspect, scores) if score is None}
        with self._marks_lock:
            ours = gone & self._copy_taken
            taken = gone - ours
            self._run_dropped |= taken
        if ours:  # the sweep's copy was taken here: nobody else runs the job
            self._rq.record_again([e for e in suspect if e.job_id in ours])
        for ending in suspect:
            if ending.job_id in taken:
                log.warning("job %s (%s) was taken by another worker while this one was cut off from Redis: "
                            "dropped without writing", ending.job_id, _function(ending.job))
            elif ending.job_id in ours:
                log.warning("job %s: its run's records were gone and this worker took the job from its queue again "
                            "meanwhile: the run stands, its records written again", ending.job_id)
        self._superseded |= taken
        return [e for e in pending if e.job_id not in taken]

    def _publication(self, ending: Ending) -> Publication:
        job, result = ending.job, ending.outcome.result()
        if result.status == "failed":
            retry_policy.apply(job, result.error.type if result.error else None, self._settings.max_retries,
                               self._settings.retry_backoff_s)
        retried = result.status == "failed" and job.should_retry  # that attempt ended, the job did not
        _log_unfinished(job, result, retried)
        if not retried:
            self._tally.add(result)
            if self._metrics is not None:
                self._metrics.ended(result, time.monotonic() - ending.handed_at)
        return Publication(result, keys.result_key_ttl(job.result_ttl), write_key=not retried,
                           ends_stream=ending.streams and not retried,
                           encoded=None if retried else ending.outcome.encoded())

    def _end_finished(self, pending: list[Ending]) -> None:
        """End the RQ jobs whose results finished, RQ_ENDS_PER_CALL a round trip while the gate is in
        force; a result that could not be built ends its job as failed."""
        gate = self._bookkeeper.gate
        for chunk in per_call(pending, RQ_ENDS_PER_CALL, gate):
            ours: list[Ending] = []
            for ending in chunk:
                if self._forgot(ending):
                    self.done.put(ending)
                else:
                    ours.append(ending)
            successes = [e for e in ours if e.outcome.result().status == "finished"]
            self._end_in_rq(successes, lambda: self._rq.finish_successes(successes, gate.wait))
            for ending in ours:
                if ending.outcome.result().status != "finished":
                    self._end_failed(ending, forgot=False)

    def _end_failed(self, ending: Ending, forgot: Optional[bool] = None) -> None:
        if forgot is None:
            forgot = self._forgot(ending)
        if forgot:
            self.done.put(ending)
            return
        self._end_in_rq([ending], lambda: self._rq.finish_failure(ending, ending.outcome.result()))

    def _forgot(self, ending: Ending) -> bool:
        """Whether the job's result was someone else's first (then only this run's execution goes)."""
        if ending.job_id not in self._superseded:
            return False
        self._superseded.discard(ending.job_id)
        self._rq.forget(ending)
        return True

    def _end_in_rq(self, endings: list[Ending], end: Callable[[], None]) -> None:
        """Run `end` (the jobs' writes in RQ's terms), then hand the jobs back to the loop. A lost
        Redis propagates (the bookkeeping thread retries the task); any other error, such as a job
        key a producer changed under a running job (WRONGTYPE), is logged and the jobs go back to
        the loop all the same: a batch's commands all run whatever one of them meets
        (CommandBatch), so a broken key costs only its own job's writes, and the loop never holds
        a job it can no longer end (a warm stop would wait for it forever)."""
        try:
            end()
        except REDIS_ERRORS:
            raise
        except Exception:
            log.exception("ending %s in RQ's terms failed; what could be written was",
                          ", ".join(e.job_id for e in endings))
        for ending in endings:
            self.done.put(ending)


def _log_unfinished(job: Job, result: GenerationResult, retried: bool) -> None:
    """Every failure and cancellation in the worker's log, with the job, its function and the reason
    (successes are rq's own "Successfully completed" lines)."""
    if result.status == "finished":
        return
    reason = f"{result.error.type}: {result.error.message}" if result.error else "cancel requested"
    if result.status == "cancelled":
        log.info("job %s (%s) cancelled after %d token(s): %s", job.id, _function(job), result.usage.completion_tokens,
                 reason)
    elif retried:
        log.warning("job %s (%s) failed, retried (%s left): %s", job.id, _function(job), job.retries_left, reason)
    else:
        log.warning("job %s (%s) failed: %s", job.id, _function(job), reason)


def _function(job: Job) -> str:
    """The job's function as rq reads it from its data, or `unreadable` (a job that failed for that reason)."""
    try:
        return str(job.func_name)
    except Exception:
        return "unreadable"


def _started_at(job: Job) -> float:
    return job.started_at.timestamp() if job.started_at is not None else 0.0
