"""Where the batch loop's time goes, per section, summed since the worker started; and the
rhythm of its steps.

`lap(section)` charges the time since the previous lap to `section`; the loop laps after each of
its parts, so the sections add up to the loop's whole wall time. Published with the engine's own
counters in the worker's stats hash (`loop_<section>_s`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Optional


class LoopClock:
    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, section: str) -> None:
        now = time.perf_counter()
        self._seconds[section] = self._seconds.get(section, 0.0) + now - self._last
        self._last = now

    def as_dict(self) -> dict[str, Any]:
        return {f"{section}_s": seconds for section, seconds in self._seconds.items()}


class StepRhythm:
    """The loop's last few engine steps and the turns between them (the round trip that takes
    jobs, the hand-off of endings): whether bookkeeping should keep out of the turns
    (worker/bookkeeping.py, LoopGate), and how long the next step is expected to take.

    It should while the steps are long against the turns and the loop's thread spends most of
    each step off the CPU (the engine computing on other threads or the GPU, the GIL let go):
    bookkeeping then runs in the step at no cost to the loop. A step that is mostly the loop's
    own Python (a small model's decode on a big GPU is bound by the host) would only see the
    contention moved into it: on an H200, churn at 256 in flight, gated that way the decode
    steps took 23.1-25.0 ms against 21.9 ms."""

    def __init__(self, min_step_s: float, step_to_turn: float, keep: int = 4,
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
