"""BatchWorker: RQ lifecycle around a continuous-batching scheduler.

An RQ `SimpleWorker` (no fork: the model stays loaded, and fork after MLX starts is unsafe on
macOS) whose loop keeps many jobs running at once. It takes every waiting job while it has
room, starts each the RQ way, steps the scheduler, and ends each job the RQ way after its result
key is written. It knows nothing of MLX; the scheduler knows nothing of Redis.

Ending jobs (result keys, streams, RQ's bookkeeping) happens on the bookkeeping thread, so a
decode step never waits for Redis; if Redis goes away mid-batch, decoding goes on and results
are written once it answers again. RQ's per-job helpers read the single `self.execution`: here
it is per thread, and `_as_current` sets it around each call.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from types import FrameType
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import redis
from rq import Queue, Retry, SimpleWorker
from rq.command import parse_payload
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.timeouts import JobTimeoutException, TimerDeathPenalty
from rq.utils import now, utcformat
from rq.worker import WorkerStatus
from rq.worker.base import DequeueStrategy

from schemas import GenerationResult, keys
from schemas.command_batch import CommandBatch
from schemas.serializer import JSON_SERIALIZER
from worker.bookkeeping import Bookkeeper
from worker import retry_policy
from worker.allowlist import ALLOWED_FUNCTIONS, callback_names, refusal
from worker.intake import Unreadable, fetch_job_fields, read_job
from worker.liveness import Liveness
from worker.loading import ModelLoadError
from worker.loop_clock import LoopClock, StepRhythm
from worker.poll import Poller, TakenJob
from worker.presence import PresencePublisher
from worker.publish import Publication, WorkerStats, publish_results, publish_stream_deltas
from worker.recovery import finish_cancelled, sweep_abandoned
from worker.redis_health import RedisHealth
from worker.rq_batch import Registries, Success, create_execution, end_successes
from worker.scheduler import EndedJob
from worker.settings import WorkerSettings

log = logging.getLogger("mlxq.worker")

SOLO_META = "mlxq_solo"  # set on a job re-queued after an engine failure: it then runs alone
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
GIL_SWITCH_INTERVAL_S = 0.0005
# While sequences decode, a loop turn starts at most this many jobs: each costs the loop ~0.3 ms of
# Python (rq's job objects, the request's validation), and 256 at once held the running sequences'
# next token back by 60-100 ms. An idle worker still takes all it has room for.
ADMIT_PER_TURN_WHILE_DECODING = 64
IDLE_WAIT_ROUND_S = 1  # an idle worker's blocking dequeue returns this often to see a stop request
# The first sweep looks this far back for jobs cancelled while queued, each later one from the one
# before less this, so a cancel made while no worker ran still gets its result key.
CANCELLED_SCAN_MARGIN_S = 3600
RETRY_CHECK_INTERVAL_S = 1  # how often a worker moves retries whose pause is over back to their queues
# A full worker has no job to take, so its round trip per turn would only look for cancel keys:
# it does that this often instead (at 256 in flight on an H200 the poll was ~4% of the loop).
CANCEL_CHECK_INTERVAL_S = 0.05
# Bookkeeping waits while the loop is between two steps (worker/bookkeeping.py, LoopGate) only
# while steps are long against the loop's turns between them (at least MIN_GATED_STEP_S, and
# GATED_STEP_TO_TURN times the shortest recent turn) and spent mostly off the loop's CPU (see
# StepRhythm). With near-free steps (the zero-cost fake engine) the loop is mostly turns, and
# holding bookkeeping off them starved it: on an H200 host one worker sustained 1,993-2,222 jobs/s
# against 2,950-2,984 when any step of 2 ms or more closed the gate.
MIN_GATED_STEP_S = 0.002
GATED_STEP_TO_TURN = 4
# Jobs ended per Redis call while the gate is in force. Redis runs one call at a time, so the
# loop's poll can wait behind a bookkeeping script: 256 rq endings in one script ran 7-8 ms on the
# 2-core CPU (~1 ms per 32), 256 result keys ~1.7 ms (~0.9 ms per 128). Otherwise one call takes
# all: fewer round trips keep up bookkeeping's throughput when the loop is busy with its turns.
RQ_ENDS_PER_CALL = 32
RESULTS_PER_CALL = 128


class JobFailed(Exception):
    """Carries a failed GenerationResult's error into RQ's failure path (callbacks, exc_info)."""


@dataclass
class InFlight:
    job: Job
    queue: Queue
    execution: Execution
    deadline: Optional[float]  # monotonic; None = no timeout
    payload: Any = None
    solo: bool = False
    ending: bool = False  # its result was handed to the bookkeeping thread
    callbacks_allowed: bool = False  # its job function and callbacks passed the allowlist

    @property
    def streams(self) -> bool:
        return isinstance(self.payload, dict) and self.payload.get("stream") is True


class BatchWorker(SimpleWorker):
    allowed_functions = ALLOWED_FUNCTIONS

    def __init__(
        self,
        queues: Any = None,
        *args: Any,
        settings: Optional[WorkerSettings] = None,
        scheduler_factory: Optional[Callable[[WorkerSettings, str], Any]] = None,
        **kwargs: Any,
    ) -> None:
        kwargs["serializer"] = JSON_SERIALIZER  # never pickle, whatever the command line said
        self.settings = settings or WorkerSettings.from_env()
        if queues is None:
            queues = self.settings.default_queues()
        kwargs.setdefault("maintenance_interval", int(self.settings.sweep_interval_s))
        self._thread_state = threading.local()
        super().__init__(queues, *args, **kwargs)
        self._scheduler_factory = scheduler_factory
        self.scheduler_: Any = None  # rq's BaseWorker already uses `self.scheduler`
        self._inflight: dict[str, InFlight] = {}
        self._earliest_deadline = math.inf  # no running job's deadline is earlier
        self._bookkeeper = Bookkeeper()
        self._registries = Registries(self)
        self._stop_job_ids: set[str] = set()
        self._stop_job_lock = threading.Lock()
        self._health = RedisHealth(self.connection)
        self._last_sweep = time.monotonic()
        self._next_cancel_check = 0.0
        self._next_broken_queue_warning = 0.0
        self._next_retry_check = 0.0
        self._cancelled_since = time.time() - CANCELLED_SCAN_MARGIN_S
        self._rhythm = StepRhythm(MIN_GATED_STEP_S, GATED_STEP_TO_TURN)
        self._poller = Poller(self.connection, self.name, self.settings.group, self.settings.heartbeat_ttl_s,
                              self.settings.max_job_bytes)
        self._liveness = Liveness(self.settings.heartbeat_interval_s, self.settings.step_timeout_s, self._beat)
        self._clock = LoopClock()
        self._presence: Optional[PresencePublisher] = None
        self._loop_started = False  # until then a warm stop may interrupt (model loading), as in rq
        self._stop_recorded = False

    # --- RQ hooks -------------------------------------------------------------------------
    @property  # type: ignore[override]
    def execution(self) -> Optional[Execution]:
        return getattr(self._thread_state, "execution", None)

    @execution.setter
    def execution(self, value: Optional[Execution]) -> None:
        self._thread_state.execution = value

    @property
    def bookkeeping_idle(self) -> bool:
        """Whether every ending handed to the bookkeeping thread has been written."""
        return self._bookkeeper.idle

    @property
    def dequeue_timeout(self) -> int:
        # rq sets the connection's socket timeout to this + 10 s (the idle wait uses shorter rounds).
        return max(1, int(self.settings.sweep_interval_s))

    def get_heartbeat_ttl(self, job: Job) -> int:
        return self.settings.heartbeat_ttl_s

    def request_stop(self, signum: int, frame: Optional[FrameType]) -> None:
        """First SIGTERM/SIGINT: warm shutdown. rq raises StopRequested from this signal handler when
        the worker is not busy, wherever the main thread happens to be: inside a `try/except
        Exception` the stop was lost (the worker never exited), and between a Redis command and
        its reply the reply was left on a pooled connection for its next user (rq's
        `register_death` then failed). Once the loop runs, the handler only sets the flag the loop
        checks every turn; idle, the loop waits for jobs in rounds of IDLE_WAIT_ROUND_S."""
        if not self._loop_started:
            super().request_stop(signum, frame)
            return
        self._shutdown_requested_date = now()
        signal.signal(signal.SIGINT, self.request_force_stop)
        signal.signal(signal.SIGTERM, self.request_force_stop)
        self.handle_warm_shutdown_request()
        if self.scheduler:
            self.stop_scheduler()
        self._stop_requested = True

    def handle_payload(self, message: Any) -> None:
        """RQ's stop-job command only knows one current job: flag any of ours for the loop."""
        payload = parse_payload(message)
        if payload.get("command") == "stop-job" and payload.get("job_id"):
            with self._stop_job_lock:
                self._stop_job_ids.add(payload["job_id"])
            return
        super().handle_payload(message)

    def clean_registries(self) -> None:
        """rq's maintenance, made safe: rq's own registry and intermediate-list cleanups read every
        job hash they meet and would raise on one a producer wrote by hand, so the sweep and
        `_clear_intermediate_lists` take those out first, and nothing rq raises stops the worker."""
        self._sweep()
        self._clear_intermediate_lists()
        try:
            super().clean_registries()
        except Exception:
            self.log.exception("Worker %s: rq's registry cleanup failed; the next pass tries again", self.name)

    def _clear_intermediate_lists(self) -> None:
        for queue in self.queues:
            refused = []
            for raw_id in self.connection.lrange(queue.intermediate_queue.key, 0, -1):
                job_id = raw_id.decode(errors="replace")
                if job_id in self._inflight:
                    continue
                fields = fetch_job_fields(self.connection, job_id, self.settings.max_job_bytes)
                read = None if fields is None else read_job(raw_id, fields, self.connection, self.settings.max_job_bytes)
                if isinstance(read, Unreadable):
                    refused.append((read, queue))
            if refused:
                self._refuse_unreadable(refused)

    # --- the loop -------------------------------------------------------------------------
    def work(  # type: ignore[override]
        self,
        burst: bool = False,
        logging_level: Optional[str] = None,
        date_format: str = "%H:%M:%S",
        log_format: str = "%(asctime)s %(message)s",
        max_jobs: Optional[int] = None,
        max_idle_time: Optional[int] = None,
        with_scheduler: bool = False,
        dequeue_strategy: DequeueStrategy = DequeueStrategy.DEFAULT,
    ) -> bool:
        self.bootstrap(logging_level, date_format, log_format)
        self._dequeue_strategy = dequeue_strategy
        if with_scheduler:
            self._start_scheduler(burst, logging_level, date_format, log_format)
        self._install_signal_handlers()
        # The bookkeeping thread's Python work (hundreds of job endings per step) would otherwise
        # hold the GIL for 5 ms slices while the decode loop waits to hand out the next step.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        taken = 0
        try:
            self.scheduler_ = self._build_scheduler()
            # What is alive now (the model, the libraries) stays alive: keep it out of the cyclic
            # collector, whose full passes over it stalled steps by tens of ms.
            gc.collect()
            gc.freeze()
            self._clock = LoopClock()  # the loop's time, from here: not the model's loading
            self._presence = PresencePublisher(self.connection, self.name, self.settings, self.queue_names(),
                                               kind="fake" if self.settings.engine == "fake" else "text")
            self._redis_call(self._refresh_presence)
            self._liveness.start()
            self._bookkeeper.start()
            self._loop_started = True
            while True:
                self._record_stop_request()
                if not self._inflight:
                    self._bookkeeper.release()  # no step to come: nothing to keep out of the way of
                    self.check_for_suspension(burst)
                    if self.should_run_maintenance_tasks:
                        self.run_maintenance_tasks()
                    if self._stop_requested or (max_jobs is not None and taken >= max_jobs):
                        break
                    if burst:
                        if not self._poll(1):
                            break
                    else:
                        waited_for = self._wait_for_job(max_idle_time)
                        if waited_for is None:
                            break
                        self._take([waited_for])
                    taken += 1
                taken += self._cycle(None if max_jobs is None else max_jobs - taken)
        except StopRequested:
            pass
        except SystemExit:
            self._abandon_inflight("worker received a cold shutdown")
            raise
        except ModelLoadError as exc:
            self.log.error("Worker %s: %s", self.name, exc)
            raise
        except Exception:
            self.log.exception("Worker %s: unhandled error in the batch loop", self.name)
            self._abandon_inflight("worker loop crashed")
            raise
        finally:
            self._bookkeeper.stop()
            self._redis_call(self._poller.remove_ended)
            self._redis_call(self._poller.leave_group)
            self._liveness.stop()
            if self._presence is not None:
                self._redis_call(self._presence.withdraw)
            self._record_stop_request()
            self.teardown()
        return taken > 0

    def _record_stop_request(self) -> None:
        """Write the worker's `shutdown_requested_date` (what rq's handler writes for a busy worker),
        once, from the loop: a Redis call inside the signal handler could interrupt another."""
        if self._stop_requested and not self._stop_recorded and self._shutdown_requested_date is not None:
            self._stop_recorded = True
            self._redis_call(self.set_shutdown_requested_date)

    def _wait_for_job(self, max_idle_time: Optional[int]) -> Optional[TakenJob]:
        """Block for one job, keeping the worker's heartbeat and maintenance going as rq's own idle
        wait does, in rounds short enough to see a stop request; None once stopped or after
        `max_idle_time` seconds without a job. Unlike rq's dequeue it reads nothing a producer
        wrote: the job goes through worker/intake.py like every other."""
        self.set_state(WorkerStatus.IDLE)
        self.procline("Listening on " + ",".join(self.queue_names()))
        waited = 0
        while not self._stop_requested:
            round_s = IDLE_WAIT_ROUND_S if max_idle_time is None else min(IDLE_WAIT_ROUND_S, max_idle_time - waited)
            if round_s <= 0:
                return None
            try:
                self.heartbeat()
                if self.should_run_maintenance_tasks:
                    self.run_maintenance_tasks()
                self._poller.stay_in_group()
                self._upkeep()
                taken = self._poller.wait(self._queue_pairs(), self.job_class.key_for(""), round_s)
            except REDIS_ERRORS as exc:
                self._health.lost(exc)
                self._health.try_reconnect(wait=True)
                continue
            except redis.ResponseError:  # a queue key that is not a list: the poll script skips it
                poll = self._poller.poll(self._queue_pairs(), 1, self.job_class.key_for(""), check_cancels=False)
                self._warn_broken_queues([self._ordered_queues[i].key for i in poll.broken_queues])
                taken = poll.taken[0] if poll.taken else None
                if taken is None:
                    time.sleep(round_s)
            if taken is not None:
                return taken
            waited += round_s
        return None

    def _queue_pairs(self) -> list[tuple[str, str]]:
        return [(queue.key, queue.intermediate_queue.key) for queue in self._ordered_queues]

    def _cycle(self, jobs_left: Optional[int]) -> int:
        """One turn of the busy loop: one round trip that takes jobs and finds cancellations,
        then one engine step. Returns jobs taken."""
        clock = self._clock
        clock.lap("between")  # blocking dequeues and RQ maintenance, when nothing was in flight
        taken = 0
        if not self._health.up and self._health.try_reconnect(wait=not len(self.scheduler_)):
            self._liveness.beat_now()  # before any sweep can take our jobs for abandoned
        if self._health.up:
            room = 0 if self._stop_requested else self.scheduler_.free_slots
            if self.scheduler_.decoding:
                room = min(room, ADMIT_PER_TURN_WHILE_DECODING)
            room = room if jobs_left is None else min(room, jobs_left)
            taken = self._redis_call(self._poll, room) or 0
        clock.lap("poll")
        if not len(self.scheduler_) and not taken:
            self._bookkeeper.wait_idle(timeout=0.05)  # only endings left: let them land, don't spin
            clock.lap("idle")
        self._step()
        if self._health.up:
            self._upkeep()
        clock.lap("upkeep")
        return taken

    def _upkeep(self) -> None:
        """The timers: due retries back to their queues (each second), the dead-worker sweep."""
        clock = time.monotonic()
        if clock >= self._next_retry_check:
            self._next_retry_check = clock + RETRY_CHECK_INTERVAL_S
            self._redis_call(retry_policy.enqueue_due_retries, self.connection, self.queues,
                             self.settings.max_job_bytes)
        if clock - self._last_sweep > self.settings.sweep_interval_s:
            self._redis_call(self._sweep)

    def _redis_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except REDIS_ERRORS as exc:
            self._health.lost(exc)
            return None

    def _build_scheduler(self) -> Any:
        if self._scheduler_factory is not None:
            return self._scheduler_factory(self.settings, self.name)
        from worker.loading import build_scheduler

        return build_scheduler(self.settings, self.name)

    def _poll(self, room: int) -> int:
        """Take up to `room` waiting jobs without blocking and start them; end the running jobs
        that were cancelled or ran out of time. Returns how many jobs were taken."""
        clock = time.monotonic()
        check = bool(self._inflight) and (room > 0 or clock >= self._next_cancel_check)
        if room <= 0 and not check:
            return 0
        if check:
            self._next_cancel_check = clock + CANCEL_CHECK_INTERVAL_S
        poll = self._poller.poll(self._queue_pairs(), room, self.job_class.key_for(""), check_cancels=check)
        if poll.broken_queues:
            self._warn_broken_queues([self._ordered_queues[i].key for i in poll.broken_queues])
        self._take(poll.taken)
        if check:
            self._enforce_cancellations_and_deadlines(poll.cancelled)
        return len(poll.taken)

    def _take(self, taken: list[TakenJob]) -> None:
        """Start the jobs taken from the queues; those that cannot be read end at once."""
        queues = self._ordered_queues
        dequeued, unreadable = [], []
        for item in taken:
            read = read_job(item.raw_id, item.fields, self.connection, self.settings.max_job_bytes)
            if isinstance(read, Unreadable):
                unreadable.append((read, queues[item.queue_index]))
            else:
                assert isinstance(item.fields, dict)
                dequeued.append((read, queues[item.queue_index], callback_names(item.fields)))
        if dequeued:
            self._start_many(dequeued)
        if unreadable:
            self._refuse_unreadable(unreadable)

    def _refuse_unreadable(self, refused: list[tuple[Unreadable, Queue]]) -> None:
        """Jobs that cannot run as written leave the queue's intermediate list (where rq's own
        maintenance would trip on them); each identifiable one ends failed, with a result key that
        names the broken field. Its hash, if any, is marked failed and kept only as long as that key."""
        batch = CommandBatch(self.connection)
        publications = []
        for bad, queue in refused:
            batch.lrem(queue.intermediate_queue.key, 1, bad.raw_id)
            if bad.job_id is None:
                self.log.warning("Worker %s: removed an unreadable entry %r from %s: %s", self.name,
                                 bad.raw_id[:64], queue.key, bad.message)
                continue
            self.log.warning("Worker %s: job %s cannot run: %s", self.name, bad.job_id, bad.message)
            result = self.scheduler_.failed_result(bad.job_id, bad.payload, "InvalidJob", bad.message,
                                                   started_at=time.time())
            ttl = keys.result_key_ttl(None)
            publications.append(Publication(result, ttl))
            if bad.is_hash:
                job_key = self.job_class.key_for(bad.job_id)
                batch.hset(job_key, mapping={"status": JobStatus.FAILED.value, "ended_at": utcformat(now())})
                batch.expire(job_key, ttl or keys.DEFAULT_RESULT_TTL)
        self._poller.ended(bad.job_id for bad, _ in refused if bad.job_id is not None)
        batch.execute()
        publish_results(self.connection, publications)

    def _warn_broken_queues(self, queue_keys: list[str]) -> None:
        now_s = time.monotonic()
        if now_s >= self._next_broken_queue_warning:
            self._next_broken_queue_warning = now_s + 60
            self.log.error("Worker %s: skipping %s: not a Redis list (a queue must be one)", self.name,
                           ", ".join(queue_keys))

    def _step(self) -> None:
        if not len(self.scheduler_):
            return
        self._bookkeeper.step_started(self._rhythm.step_started())
        try:
            with self._liveness.step():
                ended = self.scheduler_.step()
        except Exception as exc:
            self.log.exception("Worker %s: engine step failed", self.name)
            self._recover_from_engine_failure(exc)
            return
        if self._rhythm.step_ended():
            self._bookkeeper.step_ended()
        self._clock.lap("step")
        self._end_many(ended, self.scheduler_.take_stream_deltas())
        self._clock.lap("hand_off")

    def _sweep(self) -> None:
        self._last_sweep = time.monotonic()
        swept = sweep_abandoned(self.connection, self.queues, self.settings, skip=frozenset(list(self._inflight)))
        if swept:
            self.log.warning("Worker %s: recovered %d job(s) of dead workers: %s", self.name, len(swept), swept)
        # Jobs cancelled since the last sweep (with a margin for clocks): their result keys.
        since, self._cancelled_since = self._cancelled_since, time.time() - CANCELLED_SCAN_MARGIN_S
        finish_cancelled(self.connection, self.queues, since, self.settings.max_job_bytes)

    # --- job start ------------------------------------------------------------------------
    def _start_many(self, jobs: list[tuple[Job, Queue, list[str]]]) -> None:
        """Start jobs (each with the callbacks its hash names) the RQ way (execution, started
        registry, status, heartbeats: what `prepare_execution` and `prepare_job_execution` write),
        all in one round trip, then hand each to the scheduler. A job that cannot run ends at once."""
        ttl = self.settings.heartbeat_ttl_s
        cancel_replies: dict[str, int] = {}
        batch = CommandBatch(self.connection)
        for job, queue, _ in jobs:
            execution = create_execution(job, ttl, batch, self.name, self._registries)
            job.prepare_for_execution(self.name, pipeline=batch)  # status, started_at, heartbeat
            batch.lrem(queue.intermediate_queue.key, 1, job.id)
            batch.persist(job.key)  # as Job.perform does: a job with ttl= must not expire mid-run
            batch.exists(keys.cancel_key(job.id))
            cancel_replies[job.id] = len(batch) - 1
            timeout = job.timeout if job.timeout is not None else self.queue_class.DEFAULT_TIMEOUT
            deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
            if deadline is not None:
                self._earliest_deadline = min(self._earliest_deadline, deadline)
            self._inflight[job.id] = InFlight(job, queue, execution, deadline)
        self._poller.started(job.id for job, _, _ in jobs)
        batch.sadd(self._poller.running_key, *(job.id for job, _, _ in jobs))
        self.set_state(WorkerStatus.BUSY, pipeline=batch)
        self.set_current_job_id(jobs[-1][0].id, pipeline=batch)
        self.set_current_job_working_time(0, pipeline=batch)
        self.heartbeat(ttl, pipeline=batch)
        batch.expire(self._poller.running_key, ttl)
        replies = batch.execute()
        assert replies is not None
        ended = []
        for job, _, callbacks in jobs:
            enqueued_at = job.enqueued_at.timestamp() if isinstance(job.enqueued_at, datetime) else None
            try:
                failed = self._admit(job, enqueued_at, callbacks, bool(replies[cancel_replies[job.id]]))
            except Exception as exc:  # one bad job must never take the worker down
                self.log.exception("Worker %s: could not start job %s", self.name, job.id)
                failed = self.scheduler_.failed_result(job.id, None, "WorkerError", f"could not start: {exc!r}",
                                                       enqueued_at=enqueued_at)
            if failed is not None:
                ended.append(failed)
        self._end_many(ended)

    def _admit(self, job: Job, enqueued_at: Optional[float], callbacks: list[str], cancelled: bool
               ) -> Optional[GenerationResult]:
        """Hand the job to the scheduler; a result if it ended at once (refused, invalid, cancelled)."""
        refused = refusal(job, callbacks, self.settings.callback_allowlist)
        if refused is not None:
            return self.scheduler_.failed_result(job.id, None, refused.error_type, refused.message,
                                                 enqueued_at=enqueued_at, started_at=time.time())
        inflight = self._inflight[job.id]
        inflight.callbacks_allowed = True
        inflight.payload = job.kwargs["request"]
        inflight.solo = bool(job.meta.get(SOLO_META))
        if cancelled:
            return self.scheduler_.failed_result(job.id, inflight.payload, "Cancelled", "", enqueued_at=enqueued_at,
                                                 status="cancelled")
        return self.scheduler_.admit(job.id, inflight.payload, enqueued_at=enqueued_at, solo=inflight.solo)

    # --- job end --------------------------------------------------------------------------
    def _end_many(self, ended: Sequence[Union[EndedJob, GenerationResult]], deltas: Optional[list[Any]] = None
                  ) -> None:
        """Hand the endings to the bookkeeping thread: stream deltas, results built and their keys
        written (one round trip), then each RQ job's end. The engine goes on meanwhile."""
        if deltas:
            streaming = [d for d in deltas if d.job_id in self._inflight]
            ttls = {d.job_id: keys.result_key_ttl(self._inflight[d.job_id].job.result_ttl) for d in streaming}
            self._bookkeeper.submit(lambda: publish_stream_deltas(self.connection, streaming, ttls))
        if not ended:
            return
        # Capture each job's InFlight now: once RQ re-queues a job (a retry), this worker may take
        # it again and a new InFlight replaces the old one under the same id.
        ending = [(e if isinstance(e, EndedJob) else EndedJob.built(e), self._inflight[e.id]) for e in ended]
        for _, inflight in ending:
            inflight.ending = True
        self._poller.ended(job.id for job, _ in ending)
        stats = WorkerStats(keys.stats_key(self.name), self._stats())
        unpublished = list(ending)
        self._bookkeeper.submit(lambda: self._publish(unpublished, stats))
        finished = [(job, inflight) for job, inflight in ending if job.status == "finished"]
        if finished:
            self._bookkeeper.submit(lambda: self._end_finished(finished))
        for job, inflight in ending:
            if job.status != "finished":
                self._bookkeeper.submit(lambda job=job, inflight=inflight: self._finish_rq_failure(job.result(), inflight))

    def _stats(self) -> dict[str, Any]:
        """The engine's counters (prefix cache, prefill and decode time) and the loop's time per
        section, published with each round of results."""
        stats: dict[str, Any] = self.scheduler_.engine.stats().flat()
        stats.update({f"loop_{name}": value for name, value in self._clock.as_dict().items()})
        return stats

    def _forget(self, inflight: InFlight) -> None:
        if self._inflight.get(inflight.job.id) is inflight:
            del self._inflight[inflight.job.id]

    def _per_call(self, pending: list[tuple[EndedJob, InFlight]], size: int
                  ) -> Iterator[list[tuple[EndedJob, InFlight]]]:
        """`pending` a Redis call's worth at a time: `size` jobs while the gate is in force, else
        all. Each is dropped from `pending` once the caller is done with it, so a task retried
        after a lost connection goes on with the rest."""
        while pending:
            chunk = pending[:size] if self._bookkeeper.gate.in_force else list(pending)
            yield chunk
            del pending[:len(chunk)]

    def _publish(self, pending: list[tuple[EndedJob, InFlight]], stats: Optional[WorkerStats]) -> None:
        """Build the results (each once: EndedJob.result) and write their keys, RESULTS_PER_CALL
        a round trip while the gate is in force; the stats go with the first."""
        gate = self._bookkeeper.gate
        for chunk in self._per_call(pending, RESULTS_PER_CALL):
            publications = []
            for ended, inflight in chunk:
                gate.wait()
                publications.append(self._publication(ended, inflight))
            gate.wait()
            publish_results(self.connection, publications, stats=stats)
            stats = None

    def _end_finished(self, pending: list[tuple[EndedJob, InFlight]]) -> None:
        """End the RQ jobs whose results finished, RQ_ENDS_PER_CALL a round trip while the gate is
        in force."""
        for chunk in self._per_call(pending, RQ_ENDS_PER_CALL):
            self._finish_rq_successes([(ended, inflight) for ended, inflight in chunk
                                       if ended.result().status == "finished"])
            for ended, inflight in chunk:
                if ended.result().status != "finished":  # its result could not be built
                    self._finish_rq_failure(ended.result(), inflight)

    def _publication(self, ended: EndedJob, inflight: InFlight) -> Publication:
        job, result = inflight.job, ended.result()
        if result.status == "failed":
            retry_policy.apply(job, result.error.type if result.error else None, self.settings.max_retries,
                               self.settings.retry_backoff_s)
        retried = result.status == "failed" and job.should_retry  # that attempt ended, the job did not
        return Publication(result, keys.result_key_ttl(job.result_ttl), write_key=not retried,
                           ends_stream=inflight.streams and not retried, encoded=None if retried else ended.encoded())

    def _finish_rq_successes(self, ending: list[tuple[EndedJob, InFlight]]) -> None:
        """End finished RQ jobs the way `perform_job` would, after their result keys are written,
        all in one transaction where rq allows it. rq's return value is the result key's own JSON
        text, not a second encoding. Runs on the bookkeeping thread: callbacks get a thread-safe
        timeout."""
        gate = self._bookkeeper.gate
        successes = []
        for ended, inflight in ending:
            gate.wait()
            job = inflight.job
            job.ended_at = now()
            return_value = ended.encoded()
            try:
                if job.success_callback:  # the callback gets the result as a dict, as before
                    job.execute_success_callback(TimerDeathPenalty, json.loads(return_value))
            except Exception:
                self.log.exception("Job %s: success callback failed", job.id)
            successes.append(Success(job, inflight.execution, return_value))
        left = {id(s.job) for s in end_successes(self, successes, self._registries, pause=gate.wait)}
        for (_, inflight), success in zip(ending, successes):
            if id(success.job) in left:  # rq's own path: dependents to enqueue, or repeats
                success.job._result = success.return_value
                with self._as_current(inflight):
                    self.handle_job_success(job=success.job, queue=inflight.queue,
                                            started_job_registry=inflight.queue.started_job_registry)
            self._forget(inflight)

    def _finish_rq_failure(self, result: GenerationResult, inflight: InFlight) -> None:
        """End a failed or cancelled RQ job the way `perform_job` would, after its result key is
        written. Runs on the bookkeeping thread: callbacks get a thread-safe timeout."""
        job, queue = inflight.job, inflight.queue
        job.ended_at = now()
        with self._as_current(inflight):
            if result.status == "cancelled":
                self._stopped_job_id = job.id  # RQ's own marker: status STOPPED, no retry
                if inflight.callbacks_allowed:
                    with contextlib.suppress(Exception):
                        job.execute_stopped_callback(TimerDeathPenalty)
                self.handle_job_failure(job=job, queue=queue, exc_string="cancelled",
                                        started_job_registry=queue.started_job_registry)
            else:
                job._status = JobStatus.FAILED
                error = result.error
                exc: Exception = (
                    JobTimeoutException(error.message) if error and error.type == "JobTimeoutException"
                    else JobFailed(f"{error.type}: {error.message}" if error else "failed")
                )
                if inflight.callbacks_allowed:
                    with contextlib.suppress(Exception):
                        job.execute_failure_callback(TimerDeathPenalty, type(exc), exc, None)
                self.handle_job_failure(job=job, queue=queue, exc_string=f"{type(exc).__name__}: {exc}",
                                        started_job_registry=queue.started_job_registry)
        self._forget(inflight)

    @contextlib.contextmanager
    def _as_current(self, inflight: InFlight) -> Iterator[None]:
        self.execution = inflight.execution
        try:
            yield
        finally:
            self.execution = None

    def _recover_from_engine_failure(self, exc: BaseException) -> None:
        """A step failed and no single sequence can be blamed. Start the engine afresh; re-queue
        every job it held to run alone, and fail any job that already failed alone: that one is
        the poison, and the others finish normally."""
        job_ids = self.scheduler_.reset()
        poisoned = []
        for job_id in job_ids:
            inflight = self._inflight[job_id]
            if inflight.solo:
                poisoned.append(self.scheduler_.failed_result(
                    job_id, inflight.payload, "EngineError",
                    f"this request made the engine fail even when run alone: {exc!r}", started_at=time.time()))
                continue
            inflight.ending = True
            self._bookkeeper.submit(lambda inflight=inflight: self._requeue_solo(inflight))
        self._end_many(poisoned)

    def _requeue_solo(self, inflight: InFlight) -> None:
        job = inflight.job
        job.meta[SOLO_META] = True
        job.save_meta()
        self.connection.srem(self._poller.running_key, job.id)
        job.ended_at = now()
        with self._as_current(inflight):
            self.handle_job_retry(job=job, queue=inflight.queue, retry=Retry(max=(job.number_of_retries or 0) + 1),
                                  started_job_registry=inflight.queue.started_job_registry,
                                  execution=inflight.execution)
        self._forget(inflight)

    def _abandon_inflight(self, reason: str) -> None:
        """Cold shutdown or a crash: fail (or, with Retry, re-queue) every running job now."""
        if not self._inflight or self.scheduler_ is None:
            return
        held = set(self.scheduler_.job_ids)
        never_admitted = {job_id for job_id, f in list(self._inflight.items()) if not f.ending and job_id not in held}
        with contextlib.suppress(Exception):
            self._end_many(self.scheduler_.abort_all("WorkerShutdown", reason))
        with contextlib.suppress(Exception):
            self._end_many([self.scheduler_.failed_result(job_id, None, "WorkerShutdown", reason)
                            for job_id in never_admitted if job_id in self._inflight])
        self._bookkeeper.wait_idle(timeout=10)

    # --- per-step housekeeping ------------------------------------------------------------
    def _enforce_cancellations_and_deadlines(self, requested: set[str]) -> None:
        """End the running jobs in `requested` (cancel keys) or in RQ stop commands as
        cancelled, and those past their deadline as timed out."""
        with self._stop_job_lock:
            stop_ids, self._stop_job_ids = self._stop_job_ids, set()
        running = self.scheduler_.job_ids
        cancelled = (requested | stop_ids) & set(running)
        ending = [r for r in (self.scheduler_.cancel(job_id, "cancelled") for job_id in cancelled) if r]
        clock = time.monotonic()
        if clock > self._earliest_deadline:  # else no running job is past its deadline: skip the scan
            self._earliest_deadline = math.inf
            for job_id in running:
                deadline = self._inflight[job_id].deadline
                if job_id in cancelled or deadline is None:
                    continue
                if clock > deadline:
                    result = self.scheduler_.cancel(job_id, "timeout")
                    if result is not None:
                        ending.append(result)
                    continue
                self._earliest_deadline = min(self._earliest_deadline, deadline)
        self._end_many(ending, self.scheduler_.take_stream_deltas())

    def _refresh_presence(self) -> None:
        if self._presence is not None and self.scheduler_ is not None:
            self._presence.refresh(running=len(self._inflight), sequences=self.scheduler_.num_sequences)

    def _beat(self) -> None:
        """Runs on the liveness thread: refresh the worker's entry in the live-worker list and,
        while it runs jobs, its own and every running job's heartbeat."""
        self._refresh_presence()
        running = list(self._inflight.values())
        if not running:
            return
        ttl = self.settings.heartbeat_ttl_s
        batch = CommandBatch(self.connection)
        self.heartbeat(ttl, pipeline=batch)
        batch.expire(self._poller.running_key, ttl)
        for inflight in running:
            inflight.execution.heartbeat(self._registries.started(inflight.job.origin), ttl, pipeline=batch)
            inflight.job.heartbeat(now(), ttl, pipeline=batch, xx=True)
        batch.execute()
