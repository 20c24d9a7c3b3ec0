"""BatchWorker: an RQ worker whose jobs run together in a continuous batch.

An RQ `SimpleWorker` (no fork: the model stays loaded, and fork after MLX starts is unsafe on
macOS). This class is RQ's side only: its hooks (signals, stop-job commands, maintenance), the
start of a job in RQ's terms (for many jobs in one round trip) and its end in RQ's terms. The turns
themselves are the batch loop's (worker/batch_loop.py), the Redis side of ending jobs runs on the
bookkeeping thread (worker/job_ending.py), heartbeats on the liveness thread (worker/liveness.py).
It knows nothing of MLX; the scheduler knows nothing of Redis.
"""

from __future__ import annotations

import contextlib
import gc
import json
import signal
import threading
from collections.abc import Sequence
from datetime import datetime
from types import FrameType
from typing import Any, Callable, Iterator, Optional

from rq import Queue, Retry, SimpleWorker
from rq.command import parse_payload
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.timeouts import JobTimeoutException, TimerDeathPenalty
from rq.utils import now
from rq.worker import WorkerStatus
from rq.worker.base import DequeueStrategy

from schemas import GenerationResult, keys
from schemas.command_batch import CommandBatch
from schemas.serializer import JSON_SERIALIZER
from worker.allowlist import ALLOWED_FUNCTIONS, callback_names, refusal
from worker.batch_loop import BatchLoop, InFlight, StartedJob
from worker.bookkeeping import Bookkeeper
from worker.control import ControlChannel, Controller
from worker.intake import Unreadable, read_job
from worker.job_ending import Ending, JobEnding
from worker.liveness import Liveness
from worker.loading import ModelLoadError
from worker.metrics import WorkerMetrics, scheduler_gauges
from worker.poll import Poller, TakenJob, WorkerQueues
from worker.presence import PresencePublisher
from worker.recovery import Housekeeping
from worker.redis_health import REDIS_ERRORS, RedisHealth
from worker.rq_batch import Registries, Success, create_execution, end_successes
from worker.scheduler import BatchScheduler
from worker.settings import WorkerSettings
from worker.weights import WeightLoader

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


