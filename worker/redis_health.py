"""Whether Redis is answering, and when to ask it again (exponential backoff, capped)."""

from __future__ import annotations

import logging
import time
from typing import Optional

import redis

log = logging.getLogger("mlxq.worker")


class RedisHealth:
    def __init__(self, connection: redis.Redis, first_backoff_s: float = 0.5, max_backoff_s: float = 15.0,
                 probe_timeout_s: float = 2.0) -> None:
        # Probes use their own short-timeout client: on a silent network a probe must not block
        # decoding for the worker connection's long (blocking-dequeue-sized) socket timeout.
        kwargs = dict(connection.connection_pool.connection_kwargs)
        kwargs.update(socket_timeout=probe_timeout_s, socket_connect_timeout=probe_timeout_s)
        self._probe = redis.Redis(connection_pool=connection.connection_pool.__class__(
            connection_class=connection.connection_pool.connection_class, **kwargs))
        self._first = first_backoff_s
        self._max = max_backoff_s
        self._backoff = first_backoff_s
        self._next_try = 0.0
        self.down_since: Optional[float] = None

    @property
    def up(self) -> bool:
        return self.down_since is None

    def lost(self, exc: BaseException) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            self._backoff = self._first
            self._next_try = self.down_since + self._backoff
            log.error("lost Redis (%r): decoding goes on; results are kept until it is back", exc)

    def try_reconnect(self, wait: bool = False) -> bool:
        """Ping when the backoff allows (sleeping until then if `wait`). True if Redis is back."""
        if self.down_since is None:
            return True
        delay = self._next_try - time.monotonic()
        if delay > 0:
            if not wait:
                return False
            time.sleep(delay)
        try:
            self._probe.ping()
        except (redis.ConnectionError, redis.TimeoutError):
            self._backoff = min(self._backoff * 2, self._max)
            self._next_try = time.monotonic() + self._backoff
            return False
        log.warning("Redis is back after %.1f s", time.monotonic() - self.down_since)
        self.down_since = None
        return True
