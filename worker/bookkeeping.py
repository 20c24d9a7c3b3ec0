"""The Redis side of ending jobs, on a thread of its own, so the engine never waits for it.

Tasks run in submission order (a job's stream deltas, then its result key, then its RQ end).
A task that meets a Redis connection error is retried with backoff until Redis answers: while
Redis is away, decoding goes on and finished work queues up here. Any other error is logged and
the task dropped.

Tasks keep out of the batch loop's way between its engine steps (`LoopGate`).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from typing import Callable, Optional

import redis

log = logging.getLogger("mlxq.worker")

Task = Callable[[], None]

# The longest a task waits at the gate; a phase in which it timed out holds it no more.
MAX_HOLD_S = 0.05
# Bookkeeping stops this long (at most a quarter of the step) before a step is expected to end:
# a script it sends then would still run in Redis when the loop's poll arrives (one of
# RQ_ENDS_PER_CALL rq endings took ~1 ms there), and its Python would hold the GIL as the step
# hands back.
END_MARGIN_S = 0.0015


class LoopGate:
    """Keeps bookkeeping out of the batch loop's way between two of its engine steps.

    Between steps the loop makes one Redis round trip (new jobs, cancellations) and starts the
    next step, so that window is part of every step's interval. Bookkeeping in it lengthened
    the window twice over (256 results published in one step, fake 10 ms steps, 2-core CPU: the
    next round trip took 2-5 ms instead of 0.1-0.5 ms, once 7 ms): its Python held the GIL each
    time the round trip let go of it, and a script of its own that Redis was running made the
    loop's poll queue behind it. Tasks call `wait` before each job's work and each Redis call;
    it returns while the loop is inside a step that is not about to end (as the loop expects it
    to last), or the loop is idle."""

    def __init__(self, max_hold_s: float = MAX_HOLD_S) -> None:
        self._max_hold_s = max_hold_s
        self._cond = threading.Condition()
        self._phase = 0  # changes whenever the loop enters or leaves a step
        self._between = False  # the loop is between two steps
        self._hold_from = math.inf  # inside a step: when its expected end is near
        self._free_phase = -1  # a phase in which a wait timed out
        # Whether the loop keeps bookkeeping out of its turns at all: only then is it worth cutting
        # bookkeeping's Redis calls short, at the cost of more of them.
        self.in_force = False

    def step_started(self, expected_s: Optional[float]) -> None:
        """The loop enters a step expected to last `expected_s` (None: no gating in this step)."""
        hold_from = math.inf
        if expected_s:
            hold_from = time.perf_counter() + expected_s - min(END_MARGIN_S, expected_s / 4)
        self.in_force = expected_s is not None
        self._move(between=False, hold_from=hold_from)

    def step_ended(self) -> None:
        """The loop is between steps until the next `step_started`."""
        self._move(between=True, hold_from=math.inf)

    def release(self) -> None:
        """No step to keep out of the way of (the loop is idle, or waits for bookkeeping)."""
        self.in_force = False
        self._move(between=False, hold_from=math.inf)

    def wait(self) -> None:
        if self._clear() or self._phase == self._free_phase:
            return
        with self._cond:
            phase = self._phase
            if not self._cond.wait_for(lambda: self._phase != phase and self._clear(), self._max_hold_s):
                self._free_phase = self._phase

    @property
    def between_steps(self) -> bool:
        return self._between

    def _clear(self) -> bool:
        return not self._between and time.perf_counter() < self._hold_from

    def _move(self, between: bool, hold_from: float) -> None:
        with self._cond:
            self._phase += 1
            self._between, self._hold_from = between, hold_from
            self._cond.notify_all()


class Bookkeeper:
    def __init__(self, first_backoff_s: float = 0.25, max_backoff_s: float = 15.0) -> None:
        self._tasks: "queue.Queue[Optional[Task]]" = queue.Queue()
        self._pending = 0
        self._lock = threading.Condition()
        self._first, self._max = first_backoff_s, max_backoff_s
        self._thread = threading.Thread(target=self._run, name="mlxq-bookkeeping", daemon=True)
        self.redis_down_since: Optional[float] = None
        self.gate = LoopGate()
        self._held: deque[Task] = deque()  # submitted between two steps of the loop

    def start(self) -> "Bookkeeper":
        self._thread.start()
        return self

    def submit(self, task: Task) -> None:
        """Queue a task. Between two of the loop's steps it is held until the next step starts:
        woken then, the thread took the GIL from the loop's round trip just to wait at the gate
        (the GIL's switch interval, 0.5 ms, at a time)."""
        with self._lock:
            self._pending += 1
        if self.gate.between_steps:
            self._held.append(task)
        else:
            self._tasks.put(task)

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

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what was submitted (for at most `timeout` seconds), then end the thread."""
        if self._thread.ident is None:  # never started when the model failed to load
            return
        self.wait_idle(timeout)
        self._tasks.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            self.gate.wait()
            self._run_until_done(task)
            with self._lock:
                self._pending -= 1
                self._lock.notify_all()

    def _run_until_done(self, task: Task) -> None:
        backoff = self._first
        while True:
            try:
                task()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self.redis_down_since is None:
                    self.redis_down_since = time.monotonic()
                    log.error("lost Redis (%r): decoding goes on; results are kept until it is back", exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, self._max)
                continue
            except Exception:
                log.exception("bookkeeping task failed; the job is left to the abandoned-job sweep")
            if self.redis_down_since is not None:
                log.warning("Redis is back after %.1f s", time.monotonic() - self.redis_down_since)
                self.redis_down_since = None
            return
