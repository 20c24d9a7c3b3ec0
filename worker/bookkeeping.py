"""The Redis side of ending jobs, on a thread of its own, so the engine never waits for it.

Tasks run in submission order (a job's stream deltas, then its result key, then its RQ end).
A task that meets a Redis connection error is retried with backoff until Redis answers: while
Redis is away, decoding goes on and finished work queues up here. Any other error is logged and
the task dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional

import redis

log = logging.getLogger("mlxq.worker")

Task = Callable[[], None]


class Bookkeeper:
    def __init__(self, first_backoff_s: float = 0.25, max_backoff_s: float = 15.0) -> None:
        self._tasks: "queue.Queue[Optional[Task]]" = queue.Queue()
        self._pending = 0
        self._lock = threading.Condition()
        self._first, self._max = first_backoff_s, max_backoff_s
        self._thread = threading.Thread(target=self._run, name="mlxq-bookkeeping", daemon=True)
        self.redis_down_since: Optional[float] = None

    def start(self) -> "Bookkeeper":
        self._thread.start()
        return self

    def submit(self, task: Task) -> None:
        with self._lock:
            self._pending += 1
        self._tasks.put(task)

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._pending == 0

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self._pending == 0, timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what was submitted (for at most `timeout` seconds), then end the thread."""
        self.wait_idle(timeout)
        self._tasks.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
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
