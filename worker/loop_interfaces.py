"""What the batch loop (worker/batch_loop.py) and the RQ side exchange.

The records of a started job: `StartedJob`, what the RQ side's start of a job (worker/rq_jobs.py)
hands the loop, and `InFlight`, the loop's own record of it while it runs (the loop alone writes its
table of them). And what the loop asks of the others: `JobSource`, where jobs come from
(worker/poll.py), and `WorkerSide`, the RQ worker around it (worker/rq_worker.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from rq import Queue
from rq.executions import Execution
from rq.job import Job

from worker.allowlist import Refusal
from worker.intake import Unreadable
from worker.job_ending import Ending
from worker.output import EndedJob
from worker.poll import Poll, TakenJob


@dataclass
class InFlight:
    """A job the worker has started and not yet fully ended: the loop's own record of it."""

    job: Job
    queue: Queue
    execution: Execution
    deadline: Optional[float]  # on the loop's clock; None = no timeout
    payload: Any = None
    solo: bool = False  # re-queued after an engine failure: it runs alone
    callbacks_allowed: bool = False  # its function and callbacks passed the allowlist
    ending: bool = False  # handed to the bookkeeping thread
    # Sent back to its queue to run again: its id taken off a queue now is that run, not a copy.
    sent_back: bool = False

    @property
    def streams(self) -> bool:
        return isinstance(self.payload, dict) and self.payload.get("stream") is True

    def ending_record(self, ended: Optional[EndedJob]) -> Ending:
        return Ending(ended, self.job, self.queue, self.execution, self.streams, self.callbacks_allowed, self,
                      time.monotonic())


@dataclass(frozen=True)
class StartedJob:
    """A job whose start RQ has recorded, and what the loop should do with it."""

    inflight: InFlight
    enqueued_at: Optional[float]
    timeout: Optional[int]  # seconds; None or <= 0: none
    refusal: Optional[Refusal]  # it may not run here
    cancelled: bool  # its cancel key was set before it started


class JobSource(Protocol):
    """Where jobs come from (worker/poll.py's Poller)."""

    def poll(self, room: int, check_cancels: bool) -> Poll: ...

    def wait(self, timeout_s: float) -> Optional[TakenJob]: ...

    def started(self, job_ids: list[str]) -> None: ...

    def ended(self, job_ids: list[str]) -> None: ...

    def stay_in_group(self) -> None: ...

    def version_changed(self) -> None:
        """The weights changed: queues held back for jobs that wanted a newer version are polled again."""
        ...


class WorkerSide(Protocol):
    """What the loop needs of the RQ worker around it (worker/rq_worker.py's BatchWorker)."""

    @property
    def stop_requested(self) -> bool: ...

    def start_jobs(self, taken: list[TakenJob], weight_version: int
                   ) -> tuple[list[StartedJob], list[tuple[Unreadable, Queue]]]:
        """Start the jobs taken; those that cannot be read come back apart, and those that ask for a
        newer weight version than `weight_version` go back to their queues."""
        ...

    def drop_taken(self, taken: list[TakenJob], running: list[InFlight]) -> None:
        """Entries taken off a queue that are not to run (their job runs here already): out of their
        intermediate lists, logged; `running`, those jobs' runs here, recorded as running again."""
        ...

    def notice_stop(self) -> None:
        """Record a warm stop request in RQ's worker hash, once (not from the signal handler)."""
        ...

    def take_stop_job_ids(self) -> set[str]:
        """Job ids RQ's stop-job command named since the last call."""
        ...

    def idle(self, burst: bool) -> None:
        """Nothing is in flight: RQ's idle state and heartbeat; wait out a suspension."""
        ...

    def beat_now(self) -> None:
        """Refresh the running jobs' heartbeats now (Redis is back)."""
        ...

    # Called on the bookkeeping thread:
    def run_maintenance(self) -> None: ...

    def sweep(self, running: frozenset[str]) -> None: ...

    def enqueue_due_retries(self) -> None: ...