class BatchWorker(SimpleWorker):
    allowed_functions = ALLOWED_FUNCTIONS

    def __init__(
        self,
        queues: Any = None,
        *args: Any,
        settings: Optional[WorkerSettings] = None,
        scheduler_factory: Optional[Callable[[WorkerSettings, str], BatchScheduler]] = None,
        **kwargs: Any,
    ) -> None:
        kwargs["serializer"] = JSON_SERIALIZER  # never pickle, whatever the command line said
        self.settings = settings or WorkerSettings.from_env()
        if queues is None:
            queues = self.settings.default_queues()
        kwargs.setdefault("maintenance_interval", int(self.settings.sweep_interval_s))
        super().__init__(queues, *args, **kwargs)
        self._scheduler_factory = scheduler_factory
        self._registries = Registries(self)
        self._health = RedisHealth(self.connection)
        self._bookkeeper = Bookkeeper(self._health)
        self._metrics = self._start_metrics() if self.settings.metrics_port is not None else None
        self._ending = JobEnding(self.connection, self._bookkeeper, self, self.settings, self.name, self._metrics)
        self._housekeeping = Housekeeping(self.connection, self.queues, self.settings, self._ending.refuse_now)
        self._poller = Poller(self.connection, self.name, self.settings.group, self.settings.heartbeat_ttl_s,
                              self.settings.max_job_bytes)
        self._liveness = Liveness(self.settings.heartbeat_interval_s, self.settings.step_timeout_s, self._beat)
        self._loop: Optional[BatchLoop] = None
        self._queues: Optional[WorkerQueues] = None
        self._controller: Optional[Controller] = None
        self._loop_started = False  # until then a warm stop may interrupt (model loading), as in rq
        self._presence: Optional[PresencePublisher] = None
        self._stop_job_ids: set[str] = set()  # written by rq's pubsub thread, taken by the loop
        self._stop_job_lock = threading.Lock()
        self._stop_recorded = False

    # --- RQ's hooks -----------------------------------------------------------------------
    @property
    def bookkeeping_idle(self) -> bool:
        """Whether every ending handed to the bookkeeping thread has been written."""
        return self._bookkeeper.idle

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    @property
    def dequeue_timeout(self) -> int:
        # rq sets the connection's socket timeout to this + 10 s (the idle wait uses shorter rounds).
        return max(1, int(self.settings.sweep_interval_s))

    def get_heartbeat_ttl(self, job: Job) -> int:
        return self.settings.heartbeat_ttl_s

    def request_stop(self, signum: int, frame: Optional[FrameType]) -> None:
        """First SIGTERM/SIGINT: warm shutdown. rq raises StopRequested from this signal handler when
        the worker is not busy, wherever the main thread happens to be: inside a `try/except
        Exception` the stop was lost, and between a Redis command and its reply the reply was left on
        a pooled connection for its next user. Once the loop runs, the handler only sets the flag the
        loop checks every turn. (A second signal within 1 s of the first is taken for a duplicate and
        ignored, as rq does; a later one is a cold shutdown.)"""
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
        """rq's maintenance, made safe (on the bookkeeping thread): rq's own registry and
        intermediate-list cleanups read every job hash they meet and would raise on one a producer
        wrote by hand, so the sweep and `_clear_intermediate_lists` take those out first, and nothing
        rq raises stops the worker."""
        running = frozenset(self._loop.running_ids() if self._loop else ())
        self._housekeeping.sweep(running)
        self._housekeeping.clear_intermediate_lists(running)
        try:
            super().clean_registries()
        except Exception:
            self.log.exception("Worker %s: rq's registry cleanup failed; the next pass tries again", self.name)

    # --- the run --------------------------------------------------------------------------
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
        taken = 0
        try:
            scheduler = self._build_scheduler()
            # What is alive now (the model, the libraries) stays alive: keep it out of the cyclic
            # collector, whose full passes over it stalled steps by tens of ms.
            gc.collect()
            gc.freeze()
            self._presence = PresencePublisher(self.connection, self.name, self.settings, self.queue_names(),
                                               kind="fake" if self.settings.engine == "fake" else "text")
            self._queues = WorkerQueues(self._poller, [(q.key, q.intermediate_queue.key) for q in self.queues],
                                        self.job_class.key_for(""))
            self._controller = self._control_plane(scheduler)
            loop = BatchLoop(scheduler, self._queues, self, self._bookkeeper, self._ending, self._health, self.settings,
                             keys.stats_key(self.name), watchdog=self._liveness.step, controller=self._controller,
                             metrics=self._metrics)
            self._loop = loop
            self._liveness.beat_now()  # in the live-worker list at once
            self._liveness.start()
            self._bookkeeper.start()
            self._loop_started = True
            taken = loop.run(burst, max_jobs, max_idle_time)
        except StopRequested:
            pass
        except ModelLoadError as exc:
            self.log.error("Worker %s: %s", self.name, exc)
            raise
        finally:
            if self._controller is not None:
                self._controller.stop()
            self._bookkeeper.stop()
            self._quietly(self._poller.remove_ended)
            self._quietly(self._poller.leave_group)
            self._liveness.stop()
            if self._presence is not None:
                self._quietly(self._presence.withdraw)
            self.notice_stop()
            try:
                self.teardown()
            except REDIS_ERRORS as exc:
                self.log.warning("Worker %s: stopped without deregistering (Redis unreachable: %s); its "
                                 "entry expires with its heartbeat", self.name, exc)
        return taken > 0

    def _start_metrics(self) -> WorkerMetrics:
        metrics = WorkerMetrics(self.name, self.settings.served_alias,
                                lambda: scheduler_gauges(self._loop.scheduler if self._loop else None, self._health))
        assert self.settings.metrics_port is not None
        metrics.serve(self.settings.metrics_port)
        return metrics

    def _control_plane(self, scheduler: BatchScheduler) -> Optional[Controller]:
        """The commands a trainer sends to this model's workers (docs/rl.md); none without a model name."""
        alias = self.settings.served_alias
        if alias is None:
            return None
        engine = scheduler.engine
        loader = WeightLoader(self.connection, engine.parameter_spec())
        return Controller(ControlChannel(self.connection, alias, self.name), loader, engine.weight_version)

    def _build_scheduler(self) -> BatchScheduler:
        if self._scheduler_factory is not None:
            return self._scheduler_factory(self.settings, self.name)
        from worker.loading import build_scheduler

        return build_scheduler(self.settings, self.name)

    def _quietly(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as exc:  # stopping with Redis away: nothing more to do
            self.log.debug("Worker %s: %r while stopping", self.name, exc)

    # --- what the loop asks of RQ (worker/batch_loop.py WorkerSide) ------------------------
    def notice_stop(self) -> None:
        """Write the worker's `shutdown_requested_date` (what rq's handler writes for a busy worker),
        once, from the loop: a Redis call inside the signal handler could interrupt another."""
        if self._stop_requested and not self._stop_recorded and self._shutdown_requested_date is not None:
            self._stop_recorded = True
            self._quietly(self.set_shutdown_requested_date)

    def take_stop_job_ids(self) -> set[str]:
        with self._stop_job_lock:
            ids, self._stop_job_ids = self._stop_job_ids, set()
        return ids

    def idle(self, burst: bool) -> None:
        self.check_for_suspension(burst)
        self.set_state(WorkerStatus.IDLE)
        self.procline("Listening on " + ",".join(self.queue_names()))
        self.heartbeat()

    def beat_now(self) -> None:
        self._liveness.beat_now()

    def start_jobs(self, taken: list[TakenJob], weight_version: int
                   ) -> tuple[list[StartedJob], list[tuple[Unreadable, Queue]]]:
        """Read the jobs taken (worker/intake.py) and record the start of those that read, the RQ way
        (execution, started registry, status, heartbeats: what `prepare_execution` and
        `prepare_job_execution` write), all in one round trip. A job that asks for newer weights
        than `weight_version` goes back to the head of its queue, which the worker then leaves alone
        until its weights change."""
        started: list[tuple[Job, Queue, list[str]]] = []
        unreadable: list[tuple[Unreadable, Queue]] = []
        too_new: list[tuple[Job, int]] = []
        for item in taken:
            queue = self.queues[item.queue_index]
            read = read_job(item.raw_id, item.fields, self.connection, self.settings.max_job_bytes)
            if isinstance(read, Unreadable):
                unreadable.append((read, queue))
            elif _wanted_version(read) > weight_version:
                too_new.append((read, item.queue_index))
            else:
                assert isinstance(item.fields, dict)
                started.append((read, queue, callback_names(item.fields)))
        if too_new:
            self._put_back(too_new)
        if not started:
            return [], unreadable
        ttl = self.settings.heartbeat_ttl_s
        batch = CommandBatch(self.connection)
        executions, cancel_replies = [], []
        for job, queue, _ in started:
            executions.append(create_execution(job, ttl, batch, self.name, self._registries))
            job.prepare_for_execution(self.name, pipeline=batch)  # status, started_at, heartbeat
            batch.lrem(queue.intermediate_queue.key, 1, job.id)
            batch.persist(job.key)  # as Job.perform does: a job with ttl= must not expire mid-run
            batch.exists(keys.cancel_key(job.id))
            cancel_replies.append(len(batch) - 1)
        batch.sadd(self._poller.running_key, *(job.id for job, _, _ in started))
        self.set_state(WorkerStatus.BUSY, pipeline=batch)
        self.set_current_job_id(started[-1][0].id, pipeline=batch)
        self.set_current_job_working_time(0, pipeline=batch)
        self.heartbeat(ttl, pipeline=batch)
        batch.expire(self._poller.running_key, ttl)
        replies = batch.execute()
        assert replies is not None
        return [self._started(job, queue, callbacks, execution, bool(replies[at]))
                for (job, queue, callbacks), execution, at in zip(started, executions, cancel_replies)], unreadable

    def _put_back(self, too_new: list[tuple[Job, int]]) -> None:
        """Jobs for newer weights back to the head of their queues, in their order."""
        batch = CommandBatch(self.connection)
        for job, index in reversed(too_new):
            queue = self.queues[index]
            batch.lrem(queue.intermediate_queue.key, 1, job.id)
            batch.lpush(queue.key, job.id)
        self._poller.ended([job.id for job, _ in too_new])
        batch.execute()
        assert self._queues is not None
        self._queues.hold(index for _, index in too_new)

    def _started(self, job: Job, queue: Queue, callbacks: list[str], execution: Execution, cancelled: bool
                 ) -> StartedJob:
        refused = refusal(job, callbacks, self.settings.callback_allowlist)
        inflight = InFlight(job, queue, execution, deadline=None)
        if refused is None:
            inflight.callbacks_allowed = True
            inflight.payload = job.kwargs["request"]
            inflight.solo = bool(job.meta.get(SOLO_META))
        timeout = job.timeout if job.timeout is not None else self.queue_class.DEFAULT_TIMEOUT
        enqueued_at = job.enqueued_at.timestamp() if isinstance(job.enqueued_at, datetime) else None
        return StartedJob(inflight, enqueued_at, timeout, refused, cancelled)

    # The rest runs on the bookkeeping thread.
    def run_maintenance(self) -> None:
        self.run_maintenance_tasks()

    def sweep(self, running: frozenset[str]) -> None:
        self._housekeeping.sweep(running)

    def enqueue_due_retries(self) -> None:
        self._housekeeping.enqueue_due_retries()

    # --- a job's end in RQ's terms (worker/job_ending.py RQEnds) ----------------------------
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
                self.log.exception("Job %s: success callback failed", job.id)
            successes.append(Success(job, ending.execution, return_value))
        left = {id(s.job) for s in end_successes(self, successes, self._registries, pause=pause)}
        for ending, success in zip(endings, successes):
            if id(success.job) in left:  # rq's own path: dependents to enqueue
                success.job._result = success.return_value
                with self._as_current(ending.execution):
                    self.handle_job_success(job=success.job, queue=ending.queue,
                                            started_job_registry=ending.queue.started_job_registry)

    def finish_failure(self, ending: Ending, result: GenerationResult) -> None:
        """End a failed or cancelled RQ job the way `perform_job` would, after its result key is
        written; a refused job's callbacks never run. Callbacks get a thread-safe timeout."""
        job, queue = ending.job, ending.queue
        job.ended_at = now()
        with self._as_current(ending.execution):
            if result.status == "cancelled":
                self._stopped_job_id = job.id  # RQ's own marker: status STOPPED, no retry
                if ending.callbacks_allowed:
                    with contextlib.suppress(Exception):
                        job.execute_stopped_callback(TimerDeathPenalty)
                self.handle_job_failure(job=job, queue=queue, exc_string="cancelled",
                                        started_job_registry=queue.started_job_registry)
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
            self.handle_job_failure(job=job, queue=queue, exc_string=f"{type(exc).__name__}: {exc}",
                                    started_job_registry=queue.started_job_registry)

    def requeue(self, ending: Ending, alone: bool) -> None:
        """Back to its queue without counting against its retries; `alone`: it runs alone next time."""
        job = ending.job
        job.meta[SOLO_META] = alone
        job.save_meta()
        self.connection.srem(self._poller.running_key, job.id)
        job.ended_at = now()
        with self._as_current(ending.execution):
            self.handle_job_retry(job=job, queue=ending.queue, retry=Retry(max=(job.number_of_retries or 0) + 1),
                                  started_job_registry=ending.queue.started_job_registry, execution=ending.execution)

    @contextlib.contextmanager
    def _as_current(self, execution: Execution) -> Iterator[None]:
        """rq's handlers read the job's execution from `self.execution`; only the bookkeeping thread
        calls them (maintenance included), one job at a time."""
        self.execution = execution
        try:
            yield
        finally:
            self.execution = None

    # --- the liveness thread ---------------------------------------------------------------
    def _beat(self) -> None:
        """Refresh the worker's entry in the live-worker list and, while it runs jobs, its own and
        every running job's heartbeat."""
        loop = self._loop
        if loop is None:
            return
        running = loop.running
        if self._presence is not None:
            self._presence.refresh(running=len(running), sequences=loop.scheduler.num_sequences)
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
