"""Heartbeats and the step watchdog, on a thread of their own.

A long step (a big prefill) must not look like a dead worker, and a hung step must not look
alive forever. So the main loop only marks when a step starts and ends; this thread refreshes
the heartbeats of every running job every interval while the current step is younger than the
step timeout, and exits the process when a step outlives it: RQ's abandoned-job path (retry or
fail, run by any other worker's sweep) then takes over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Callable, Iterator, Optional

log = logging.getLogger("mlxq.worker")

WATCHDOG_EXIT_CODE = 70


class Liveness:
    def __init__(
        self,
        interval_s: float,
        step_timeout_s: float,
        beat: Callable[[], None],
        on_hang: Optional[Callable[[float], None]] = None,
    ) -> None:
        self.interval_s = interval_s
        self.step_timeout_s = step_timeout_s
        self._beat = beat
        self._on_hang = on_hang or _exit_on_hang
        self._step_started: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxq-liveness", daemon=True)

    def start(self) -> "Liveness":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # never started when the model failed to load
            self._thread.join(timeout=self.interval_s + 1)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._step_started = time.monotonic()
        try:
            yield
        finally:
            self._step_started = None

    def beat_now(self) -> None:
        self._safe_beat()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            started = self._step_started
            if started is not None and time.monotonic() - started > self.step_timeout_s:
                self._on_hang(time.monotonic() - started)
                continue
            self._safe_beat()

    def _safe_beat(self) -> None:
        try:
            self._beat()
        except Exception as exc:  # Redis away: the main loop handles reconnection
            log.debug("heartbeat failed: %r", exc)


def _exit_on_hang(elapsed: float) -> None:
    log.critical("engine step hung for %.0f s (MLXQ_STEP_TIMEOUT_S): exiting so the jobs are recovered", elapsed)
    logging.shutdown()
    os._exit(WATCHDOG_EXIT_CODE)
