"""Writes that wait for replicas: Redis replicates asynchronously, so a write the primary
acknowledged is lost if the primary dies before a replica has it. A `Durability` says how many
replicas must confirm (Redis's WAIT) and for how long to wait; fewer in time raises NotReplicated,
a connection error, so that whoever retries lost connections retries this too (docs/operations.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

DEFAULT_REPLICAS = 1
DEFAULT_TIMEOUT_MS = 2000


class NotReplicated(redis.exceptions.ConnectionError):
    """The primary took the writes, but fewer replicas than asked confirmed them in time: they are
    lost if the primary fails before its replicas catch up."""

    def __init__(self, confirmed: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(f"written on the primary, but {confirmed} of the {wanted} replica(s) asked for "
                         f"confirmed within {timeout_ms} ms")
        self.confirmed, self.wanted = confirmed, wanted


@dataclass(frozen=True)
class Durability:
    replicas: int = DEFAULT_REPLICAS
    timeout_ms: int = DEFAULT_TIMEOUT_MS

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.timeout_ms < 1:
            raise ValueError("durability needs at least one replica and a timeout of at least 1 ms")

    def check(self, confirmed: object) -> None:
        """Raise NotReplicated unless WAIT's reply says enough replicas have the writes."""
        count = int(confirmed)  # type: ignore[call-overload]
        if count < self.replicas:
            raise NotReplicated(count, self.replicas, self.timeout_ms)
