"""BatchWorker: RQ lifecycle around a continuous-batching scheduler.

An RQ `SimpleWorker` (no fork: the model stays loaded, and fork after MLX starts is unsafe on
macOS) whose loop keeps many jobs running at once. It takes every waiting job while it has
room, starts each the RQ way, steps the scheduler, and ends each job the RQ way as its result
lands. It knows nothing of MLX; the scheduler knows nothing of Redis.

RQ's per-job helpers read the single `self.execution`; `_as_current` sets it around each call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterator, Optional

import redis
from rq import Queue, SimpleWorker
from rq.command import parse_payload
from rq.exceptions import DeserializationError, StopRequested
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.timeouts import JobTimeoutException
from rq.utils import now
from rq.worker.base import DequeueStrategy

from schemas import GenerationResult, keys
from worker.publish import cancel_requested, publish_results, result_ttl
from worker.settings import WorkerSettings

log = logging.getLogger("mlxq.worker")

CALLBACK_FIELDS = ("success_callback_name", "failure_callback_name", "stopped_callback_name")


class JobFailed(Exception):
    """Carries a failed GenerationResult's error into RQ's failure path (callbacks, exc_info)."""


@dataclass
class InFlight:
    job: Job
    queue: Queue
    execution: Execution
    deadline: Optional[float]  # monotonic; None = no timeout


class BatchWorker(SimpleWorker):
    allowed_functions = frozenset({keys.JOB_FUNCTION})

    def __init__(
        self,
        queues: Any = None,
        *args: Any,
        settings: Optional[WorkerSettings] = None,
        scheduler_factory: Optional[Callable[[WorkerSettings, str], Any]] = None,
        **kwargs: Any,
    ) -> None:
        kwargs["serializer"] = JSONSerializer  # never pickle, whatever the command line said
        self.settings = settings or WorkerSettings.from_env()
        if queues is None:
            queues = self.settings.default_queues()
        super().__init__(queues, *args, **kwargs)
        self._scheduler_factory = scheduler_factory
        self.scheduler_: Any = None  # rq's BaseWorker already uses `self.scheduler`
        self._inflight: dict[str, InFlight] = {}
        self._stop_job_ids: set[str] = set()
        self._stop_job_lock = threading.Lock()
        self._last_heartbeat = 0.0

    # --- RQ hooks -------------------------------------------------------------------------
    def get_heartbeat_ttl(self, job: Job) -> int:
        # Short, and refreshed every heartbeat_interval_s while the batch makes progress, so a
        # killed worker's jobs are noticed within about a minute.
        return int(self.settings.heartbeat_interval_s) + 60

    def handle_payload(self, message: Any) -> None:
        """RQ's stop-job command only knows one current job: flag any of ours for the loop."""
        payload = parse_payload(message)
        if payload.get("command") == "stop-job" and payload.get("job_id"):
            with self._stop_job_lock:
                self._stop_job_ids.add(payload["job_id"])
            return
        super().handle_payload(message)

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
        taken = 0
        try:
            self.scheduler_ = self._build_scheduler()
            while True:
                if not self._inflight:
                    self.check_for_suspension(burst)
                    if self.should_run_maintenance_tasks:
                        self.run_maintenance_tasks()
                    if self._stop_requested or (max_jobs is not None and taken >= max_jobs):
                        break
                    if burst:
                        if not self._top_up(1):
                            break
                    else:
                        dequeued = self.dequeue_job_and_maintain_ttl(self.dequeue_timeout, max_idle_time)
                        if dequeued is None:
                            break
                        self._start(*dequeued)
                    taken += 1
                if not self._stop_requested:
                    room = self.scheduler_.free_slots
                    if max_jobs is not None:
                        room = min(room, max_jobs - taken)
                    taken += self._top_up(room)
                self._step()
        except StopRequested:
            pass
        except SystemExit:
            self._abandon_inflight("worker received a cold shutdown")
            raise
        except Exception:
            self.log.exception("Worker %s: unhandled error in the batch loop", self.name)
            self._abandon_inflight("worker loop crashed")
            raise
        finally:
            self.teardown()
        return taken > 0

    def _build_scheduler(self) -> Any:
        if self._scheduler_factory is not None:
            return self._scheduler_factory(self.settings, self.name)
        from worker.loading import build_scheduler

        return build_scheduler(self.settings, self.name)

    def _top_up(self, room: int) -> int:
        """Take up to `room` waiting jobs without blocking; return how many were taken."""
        taken = 0
        while taken < room:
            dequeued = self.queue_class.dequeue_any(
                self._ordered_queues,
                None,
                connection=self.connection,
                job_class=self.job_class,
                serializer=self.serializer,
                death_penalty_class=self.death_penalty_class,
            )
            if dequeued is None:
                break
            self._start(*dequeued)
            taken += 1
        return taken

    def _step(self) -> None:
        if len(self.scheduler_):
            try:
                results = self.scheduler_.step()
            except Exception as exc:  # a broken step must not take the worker down
                self.log.exception("Worker %s: engine step failed", self.name)
                results = self.scheduler_.abort_all("EngineError", f"engine step failed: {exc!r}")
            self._end_many(results)
        self._enforce_cancellations_and_deadlines()
        self._maintain_heartbeats()

    # --- job start ------------------------------------------------------------------------
    def _start(self, job: Job, queue: Queue) -> None:
        self._begin_rq_execution(job, queue)
        enqueued_at = job.enqueued_at.timestamp() if isinstance(job.enqueued_at, datetime) else None
        try:
            failed = self._admit(job, enqueued_at)
        except Exception as exc:  # one bad job must never take the worker down
            self.log.exception("Worker %s: could not start job %s", self.name, job.id)
            failed = self.scheduler_.failed_result(job.id, None, "WorkerError", f"could not start: {exc!r}",
                                                   enqueued_at=enqueued_at)
        if failed is not None:
            self._end(failed)

    def _begin_rq_execution(self, job: Job, queue: Queue) -> None:
        execution = self.prepare_execution(job)
        try:
            self.prepare_job_execution(job, remove_from_intermediate_queue=len(self.queues) == 1)
        except DeserializationError:
            pass  # raised by its last line (a log of job.func_name), after the bookkeeping is written
        self.connection.persist(job.key)  # as Job.perform does: a job with ttl= must not expire mid-run
        job.started_at = now()
        timeout = job.timeout if job.timeout is not None else self.queue_class.DEFAULT_TIMEOUT
        deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
        self._inflight[job.id] = InFlight(job, queue, execution, deadline)
        self.execution = None

    def _admit(self, job: Job, enqueued_at: Optional[float]) -> Optional[GenerationResult]:
        """Hand the job to the scheduler; a result if it ended at once (refused, invalid, cancelled)."""
        refusal = self._refusal(job)
        if refusal is not None:
            error_type, message = refusal
            return self.scheduler_.failed_result(job.id, None, error_type, message, enqueued_at=enqueued_at,
                                                 started_at=time.time())
        payload = job.kwargs["request"]
        if self.connection.exists(keys.cancel_key(job.id)):
            return self._cancelled_before_start(job.id, payload, enqueued_at)
        return self.scheduler_.admit(job.id, payload, enqueued_at=enqueued_at)

    def _refusal(self, job: Job) -> Optional[tuple[str, str]]:
        """Why this job may not run here, or None. Nothing is ever unpickled."""
        try:
            func_name, args, kwargs = job.func_name, job.args, job.kwargs
        except DeserializationError:
            return (
                "DeserializationError",
                "job data is not valid JSON: mlxq workers read jobs with rq.serializers.JSONSerializer "
                "only and never unpickle",
            )
        if func_name not in self.allowed_functions:
            return (
                "FunctionNotAllowed",
                f"function {func_name!r} is not on this worker's allowlist {sorted(self.allowed_functions)}",
            )
        if args or set(kwargs) != {"request"}:
            return ("InvalidRequest", f"{keys.JOB_FUNCTION} takes exactly one keyword argument, `request`")
        callbacks = [
            name.decode() for name in self.connection.hmget(job.key, list(CALLBACK_FIELDS)) if name
        ]
        refused = [c for c in callbacks if not c.startswith(tuple(self.settings.callback_allowlist) or ("\0",))]
        if refused:
            return (
                "CallbackNotAllowed",
                f"callback {refused[0]!r} is not allowed on this worker (MLXQ_CALLBACK_ALLOWLIST)",
            )
        return None

    def _cancelled_before_start(self, job_id: str, payload: Any, enqueued_at: Optional[float]) -> GenerationResult:
        result = self.scheduler_.failed_result(job_id, payload, "Cancelled", "cancelled before it started",
                                               enqueued_at=enqueued_at)
        return result.model_copy(update={"status": "cancelled", "error": None})

    # --- job end --------------------------------------------------------------------------
    def _end_many(self, results: list[GenerationResult]) -> None:
        if not results:
            return
        self._publish(results)
        for result in results:
            self._finish_rq_job(result)

    def _end(self, result: GenerationResult) -> None:
        self._end_many([result])

    def _publish(self, results: list[GenerationResult]) -> None:
        final = []
        for result in results:
            job = self._inflight[result.id].job
            # A failed attempt that RQ will retry has not ended: its result key would mislead waiters.
            if result.status == "failed" and job.should_retry:
                continue
            final.append((result, result_ttl(job.result_ttl)))
        publish_results(self.connection, final)

    def _finish_rq_job(self, result: GenerationResult) -> None:
        """End the RQ job the way `perform_job` would, after its result key is written."""
        inflight = self._inflight.pop(result.id)
        job, queue = inflight.job, inflight.queue
        job.ended_at = now()
        with self._as_current(inflight):
            if result.status == "finished":
                job._status = JobStatus.FINISHED
                return_value = result.model_dump(mode="json")
                job._result = return_value
                try:
                    job.execute_success_callback(self.death_penalty_class, return_value)
                except Exception:
                    self.log.exception("Job %s: success callback failed", job.id)
                self.handle_job_success(job=job, queue=queue, started_job_registry=queue.started_job_registry)
                return
            if result.status == "cancelled":
                self._stopped_job_id = job.id  # RQ's own marker: status STOPPED, no retry
                with contextlib.suppress(Exception):
                    job.execute_stopped_callback(self.death_penalty_class)
                self.handle_job_failure(job=job, queue=queue, exc_string="cancelled",
                                        started_job_registry=queue.started_job_registry)
                return
            job._status = JobStatus.FAILED
            error = result.error
            exc: Exception = (
                JobTimeoutException(error.message) if error and error.type == "JobTimeoutException"
                else JobFailed(f"{error.type}: {error.message}" if error else "failed")
            )
            exc_string = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                job.execute_failure_callback(self.death_penalty_class, type(exc), exc, None)
            self.handle_job_failure(job=job, queue=queue, exc_string=exc_string,
                                    started_job_registry=queue.started_job_registry)

    @contextlib.contextmanager
    def _as_current(self, inflight: InFlight) -> Iterator[None]:
        self.execution = inflight.execution
        try:
            yield
        finally:
            self.execution = None

    def _abandon_inflight(self, reason: str) -> None:
        """Cold shutdown or a crash: fail (or, with Retry, requeue) every running job now."""
        if not self._inflight or self.scheduler_ is None:
            return
        with contextlib.suppress(Exception):
            results = self.scheduler_.abort_all("WorkerShutdown", reason)
            self._end_many(results)
        for job_id in list(self._inflight):  # jobs the scheduler never admitted
            with contextlib.suppress(Exception):
                self._end(self.scheduler_.failed_result(job_id, None, "WorkerShutdown", reason))

    # --- per-step housekeeping ------------------------------------------------------------
    def _enforce_cancellations_and_deadlines(self) -> None:
        if not self._inflight:
            return
        with self._stop_job_lock:
            stop_ids, self._stop_job_ids = self._stop_job_ids, set()
        try:
            cancelled = cancel_requested(self.connection, list(self._inflight)) | (stop_ids & set(self._inflight))
        except redis.ConnectionError:
            cancelled = stop_ids & set(self._inflight)
        ending = []
        for job_id in cancelled:
            result = self.scheduler_.cancel(job_id, "cancelled")
            if result is not None:
                ending.append(result)
        clock = time.monotonic()
        for job_id, inflight in list(self._inflight.items()):
            if job_id not in cancelled and inflight.deadline is not None and clock > inflight.deadline:
                result = self.scheduler_.cancel(job_id, "timeout")
                if result is not None:
                    ending.append(result)
        self._end_many(ending)

    def _maintain_heartbeats(self) -> None:
        if not self._inflight or time.monotonic() - self._last_heartbeat < self.settings.heartbeat_interval_s:
            return
        self._last_heartbeat = time.monotonic()
        with self.connection.pipeline() as pipe:
            self.heartbeat(int(self.settings.heartbeat_interval_s) + 60, pipeline=pipe)
            for inflight in self._inflight.values():
                ttl = self.get_heartbeat_ttl(inflight.job)
                inflight.execution.heartbeat(inflight.job.started_job_registry, ttl, pipeline=pipe)
                inflight.job.heartbeat(now(), ttl, pipeline=pipe, xx=True)
            pipe.execute()
