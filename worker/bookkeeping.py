"""The bookkeeping thread: runs the Redis side of ending jobs (worker/job_ending.py) off the batch
loop, so the engine never waits for Redis.

Tasks run in submission order (a job's stream deltas, then its result key, then its RQ end). A task
that meets a Redis connection error is retried, after RedisHealth's backoff, until Redis answers:
while Redis is away, decoding goes on and finished work queues up here. Any other error is logged
and the task dropped. Tasks keep out of the loop's way between its engine steps (worker/gate.py).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Callable, Optional

from worker.gate import LoopGate
from worker.redis_health import REDIS_ERRORS, RedisHealth

log = logging.getLogger("mlxq.worker")

Task = Callable[[], None]
# A task and whether it is upkeep (retries, sweeps, rq's maintenance), which a stopping worker drops.
Queued = tuple[Task, bool]


class Bookkeeper:
    def __init__(self, health: RedisHealth, gate: Optional[LoopGate] = None) -> None:
        self._tasks: "queue.Queue[Optional[Queued]]" = queue.Queue()
        self._pending = 0
        self._lock = threading.Condition()
        self._health = health
        self._thread = threading.Thread(target=self._run, name="mlxq-bookkeeping", daemon=True)
        self.gate = gate or LoopGate()
        self._held: deque[Queued] = deque()  # submitted between two steps of the loop
        self._stopping = False
        self._given_up = False  # stopped with tasks left that Redis never took

    def start(self) -> "Bookkeeper":
        self._thread.start()
        return self

    def submit(self, task: Task, upkeep: bool = False) -> None:
        """Queue a task. Between two of the loop's steps it is held until the next step starts:
        woken then, the thread would take the GIL from the loop's round trip just to wait at the gate.
        An `upkeep` task is one a stopping worker may drop (a live worker does it again)."""
        with self._lock:
            self._pending += 1
        if self.gate.between_steps:
            self._held.append((task, upkeep))
        else:
            self._tasks.put((task, upkeep))

    def step_started(self, expected_s: Optional[float]) -> None:
        """The loop enters a step (LoopGate.step_started); held tasks go to the thread."""
        self.gate.step_started(expected_s)
        self._hand_held()

    def step_ended(self) -> None:
        self.gate.step_ended()

    def release(self) -> None:
        """The loop is idle or waits for bookkeeping (LoopGate.release)."""
        self.gate.release()
        self._hand_held()

    def _hand_held(self) -> None:
        while self._held:
            self._tasks.put(self._held.popleft())

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._pending == 0

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        self.release()  # the caller waits for the tasks: let them through
        with self._lock:
            return self._lock.wait_for(lambda: self._pending == 0, timeout)

    def give_up(self) -> None:
        """Retry nothing more: what Redis has not taken by now is dropped (a stopping worker whose
        grace for an unreachable Redis is over)."""
        self._given_up = True

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what was submitted (for at most `timeout` seconds), then end the thread. With Redis
        away, what is left after that is dropped: those jobs stay in RQ's started registry, where the
        abandoned-job sweep of a live worker retries or fails them."""
        if self._thread.ident is None:  # never started when the model failed to load
            return
        self._stopping = True
        # Once the loop's grace is over (give_up), a task asleep in its backoff is not waited for.
        if not self._given_up:
            if not self.idle and not self._health.up:
                log.warning("stopping with Redis unreachable: waiting up to %.0f s for it to take %d pending "
                            "bookkeeping tasks", timeout, self._pending)
            if not self.wait_idle(timeout):
                log.error("%d bookkeeping tasks were not done (Redis unreachable); their jobs are left to the "
                          "abandoned-job sweep", self._pending)
                self._given_up = True
        self._tasks.put(None)
        self._thread.join(timeout=0.5 if self._given_up else 5)

    def _run(self) -> None:
        while True:
            queued = self._tasks.get()
            if queued is None:
                return
            task, upkeep = queued
            if not (self._given_up or (upkeep and self._stopping)):
                self.gate.wait()
                self._run_until_done(task, upkeep)
            with self._lock:
                self._pending -= 1
                self._lock.notify_all()

    def _run_until_done(self, task: Task, upkeep: bool) -> None:
        def dropped() -> bool:
            return self._given_up or (upkeep and self._stopping)

        while True:
            try:
                task()
            except REDIS_ERRORS as exc:
                self._health.lost(exc)
                if not dropped():
                    self._health.pause(stop_waiting=dropped)  # a stop ends the backoff of a task it drops
                if dropped():
                    return
                continue
            except Exception:
                log.exception("bookkeeping task failed; the job is left to the abandoned-job sweep")
            self._health.answered()
            return
