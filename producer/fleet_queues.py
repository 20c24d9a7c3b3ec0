"""RQ's queue registry (`rq:queues`) as the fleet views read it, and its upkeep.

RQ adds a queue to `rq:queues` with every job enqueued on it, and never takes it out. The views (`mlxq stats`,
the gateway's `/metrics` and `/dashboard`, producer/fleet_stats.py) read each listed queue's counts, so
queues nobody serves would pile up there and make every read slower (50,000 such names made a `/metrics`
scrape take 5 s and an idle gateway burn 0.6 of a core: docs/operations.md).

- Views list the queues live workers listen on and the registered queues that hold jobs (waiting or taken),
  the deepest `MAX_LISTED` of them, found by one server-side script (`active_queues`); the rest are counted.
- The aging rule: a registered queue that holds no job (waiting, taken, scheduled for a retry or deferred)
  and that no live worker listens on is taken out of `rq:queues` (`prune_queues`, which each gateway runs
  between its dashboard samples, a bounded slice at a time), and its registries' expired entries with it.
  Nothing is lost: RQ registers a queue again with its next job, and its jobs' results are their own keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from rq.queue import Queue
from rq.registry import (
    CanceledJobRegistry,
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)

__all__ = ["MAX_LISTED", "PRUNE_SLICE", "QueuePruner", "active_queues_command", "prune_queues_command"]

log = logging.getLogger("mlxq.api")

MAX_LISTED = 256  # registered queues with jobs that a view lists, deepest first
PRUNE_SLICE = 1000  # registered queues one prune call looks at

_QUEUE_PREFIX = Queue.redis_queue_namespace_prefix  # rq:queue:


def _prefix(template: str) -> str:
    return template.format("")


# KEYS[1] rq:queues. ARGV: the queue key prefix, the started registry's prefix, the most names to return.
# Returns {queues registered, those holding jobs (waiting or taken), the jobs waiting in them all, then the
# names of the deepest of them}.
_ACTIVE = """
local registered = redis.call('SMEMBERS', KEYS[1])
local active, waiting = {}, 0
for _, key in ipairs(registered) do
  local name = string.sub(key, #ARGV[1] + 1)
  local depth = redis.call('LLEN', key)
  waiting = waiting + depth
  if depth > 0 or redis.call('ZCARD', ARGV[2] .. name) > 0 then active[#active + 1] = {name, depth} end
end
table.sort(active, function(a, b) return a[2] > b[2] end)
local out = {#registered, #active, waiting}
for i = 1, math.min(#active, tonumber(ARGV[3])) do out[#out + 1] = active[i][1] end
return out
"""

# KEYS[1] rq:queues. ARGV: cursor, slice, now (Unix seconds), the queue key prefix, the prefixes of the three
# registries of jobs still to run (started, scheduled, deferred), of the three of ended ones (finished, failed,
# cancelled), then the queues live workers listen on. Looks at one SSCAN slice: takes out each queue that holds
# no job to run and is not served, removing its registries' expired entries. Returns {next cursor, names
# taken out}.
_PRUNE = """
local prefix, now = ARGV[4], tonumber(ARGV[3])
local served = {}
for j = 11, #ARGV do served[ARGV[j]] = true end
local reply = redis.call('SSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local removed = {}
for _, key in ipairs(reply[2]) do
  local name = string.sub(key, #prefix + 1)
  local idle = not served[name] and redis.call('LLEN', key) == 0 and redis.call('LLEN', key .. ':intermediate') == 0
  for j = 5, 7 do idle = idle and redis.call('ZCARD', ARGV[j] .. name) == 0 end
  if idle then
    for j = 8, 10 do redis.call('ZREMRANGEBYSCORE', ARGV[j] .. name, 0, now) end
    redis.call('SREM', KEYS[1], key)
    removed[#removed + 1] = name
  end
end
return {reply[1], removed}
"""


def active_queues_command(max_listed: int = MAX_LISTED) -> tuple[Any, ...]:
    """The EVAL that lists the registered queues holding jobs (its reply: see `_ACTIVE`)."""
    return ("EVAL", _ACTIVE, 1, Queue.redis_queues_keys, _QUEUE_PREFIX, _prefix(StartedJobRegistry.key_template),
            max_listed)


def prune_queues_command(cursor: int | bytes, served: set[str], now: float, slice_: int = PRUNE_SLICE
                         ) -> tuple[Any, ...]:
    """The EVAL that ages one slice of `rq:queues` out (its reply: see `_PRUNE`)."""
    pending = [_prefix(r.key_template) for r in (StartedJobRegistry, ScheduledJobRegistry, DeferredJobRegistry)]
    ended = [_prefix(r.key_template) for r in (FinishedJobRegistry, FailedJobRegistry, CanceledJobRegistry)]
    return ("EVAL", _PRUNE, 1, Queue.redis_queues_keys, cursor, slice_, now, _QUEUE_PREFIX, *pending, *ended,
            *sorted(served))


class QueuePruner:
    """A gateway's share of the upkeep: every `interval_s`, `prune_queues` over up to `slices_per_round` slices
    of `rq:queues` (a whole pass once the cursor comes back to 0), sparing the queues `served()` names."""

    def __init__(self, connection: aioredis.Redis, served: Callable[[], Awaitable[set[str]]], interval_s: float,
                 slices_per_round: int = 10) -> None:
        self._connection = connection
        self._served = served
        self.interval_s = interval_s
        self.slices_per_round = slices_per_round
        self._cursor: int | bytes = 0

    async def run(self) -> None:
        while True:
            try:
                await self.prune_round()
            except (RedisError, OSError) as exc:
                log.warning("queue registry upkeep: %s", exc)
            await asyncio.sleep(self.interval_s)

    async def prune_round(self) -> list[str]:
        """Up to `slices_per_round` slices from where the last round stopped; the queues taken out."""
        served = await self._served()
        removed: list[str] = []
        for _ in range(self.slices_per_round):
            cursor, names = await self._connection.execute_command(
                *prune_queues_command(self._cursor, served, time.time()))
            self._cursor = int(cursor)
            removed += [name.decode() if isinstance(name, bytes) else str(name) for name in names]
            if self._cursor == 0:
                break
        if removed:
            log.info("queue registry upkeep: %d empty queue(s) nobody serves left rq:queues", len(removed))
        return removed
