"""BatchWorker: an RQ worker whose jobs run together in a continuous batch.

An RQ `SimpleWorker` (no fork: the model stays loaded, and fork after MLX starts is unsafe on
macOS). This class is RQ's side only: its hooks (signals, stop-job commands, maintenance) and the
run's set-up and tear-down; a job's start and end in RQ's terms are worker/rq_jobs.py's. The turns
themselves are the batch loop's (worker/batch_loop.py), the Redis side of ending jobs runs on the
bookkeeping thread (worker/job_ending.py), heartbeats on the liveness thread (worker/liveness.py).
It knows nothing of MLX; the scheduler knows nothing of Redis.
"""

from __future__ import annotations

import faulthandler
import gc
import signal
import socket
import threading
import time
import uuid
from types import FrameType
from typing import Any, Callable, Optional

import redis
from rq import Queue, SimpleWorker
from rq.command import parse_payload
from rq.exceptions import StopRequested
from rq.job import Job
from rq.utils import now
from rq.worker import WorkerStatus
from rq.worker.base import DequeueStrategy

from schemas import keys
from schemas.command_batch import CommandBatch
from schemas.redis_busy import busy_as_outage
from schemas.serializer import JSON_SERIALIZER
from worker.allowlist import ALLOWED_FUNCTIONS
from worker.batch_loop import BatchLoop
from worker.bookkeeping import Bookkeeper
from worker.control import ControlChannel, Controller
from worker.intake import Unreadable
from worker.job_ending import JobEnding
from worker.liveness import Liveness
from worker.loading import ModelLoadError
from worker.loop_interfaces import InFlight, StartedJob
from worker.metrics import WorkerMetrics, scheduler_gauges
from worker.poll import Poller, TakenJob, WorkerQueues
from worker.presence import PresencePublisher
from worker.recovery import Housekeeping
from worker.redis_health import REDIS_ERRORS, RedisHealth
from worker.rq_batch import Registries
from worker.rq_jobs import RQJobs
from worker.scheduler import BatchScheduler
from worker.settings import WorkerSettings
from worker.weights import WeightLoader

PUBSUB_ROUND_S = 0.2  # how long rq's command thread blocks in one read
PUBSUB_STOP_WAIT_S = 5.0


