"""Whether Redis is answering, and when to ask it again (exponential backoff, capped)."""

from __future__ import annotations

import logging
import time
from typing import Optional

import redis

log = logging.getLogger("mlxq.worker")


class RedisHealth:
    def __init__(self, connection: redis.Redis, first_backoff_s: float = 0.5, max_backoff_s: float = 15.0) -> None:
        self._connection = connection
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
            self._connection.ping()
        except (redis.ConnectionError, redis.TimeoutError):
            self._backoff = min(self._backoff * 2, self._max)
            self._next_try = time.monotonic() + self._backoff
            return False
        log.warning("Redis is back after %.1f s", time.monotonic() - self.down_since)
        self.down_since = None
        return True
