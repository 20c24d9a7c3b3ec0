"""Whether Redis is answering, for the batch loop and the bookkeeping thread alike.

Whichever thread loses Redis first marks it down and logs once; whichever sees it answer first marks
it up and logs once. While it is down the loop probes it on an exponential backoff (decoding goes
on) and bookkeeping waits the same backoff between attempts of the task it is retrying.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import redis

from schemas import broker

log = logging.getLogger("mlxq.worker")

REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
# A backoff is slept in slices this long, so a stop request ends it within one slice.
WAKE_SLICE_S = 0.1


def _sleep_unless(delay: float, stop_waiting: Optional[Callable[[], bool]]) -> None:
    """Sleep `delay` seconds, or less once `stop_waiting()` says so (checked every WAKE_SLICE_S)."""
    deadline = time.monotonic() + delay
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or (stop_waiting is not None and stop_waiting()):
            return
        time.sleep(min(left, WAKE_SLICE_S))


class RedisHealth:
    def __init__(self, connection: redis.Redis, first_backoff_s: float = 0.5, max_backoff_s: float = 15.0,
                 probe_timeout_s: float = 2.0) -> None:
        # Probes use their own short-timeout client: on a silent network a probe must not block
        # decoding for the worker connection's long (blocking-dequeue-sized) socket timeout.
        self._probe = broker.sibling(connection, socket_timeout=probe_timeout_s,
                                     socket_connect_timeout=probe_timeout_s)
        self._first, self._max = first_backoff_s, max_backoff_s
        self._backoff = first_backoff_s
        self._next_try = 0.0
        self._lock = threading.Lock()
        self.down_since: Optional[float] = None
        self.losses = 0  # times Redis went away (a metric)
        self.back_at = 0.0  # Unix seconds Redis last came back after being lost (0: never lost)

    @property
    def up(self) -> bool:
        return self.down_since is None

    def lapsed(self) -> None:
        """Heartbeats could not get through for longer than their TTL (a silent network holds calls
        without failing them): count it as Redis having been away until now."""
        with self._lock:
            self.back_at = time.time()

    def lost_since(self, started_at: float) -> bool:
        """Whether Redis was away at some time after `started_at` (Unix seconds): then the heartbeats
        of a job started then may have lapsed, and another worker's sweep may have taken it."""
        return self.down_since is not None or self.back_at >= started_at

    def lost(self, exc: BaseException) -> None:
        with self._lock:
            if self.down_since is not None:
                return
            self.down_since = time.monotonic()
            self.losses += 1
            self._backoff = self._first
            self._next_try = self.down_since + self._backoff
        log.error("lost Redis (%r): decoding goes on; results are kept until it is back", exc)

    def answered(self) -> None:
        """A call went through: Redis is back, if it was away."""
        with self._lock:
            if self.down_since is None:
                return
            since, self.down_since = self.down_since, None
            self.back_at = time.time()
        log.warning("Redis is back after %.1f s", time.monotonic() - since)

    def try_reconnect(self, wait: bool = False, stop_waiting: Optional[Callable[[], bool]] = None) -> bool:
        """Ping when the backoff allows (sleeping until then if `wait`, unless `stop_waiting()` turns
        true meanwhile). True if Redis is back."""
        if self.down_since is None:
            return True
        delay = self._next_try - time.monotonic()
        if delay > 0:
            if not wait:
                return False
            _sleep_unless(delay, stop_waiting)
            if time.monotonic() < self._next_try:
                return False  # woken early: the caller is stopping
        try:
            self._probe.ping()
        except REDIS_ERRORS:
            self._grow_backoff()
            return False
        self.answered()
        return True

    def pause(self, stop_waiting: Optional[Callable[[], bool]] = None) -> None:
        """Wait out the current backoff before trying a failed call again (the bookkeeping thread),
        or less once `stop_waiting()` says the call is no longer worth retrying."""
        with self._lock:
            delay = self._backoff
        _sleep_unless(delay, stop_waiting)
        self._grow_backoff()

    def _grow_backoff(self) -> None:
        with self._lock:
            self._backoff = min(self._backoff * 2, self._max)
            self._next_try = time.monotonic() + self._backoff
