"""The batch loop: the worker's main thread, turn after turn.

A turn takes waiting jobs (one Redis round trip that also finds cancellations), starts them the RQ
way and admits them to the scheduler, runs one engine step, and hands the jobs that ended to the
bookkeeping thread. The loop paces admission while sequences decode, looks for cancellations on a
cadence when it has no room, enforces deadlines, recovers from a failed engine step, and keeps the
housekeeping timers (due retries, the dead-worker sweep, rq's maintenance), whose work it hands to
the bookkeeping thread. It alone writes its table of running jobs; the liveness thread reads a
snapshot (`running`), and jobs leave the table when bookkeeping gives their ending back.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import sys
import time
from typing import Any, Callable, ContextManager, NoReturn, Optional

from pathlib import Path

from schemas import GenerationResult, keys
from schemas.control import ControlCommand
from worker.bookkeeping import Bookkeeper
from worker.control import Controller
from worker.engines.device_loss import DeviceLost, device_lost_reason
from worker.gate import StepRhythm
from worker.job_ending import JobEnding
from worker.loop_clock import LoopClock
from worker.loop_interfaces import InFlight, JobSource, StartedJob, WorkerSide
from worker.metrics import WorkerMetrics
from worker.output import EndedJob
from worker.poll import TakenJob
from worker.publish import WorkerStats
from worker.redis_health import REDIS_ERRORS, RedisHealth
from worker.input_prep import InputPreparer
from worker.scheduler import BatchScheduler
from worker.settings import WorkerSettings

log = logging.getLogger("mlxq.worker")

# While sequences decode, a turn starts at most this many jobs: each costs the loop some Python (rq's
# job objects, the request's validation), and starting hundreds at once held the running sequences'
# next token back (docs/design-notes.md, "Admission pacing"). An idle worker takes all it has room for.
ADMIT_PER_TURN_WHILE_DECODING = 64
# An idle worker's blocking wait returns this often, to see a stop request and its control stream;
# its RQ heartbeat goes out once in IDLE_BEATS_EVERY rounds.
IDLE_WAIT_ROUND_S = 0.25
IDLE_BEATS_EVERY = 4
# A full worker has no job to take, so its round trip per turn would only look for cancel keys: it
# does that this often instead.
CANCEL_CHECK_INTERVAL_S = 0.05
RETRY_CHECK_INTERVAL_S = 1  # how often due retries go back to their queues
# The bookkeeping thread's Python (hundreds of job endings a step) would otherwise hold the GIL for
# 5 ms slices while the loop waits to hand out the next step.
GIL_SWITCH_INTERVAL_S = 0.0005
PAUSED_TURN_S = 0.01  # a turn's length while paused with sequences kept (nothing to step)


class BatchLoop:
    def __init__(self, scheduler: BatchScheduler, source: JobSource, rq: WorkerSide, bookkeeper: Bookkeeper,
                 ending: JobEnding, health: RedisHealth, settings: WorkerSettings, stats_key: str,
                 clock: Callable[[], float] = time.monotonic,
                 watchdog: Callable[[], ContextManager[None]] = contextlib.nullcontext,
                 controller: Optional[Controller] = None, metrics: Optional[WorkerMetrics] = None) -> None:
        """`watchdog` wraps each engine step (worker/liveness.py: a step that hangs exits the process);
        `controller` applies the control plane's commands (worker/control.py)."""
        self.scheduler = scheduler
        self._watchdog = watchdog
        self._controller = controller
        self._metrics = metrics
        self._source, self._rq, self._bookkeeper, self._ending = source, rq, bookkeeper, ending
        self._health, self._settings, self._stats_key, self._clock = health, settings, stats_key, clock
        self._table: dict[str, InFlight] = {}
        # Jobs taken off their queues whose start Redis did not record (it went away in between):
        # they wait in their intermediate lists, and the next turn that reaches Redis starts them.
        self._unstarted: list[TakenJob] = []
        self._jobs_taken = 0  # off their queues, since the worker began
        self.running: tuple[InFlight, ...] = ()  # a snapshot of the table, for the liveness thread
        self._earliest_deadline = math.inf  # no running job's deadline is earlier
        self._next_cancel_check = 0.0
        self._next_retry_check = 0.0
        self._last_sweep = clock()
        self._next_maintenance = clock()  # rq cleans its registries when a worker starts
        self._rhythm = StepRhythm()
        self._stop_grace_until: Optional[float] = None
        self.time = LoopClock()
        # Jobs whose input is being prepared off this thread (images), and the threads that do it.
        self._preparing: dict[str, StartedJob] = {}
        self._preparer: Optional[InputPreparer] = None

    # --- the turns --------------------------------------------------------------------------
    def run(self, burst: bool = False, max_jobs: Optional[int] = None, max_idle_time: Optional[int] = None) -> int:
        """Turn until stopped (a warm stop drains first), or, with `burst`, until the queues are
        empty, or after `max_jobs` jobs. Returns the jobs taken. A cold stop or a crash fails (or
        re-queues, with Retry) every job in flight before it propagates."""
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.time = LoopClock()  # the loop's time from here, not the model's loading
        taken_before = self._jobs_taken
        try:
            while True:
                taken = self._jobs_taken - taken_before
                self._rq.notice_stop()
                if self._rq.stop_requested and self._grace_over():
                    break
                if not self._table and not self._unstarted:
                    self._bookkeeper.release()  # no step to come: nothing to keep out of the way of
                    self._rq.idle(burst)
                    if self._rq.stop_requested or (max_jobs is not None and taken >= max_jobs):
                        break
                    if burst:
                        if not self._redis_call(self._take, 1) and not self._unstarted:
                            break
                    else:
                        waited_for = self._wait_for_job(max_idle_time)
                        if waited_for is None:
                            break
                        self._jobs_taken += 1
                        self._redis_call(self._start, [waited_for])
                    taken = self._jobs_taken - taken_before
                self.turn(None if max_jobs is None else max_jobs - taken)
        except SystemExit:
            self.abandon("worker received a cold shutdown")
            raise
        except DeviceLost:
            self.abandon("the worker's device failed")
            raise
        except Exception:
            log.exception("unhandled error in the batch loop")
            self.abandon("worker loop crashed")
            raise
        return self._jobs_taken - taken_before

    def _stop_waiting(self) -> bool:
        """Whether a backoff the loop sleeps through should end early: a stop was requested."""
        return self._rq.stop_requested

    def _grace_over(self) -> bool:
        """Stopping, with nothing left to compute but results Redis is not taking: whether the grace
        for it to come back (MLXQ_STOP_GRACE_S) is over. Then the bookkeeping gives up on them and
        their jobs stay in RQ's started registry, for a live worker's abandoned-job sweep."""
        waiting_on_redis = ((self._table or self._unstarted) and not self._health.up and not len(self.scheduler)
                            and not self._preparing and all(inflight.ending for inflight in self._table.values()))
        if not waiting_on_redis:
            return False
        now = self._clock()
        if self._stop_grace_until is None:
            self._stop_grace_until = now + self._settings.stop_grace_s
            log.warning("stopping with Redis unreachable: waiting up to %.0f s for it to take the results of %d jobs",
                        self._settings.stop_grace_s, len(self._table))
        if now < self._stop_grace_until:
            return False
        if self._table:
            log.error("the results of %d jobs were not written (Redis unreachable); their jobs are left to the "
                      "abandoned-job sweep", len(self._table))
        if self._unstarted:
            log.error("%d jobs taken off their queues were never started (Redis unreachable): %s; they stay in "
                      "their queues' intermediate lists", len(self._unstarted),
                      ", ".join(item.job_id for item in self._unstarted))
        self._bookkeeper.give_up()
        return True

    def turn(self, jobs_left: Optional[int] = None) -> int:
        """One turn of the busy loop: one round trip that takes jobs and finds cancellations, then
        one engine step. Returns the jobs taken."""
        clock = self.time
        clock.lap("between")  # blocking waits and maintenance, when nothing was in flight
        self._forget_done()
        if self._preparing:
            self._admit_prepared()
        taken = 0
        # A stopping loop with nothing to compute does not sleep through the backoff: its grace runs.
        backoff = not len(self.scheduler) and not self._rq.stop_requested
        if not self._health.up and self._health.try_reconnect(wait=backoff, stop_waiting=self._stop_waiting):
            self._rq.beat_now()  # before any sweep can take our jobs for abandoned
        if self._health.up:
            room = 0 if self._rq.stop_requested or not self.admitting else self.scheduler.free_slots
            if self.scheduler.decoding:
                room = min(room, ADMIT_PER_TURN_WHILE_DECODING)
            room = room if jobs_left is None else min(room, jobs_left)
            taken = self._redis_call(self._take, room) or 0
        clock.lap("poll")
        if not len(self.scheduler) and not taken:
            if self._preparer is not None and self._preparing:  # only inputs being prepared: wait, don't spin
                self._preparer.wait(timeout=0.05)
            self._bookkeeper.wait_idle(timeout=0.05)  # only endings left: let them land, don't spin
            self._forget_done()
            clock.lap("idle")
        self._step()
        if self._health.up:
            self._upkeep()
        clock.lap("upkeep")
        return taken

    def _take(self, room: int) -> int:
        """Take up to `room` waiting jobs without blocking and start them; end the running jobs that
        were cancelled or ran out of time. Returns how many jobs were taken."""
        if self._unstarted:
            room -= len(self._unstarted)
            self._start([])
        now = self._clock()
        check = bool(self._table) and (room > 0 or now >= self._next_cancel_check)
        if room <= 0 and not check:
            return 0
        if check:
            self._next_cancel_check = now + CANCEL_CHECK_INTERVAL_S
        poll = self._source.poll(room, check)
        self.scheduler.queue_seen(poll.left > 0)
        self._jobs_taken += len(poll.taken)
        self._start(poll.taken)
        if check:
            self._end_cancelled_and_late(poll.cancelled)
        return len(poll.taken)

    def _wait_for_job(self, max_idle_time: Optional[int]) -> Optional[TakenJob]:
        """Block for one job, in rounds short enough to see a stop request; None once stopped or
        after `max_idle_time` seconds without a job."""
        waited, rounds = 0.0, 0
        while not self._rq.stop_requested:
            round_s = IDLE_WAIT_ROUND_S if max_idle_time is None else min(IDLE_WAIT_ROUND_S, max_idle_time - waited)
            if round_s <= 0:
                return None
            try:
                self._source.stay_in_group()
                self._upkeep()
                if not self.admitting:
                    time.sleep(round_s)
                    waited += round_s
                    continue
                taken = self._source.wait(round_s)
            except REDIS_ERRORS as exc:
                self._health.lost(exc)
                self._health.try_reconnect(wait=True, stop_waiting=self._stop_waiting)
                continue
            if taken is not None:
                return taken
            waited += round_s
            rounds += 1
            if rounds % IDLE_BEATS_EVERY == 0:
                self._rq.idle(burst=False)
        return None

    def _step(self) -> None:
        if not len(self.scheduler):
            return
        if self._controller is not None and not self._controller.stepping:
            self._bookkeeper.release()  # no step to come: nothing to keep out of the way of
            time.sleep(PAUSED_TURN_S)  # paused with its sequences kept: no step, and no spinning
            return
        self._bookkeeper.step_started(self._rhythm.step_started())
        started = time.perf_counter()
        try:
            with self._watchdog():
                ended = self.scheduler.step()
        except Exception as exc:
            log.exception("engine step failed")
            lost = device_lost_reason(exc)
            if lost is not None:
                self._hand_back_after_device_loss(exc, lost)
            self._recover_from_engine_failure(exc)
            return
        if self._rhythm.step_ended():
            self._bookkeeper.step_ended()
        if self._metrics is not None:
            self._metrics.step(time.perf_counter() - started, self.scheduler.last_step_tokens)
        self.time.lap("step")
        self._hand_off(ended)
        self.time.lap("hand_off")

    # --- start and end ----------------------------------------------------------------------
    def _start(self, taken: list[TakenJob]) -> None:
        """Record the jobs' start in RQ (one round trip), then admit each to the scheduler; a job that
        cannot run, or was cancelled meanwhile, ends at once. Jobs whose start could not be recorded
        (a Redis error, raised) are kept, and started first next time."""
        retrying = bool(self._unstarted)
        taken, self._unstarted = self._unstarted + taken, []
        try:
            taken = self._once_each(taken)
            if not taken:
                return
            started, unreadable = self._rq.start_jobs(taken, self.weight_version)
        except REDIS_ERRORS:
            if taken and not retrying:
                log.warning("jobs %s were taken off their queues, and Redis went away before their start was "
                            "recorded: they start when it answers", ", ".join(item.job_id for item in taken))
            self._unstarted = taken
            raise
        if unreadable:
            self._source.ended([bad.job_id for bad, _ in unreadable if bad.job_id is not None])
            self._ending.refuse(unreadable)
        now = self._clock()
        for item in started:
            inflight = item.inflight
            if item.timeout is not None and item.timeout > 0:
                inflight.deadline = now + item.timeout
                self._earliest_deadline = min(self._earliest_deadline, inflight.deadline)
            self._table[inflight.job.id] = inflight
        self._source.started([item.inflight.job.id for item in started])
        ended: list[GenerationResult] = []
        for item in started:
            try:
                result = self._admit(item)
            except Exception as exc:  # one bad job must never take the worker down
                log.exception("could not start job %s", item.inflight.job.id)
                result = self.scheduler.failed_result(item.inflight.job.id, None, "WorkerError",
                                                      f"could not start: {exc!r}", enqueued_at=item.enqueued_at)
            if result is not None:
                ended.append(result)
        self._hand_off(ended)
        self._update_snapshot()

    def _once_each(self, taken: list[TakenJob]) -> list[TakenJob]:
        """A job runs once in this worker: an id taken again while its job is here (a producer pushed
        it onto a queue again), or twice in one poll, leaves its intermediate list unstarted. Two runs
        under one id shared one entry of the loop's and the scheduler's books, and each such run kept a
        slot taken for good. A job this worker sent back to its queue (an abort, a failed step) is taken
        as its next run, even before its old entry leaves the table: dropped, that run was lost. So is
        a job whose ending here was dropped, taken for another worker's (JobEnding.claim_copy)."""
        running = {job_id: inflight for job_id, inflight in self._table.items() if not inflight.sent_back}
        for job_id in {item.job_id for item in taken} & running.keys():
            if running[job_id].ending and not self._ending.claim_copy(job_id):
                running.pop(job_id).sent_back = True
        seen: set[str] = set(running)
        once, again = [], []
        for item in taken:
            (again if item.job_id in seen else once).append(item)
            seen.add(item.job_id)
        if again:
            runs = {item.job_id: running[item.job_id] for item in again if item.job_id in running}
            self._rq.drop_taken(again, [inflight for inflight in runs.values() if not inflight.ending])
        return once

    def _admit(self, item: StartedJob) -> Optional[GenerationResult]:
        """Hand the job to the scheduler; a result if it ended at once (refused, invalid, cancelled)."""
        inflight, job_id = item.inflight, item.inflight.job.id
        if item.refusal is not None:
            return self.scheduler.failed_result(job_id, None, item.refusal.error_type, item.refusal.message,
                                                enqueued_at=item.enqueued_at, started_at=time.time())
        if item.cancelled:
            return self.scheduler.failed_result(job_id, inflight.payload, "Cancelled", "",
                                                enqueued_at=item.enqueued_at, status="cancelled")
        slow = self.scheduler.slow_prepare(inflight.payload)
        if slow is not None:  # images take long to read, decode and process: not on this thread
            if self._preparer is None:
                self._preparer = InputPreparer(self._settings.image_io_threads, self._settings.image_fetch_timeout_s)
            self._preparing[job_id] = item
            self._preparer.submit(job_id, slow)
            return None
        return self.scheduler.admit(job_id, inflight.payload, enqueued_at=item.enqueued_at, solo=inflight.solo)

    def _admit_prepared(self) -> None:
        """Admit the jobs whose inputs are ready; one the engine refused ends at once, naming its field."""
        ended = []
        assert self._preparer is not None
        for job_id, future in self._preparer.ready():
            item = self._preparing.pop(job_id)
            payload = item.inflight.payload
            try:
                result = self.scheduler.admit(job_id, payload, enqueued_at=item.enqueued_at, solo=item.inflight.solo,
                                              prepared=future.result())
            except ValueError as exc:
                result = self.scheduler.failed_result(job_id, payload, "InvalidRequest", str(exc),
                                                      enqueued_at=item.enqueued_at, started_at=time.time())
            except Exception as exc:  # one bad job must never take the worker down
                log.exception("could not prepare job %s", job_id)
                result = self.scheduler.failed_result(job_id, None, "WorkerError", f"could not start: {exc!r}",
                                                      enqueued_at=item.enqueued_at)
            if result is not None:
                ended.append(result)
        self._hand_off(ended)

    def _hand_off(self, ended: list[Any]) -> None:
        """The step's stream deltas and the jobs that ended, to the bookkeeping thread."""
        deltas = [d for d in self.scheduler.take_stream_deltas() if d.job_id in self._table]
        if not ended and not deltas:
            return
        ttls = {d.job_id: keys.result_key_ttl(self._table[d.job_id].job.result_ttl) for d in deltas}
        endings = []
        for item in ended:
            record = item if isinstance(item, EndedJob) else EndedJob.built(item)
            inflight = self._table[record.id]
            inflight.ending = True
            endings.append(inflight.ending_record(record))
        if endings:
            self._source.ended([e.job_id for e in endings])
        stats = WorkerStats(self._stats_key, self.stats()) if endings else None
        self._ending.hand_off(endings, deltas, ttls, stats)

    def _forget_done(self) -> None:
        """Jobs the bookkeeping thread has ended leave the table (a job RQ re-queued and this worker
        took again has a new entry under the same id, which stays)."""
        changed = False
        while True:
            try:
                ending = self._ending.done.get_nowait()
            except queue.Empty:
                break
            self._ending.forget_marks(ending.job_id)
            if self._table.get(ending.job_id) is ending.entry:
                del self._table[ending.job_id]
                changed = True
        if changed:
            self._update_snapshot()

    def _update_snapshot(self) -> None:
        self.running = tuple(self._table.values())

    def describe_in_flight(self) -> str:
        """The table as an operator reads it (SIGUSR1): each job, whether it is in the engine, being
        prepared, or handed to the bookkeeping thread."""
        held = set(self.scheduler.job_ids)
        return "; ".join(f"{job_id!r}: " + ("ending" if f.ending else "in the engine" if job_id in held
                                            else "preparing" if job_id in self._preparing else "nowhere")
                         for job_id, f in list(self._table.items())) or "none"

    def running_ids(self) -> list[str]:
        """The jobs in the table, from the snapshot, and those taken whose start waits for Redis (any
        thread may ask: both lists are replaced, never changed in place)."""
        return [inflight.job.id for inflight in self.running] + [item.job_id for item in self._unstarted]

    def stats(self) -> dict[str, Any]:
        """The engine's counters and the loop's time per section, published with each round of results."""
        stats: dict[str, Any] = self.scheduler.stats().engine.flat()
        stats.update({f"loop_{name}": value for name, value in self.time.as_dict().items()})
        return stats

    # --- cancellations, deadlines, failures -------------------------------------------------
    def _end_cancelled_and_late(self, requested: set[str]) -> None:
        """End the running jobs with a cancel key or an RQ stop command as cancelled, and those past
        their deadline as timed out."""
        running = self.scheduler.job_ids
        cancelled = (requested | self._rq.take_stop_job_ids()) & set(running)
        ending = [r for r in (self.scheduler.cancel(job_id, "cancelled") for job_id in cancelled) if r]
        now = self._clock()
        if now > self._earliest_deadline:  # else no running job is past its deadline: skip the scan
            self._earliest_deadline = math.inf
            for job_id in running:
                deadline = self._table[job_id].deadline
                if job_id in cancelled or deadline is None:
                    continue
                if now > deadline:
                    result = self.scheduler.cancel(job_id, "timeout")
                    if result is not None:
                        ending.append(result)
                    continue
                self._earliest_deadline = min(self._earliest_deadline, deadline)
        self._hand_off(ending)

    def _recover_from_engine_failure(self, exc: BaseException) -> None:
        """A step failed and no single sequence can be blamed. Start the engine afresh; re-queue every
        job it held to run alone, and fail any job that already failed alone: that one is the poison,
        and the others finish normally."""
        self._hand_off(self._send_back([(job_id, True) for job_id in self.scheduler.reset()],
                                       f"this request made the engine fail even when run alone: {exc!r}"))

    def _send_back(self, jobs: list[tuple[str, bool]], poison_message: str) -> list[Any]:
        """Send each (job, alone) back to its queue, `alone` for those in a failed step; a job that was
        already running alone when its step failed is the poison: its failed result is returned."""
        poisoned = []
        for job_id, alone in jobs:
            inflight = self._table[job_id]
            if inflight.solo and alone:
                poisoned.append(self.scheduler.failed_result(job_id, inflight.payload, "EngineError", poison_message,
                                                             started_at=time.time()))
                continue
            inflight.ending = inflight.sent_back = True
            self._ending.requeue(inflight.ending_record(None), alone=alone)
        return poisoned

    def _hand_back_after_device_loss(self, exc: BaseException, reason: str) -> NoReturn:
        """The device is gone for this process (worker/engines/device_loss.py): fail a job that lost it
        while running alone, as `_recover_from_engine_failure` would; send every other job back to its
        queue (those that were in the failed step to run alone), then end the loop."""
        sent_back = [(job_id, True) for job_id in self.scheduler.reset(restart_engine=False)]
        sent_back += [(job_id, False) for job_id in self.scheduler.withdraw()]
        sent_back += [(job_id, False) for job_id in self._preparing]
        self._preparing.clear()
        if self._preparer is not None:
            self._preparer.clear()
        poisoned = self._send_back(sent_back, f"this request made the device fail even when run alone: {exc!r}")
        self._hand_off(poisoned)
        log.critical("the device failed and cannot be used again in this process (%s): %d job(s) went back to "
                     "their queues, %d failed; the worker stops", reason, len(sent_back) - len(poisoned), len(poisoned))
        raise DeviceLost(reason) from exc

    def abandon(self, reason: str) -> None:
        """A cold shutdown or a crash: fail (or, with Retry, re-queue) every running job now."""
        if not self._table:
            return
        held = set(self.scheduler.job_ids)
        never_admitted = [job_id for job_id, f in self._table.items() if not f.ending and job_id not in held]
        self._preparing.clear()
        if self._preparer is not None:
            self._preparer.clear()
        try:
            self._hand_off(self.scheduler.abort_all("WorkerShutdown", reason))
            self._hand_off([self.scheduler.failed_result(job_id, None, "WorkerShutdown", reason)
                            for job_id in never_admitted])
        except Exception:
            log.exception("could not hand the running jobs over while stopping")
        self._bookkeeper.wait_idle(timeout=10)

    # --- housekeeping -----------------------------------------------------------------------
    def _upkeep(self) -> None:
        """The timers; their Redis work runs on the bookkeeping thread: due retries back to their
        queues (each second), the dead-worker sweep, rq's registry maintenance while idle."""
        if self._controller is not None:
            self._redis_call(self._controller.turn, self)
        now = self._clock()
        if now >= self._next_retry_check:
            self._next_retry_check = now + RETRY_CHECK_INTERVAL_S
            self._bookkeeper.submit(self._rq.enqueue_due_retries, upkeep=True)
        if not self._table and now >= self._next_maintenance:
            self._next_maintenance = now + self._settings.sweep_interval_s
            self._last_sweep = now  # rq's maintenance begins with the sweep (BatchWorker.clean_registries)
            self._bookkeeper.submit(self._rq.run_maintenance, upkeep=True)
        elif now - self._last_sweep > self._settings.sweep_interval_s:
            self._last_sweep = now
            running = frozenset(self.running_ids())
            self._bookkeeper.submit(lambda: self._rq.sweep(running), upkeep=True)

    # --- the control plane's hands (worker/control.py LoopControls) --------------------------
    @property
    def admitting(self) -> bool:
        return self._controller is None or self._controller.admitting

    @property
    def weight_version(self) -> int:
        return self.scheduler.engine.weight_version

    def running_count(self) -> int:
        return len(self.scheduler)

    def requeue_running(self) -> None:
        for job_id in self.scheduler.withdraw():
            inflight = self._table[job_id]
            inflight.ending = inflight.sent_back = True
            self._ending.requeue(inflight.ending_record(None), alone=False)

    def cancel_running(self, job_id: Optional[str]) -> None:
        chosen = [job_id] if job_id is not None else self.scheduler.job_ids
        self._hand_off([r for r in (self.scheduler.cancel(j, "cancelled") for j in chosen) if r])

    def swap_weights(self, files: list[Path], version: int) -> None:
        self.scheduler.engine.swap_weights(files, version)
        self._source.version_changed()

    def reset_prefix_cache(self) -> None:
        self.scheduler.engine.reset_prefix_cache()

    def add_adapter(self, name: str, directory: Path) -> None:
        self.scheduler.engine.register_adapter(name, directory)

    def ack(self, command: ControlCommand, ok: bool, message: str, seconds: Optional[float]) -> None:
        assert self._controller is not None
        channel, version = self._controller.channel, self.weight_version
        self._bookkeeper.submit(lambda: channel.ack(command, ok, message, version, seconds))

    def _redis_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except REDIS_ERRORS as exc:
            self._health.lost(exc)
            return None
