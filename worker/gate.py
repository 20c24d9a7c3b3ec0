"""The bookkeeping gate: when the bookkeeping thread keeps out of the batch loop's way.

Between two engine steps the loop makes one Redis round trip (new jobs, cancellations) and starts
the next step, so that window is part of every step's interval. Bookkeeping that ran in it (its
Python holding the GIL, a script of its own that Redis ran first) lengthened it several times over.
So while the loop's steps are long against its turns and spent mostly off its own CPU (StepRhythm),
bookkeeping waits at a LoopGate between steps and near a step's expected end, and cuts its Redis
calls into small ones (`per_call`). With near-free steps the gate stays open: held back from the
loop's turns, bookkeeping fell behind. The measurements behind each number are in
docs/design-notes.md ("The bookkeeping gate").
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Callable, Optional, TypeVar

# A step is long enough to gate from this, and only when it lasts this many times the loop's turn.
MIN_GATED_STEP_S = 0.002
GATED_STEP_TO_TURN = 4
# The longest a task waits at the gate; a phase in which it timed out holds it no more.
MAX_HOLD_S = 0.05
# Bookkeeping stops this long (at most a quarter of the step) before a step is expected to end: a
# script it sent then would still run in Redis when the loop's poll arrives.
END_MARGIN_S = 0.0015
# Jobs ended per Redis call while the gate is in force (Redis runs one call at a time, so the loop's
# poll can wait behind a bookkeeping script); otherwise one call takes them all.
RQ_ENDS_PER_CALL = 32
RESULTS_PER_CALL = 128

T = TypeVar("T")


class LoopGate:
    """Keeps bookkeeping out of the batch loop's way between two of its engine steps. Tasks call
    `wait` before each job's work and each Redis call; it returns while the loop is inside a step
    that is not about to end (as the loop expects it to last), or the loop is idle."""

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


class StepRhythm:
    """The loop's last few engine steps and the turns between them (the round trip that takes
    jobs, the hand-off of endings): whether bookkeeping should keep out of the turns (LoopGate),
    and how long the next step is expected to take.

    It should while the steps are long against the turns and the loop's thread spends most of
    each step off the CPU (the engine computing on other threads or the GPU, the GIL let go):
    bookkeeping then runs in the step at no cost to the loop. A step that is mostly the loop's
    own Python (a small model's decode on a big GPU is bound by the host) would only see the
    contention moved into it."""

    def __init__(self, min_step_s: float = MIN_GATED_STEP_S, step_to_turn: float = GATED_STEP_TO_TURN, keep: int = 4,
                 clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self._min_step_s, self._step_to_turn = min_step_s, step_to_turn
        self._clock, self._cpu_clock = clock, cpu_clock
        self._steps: deque[float] = deque(maxlen=keep)
        self._off_cpu: deque[float] = deque(maxlen=keep)  # each step's share off the CPU
        self._turns: deque[float] = deque(maxlen=keep)
        self._last_end: Optional[float] = None
        self._started = self._started_cpu = 0.0

    def step_started(self) -> Optional[float]:
        """A step begins: the length it is expected to have (the shortest of the last few: one that
        ended many jobs, or prefilled, runs long) if bookkeeping should keep out of the turns, else None."""
        self._started, self._started_cpu = self._clock(), self._cpu_clock()
        if self._last_end is not None:
            self._turns.append(self._started - self._last_end)
        return min(self._steps) if self.steady else None

    def step_ended(self) -> bool:
        """The step is over; whether bookkeeping should wait until the next one starts."""
        self._last_end = self._clock()
        took = self._last_end - self._started
        self._steps.append(took)
        self._off_cpu.append(1.0 - (self._cpu_clock() - self._started_cpu) / took if took > 0 else 0.0)
        return self.steady

    @property
    def steady(self) -> bool:
        if not self._steps or not self._turns:
            return False
        shortest = min(self._steps)
        return (shortest >= self._min_step_s and shortest >= self._step_to_turn * min(self._turns)
                and min(self._off_cpu) >= 0.5)


def per_call(pending: list[T], size: int, gate: LoopGate) -> Iterator[list[T]]:
    """`pending` a Redis call's worth at a time: `size` items while the gate is in force, else all.
    Each is dropped from `pending` once the caller is done with it, so a task retried after a lost
    connection goes on with the rest."""
    while pending:
        chunk = pending[:size] if gate.in_force else list(pending)
        yield chunk
        del pending[:len(chunk)]