def default_worker_name() -> str:
    """`<host>.<6 hex digits>`: which machine it runs on, at a glance (rq's default is 32 hex digits)."""
    host = socket.gethostname().split(".")[0] or "worker"
    return f"{host}.{uuid.uuid4().hex[:6]}"


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
        if not kwargs.get("name"):
            kwargs["name"] = default_worker_name()
        self.settings = settings or WorkerSettings.from_env()
        if queues is None:
            queues = self.settings.default_queues()
        kwargs.setdefault("maintenance_interval", int(self.settings.sweep_interval_s))
        if kwargs.get("connection") is not None:  # a server busy with a script is away, not an error
            kwargs["connection"] = busy_as_outage(kwargs["connection"])
        super().__init__(queues, *args, **kwargs)
        self._scheduler_factory = scheduler_factory
        self._registries = Registries(self)
        self._health = RedisHealth(self.connection)
        self._bookkeeper = Bookkeeper(self._health)
        self._metrics = self._start_metrics() if self.settings.metrics_port is not None else None
        self._poller = Poller(self.connection, self.name, self.settings.group, self.settings.heartbeat_ttl_s,
                              self.settings.max_job_bytes)
        self._jobs = RQJobs(self, self._poller, self._registries, self.settings)
        self._ending = JobEnding(self.connection, self._bookkeeper, self._jobs, self.settings, self.name,
                                 self._metrics, health=self._health, registries=self._registries)
        self._housekeeping = Housekeeping(self.connection, self.queues, self.settings, self._ending.refuse_now)
        self._liveness = Liveness(self.settings.heartbeat_interval_s, self.settings.step_timeout_s, self._beat)
        self._loop: Optional[BatchLoop] = None
        self._queues: Optional[WorkerQueues] = None
        self._controller: Optional[Controller] = None
        self._loop_started = False  # until then a warm stop may interrupt (model loading), as in rq
        self._presence: Optional[PresencePublisher] = None
        self._stop_job_ids: set[str] = set()  # written by rq's pubsub thread, taken by the loop
        self._stop_job_lock = threading.Lock()
        self._stop_recorded = False
        self._beat_ok_at = 0.0  # time.time() the last heartbeat went through (the liveness thread's)

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

    def subscribe(self) -> None:
        """rq's command thread, in short reads: rq's own reads for 60 s, and since redis-py 8.2 a stop
        that raced the thread's read of the unsubscribe reply waited out that read."""
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=PUBSUB_ROUND_S, daemon=True, exception_handler=self._on_pubsub_error)

    def unsubscribe(self) -> None:
        """As rq's, but the thread closes its pub/sub connection itself as it ends: rq closed it from
        here as well, after waiting a second for the thread, and the two closes raced (AttributeError
        in redis-py's reset, exit code 1) when the thread ended just then."""
        if self.pubsub_thread is None:
            return
        self.log.info("Worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
        self.pubsub.unsubscribe()
        self.pubsub_thread.stop()
        self.pubsub_thread.join(timeout=PUBSUB_STOP_WAIT_S)

    def _on_pubsub_error(self, exc: BaseException, pubsub: Any, thread: Any) -> None:
        """As rq does: a lost connection is retried (redis-py resubscribes), anything else ends the thread."""
        if not isinstance(exc, redis.exceptions.ConnectionError):
            self.log.warning("Worker %s: pubsub thread exiting on %s", self.name, exc)
            raise exc
        self.log.error("Worker %s: pubsub lost Redis (%s), retrying in 2 s", self.name, exc)
        time.sleep(2.0)

    def clean_registries(self) -> None:
        """rq's maintenance, made safe (on the bookkeeping thread): rq's own registry and
        intermediate-list cleanups read every job hash they meet and would raise on one a producer
        wrote by hand, so the sweep (worker/recovery.py) takes those out first, and nothing rq
        raises stops the worker."""
        running = frozenset(self._loop.running_ids() if self._loop else ())

        def rq_maintenance() -> None:  # under the sweep lock: rq's started-registry cleanup retries jobs too
            try:
                super(BatchWorker, self).clean_registries()
            except Exception:
                self.log.exception("Worker %s: rq's registry cleanup failed; the next pass tries again", self.name)

        self._housekeeping.sweep(running, then=rq_maintenance)

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
        # First: a SIGTERM while rq registers the worker (its name is listed from there on) is a warm
        # stop like any other; before, it met Python's default handler and the process died of it.
        self._install_signal_handlers()
        taken = 0
        try:
            self.bootstrap(logging_level, date_format, log_format)
            # `kill -USR1 <pid>` prints every thread's stack (at once, even with the loop stuck in a step)
            # and then, from the loop's thread, the jobs in flight: what a worker that will not stop is doing.
            signal.signal(signal.SIGUSR1, self._log_in_flight)
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
            self._dequeue_strategy = dequeue_strategy
            if with_scheduler:
                self._start_scheduler(burst, logging_level, date_format, log_format)
            scheduler = self._build_scheduler()
            # What is alive now (the model, the libraries) stays alive: keep it out of the cyclic
            # collector, whose full passes over it stalled steps by tens of ms.
            gc.collect()
            gc.freeze()
            self._presence = PresencePublisher(self.connection, self.name, self.settings, self.queue_names(),
                                               kind="fake" if self.settings.engine == "fake" else "text")
            self._queues = WorkerQueues(self._poller, [(q.key, q.intermediate_queue.key) for q in self.queues],
                                        self.job_class.key_for(""))
            self._jobs.queues = self._queues
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
            self._bookkeeper.stop(self.settings.stop_grace_s)
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

    def _log_in_flight(self, signum: int, frame: Optional[FrameType]) -> None:
        loop = self._loop
        self.log.warning("Worker %s: jobs in flight: %s", self.name, loop.describe_in_flight() if loop else "none")

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

    # --- what the loop asks of RQ (worker/loop_interfaces.py WorkerSide) -------------------
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
        return self._jobs.start_jobs(taken, weight_version)

    def drop_taken(self, taken: list[TakenJob], running: list[InFlight]) -> None:
        self._jobs.drop_taken(taken, running)

    # The rest runs on the bookkeeping thread.
    def run_maintenance(self) -> None:
        self.run_maintenance_tasks()

    def sweep(self, running: frozenset[str]) -> None:
        self._housekeeping.sweep(running)

    def enqueue_due_retries(self) -> None:
        self._housekeeping.enqueue_due_retries()

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
        if running:
            ttl = self.settings.heartbeat_ttl_s
            batch = CommandBatch(self.connection)
            self.heartbeat(ttl, pipeline=batch)
            batch.expire(self._poller.running_key, ttl)
            for inflight in running:
                inflight.execution.heartbeat(self._registries.started(inflight.job.origin), ttl, pipeline=batch)
                inflight.job.heartbeat(now(), ttl, pipeline=batch, xx=True)
            batch.execute()
        self._beat_went_through()

    def _beat_went_through(self) -> None:
        """A heartbeat that got through long after the one before: the jobs' entries may have expired
        meanwhile, and another worker's sweep taken them (their endings are checked: worker/job_ending.py)."""
        at, before = time.time(), self._beat_ok_at
        self._beat_ok_at = at
        if before and at - before > self.settings.heartbeat_ttl_s - self.settings.heartbeat_interval_s:
            self._health.lapsed()
