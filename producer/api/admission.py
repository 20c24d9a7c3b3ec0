"""Admission, atomically in Redis so that replicas share it: the target queue's depth (429 past
`max_queue_depth`) and the tenant's jobs in flight (429 past `tenant_max_in_flight`).

A tenant's jobs in flight are a sorted set of job ids. Ids leave it when the gateway that waited for
them sees them end; ids of jobs nobody waits for (`POST /v1/jobs`, a replica that died) are swept by
the script itself once the set is full: an id goes when its result key exists, or when its RQ job
hash is gone and it was admitted more than a grace period ago (a job is enqueued right after).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from rq import Queue
from rq.job import Job

from producer.api import keys as api_keys
from producer.api.auth import ApiError, Tenant
from producer.api.coalesce import Coalescer
from producer.errors import broker_errors
from producer.aio import parsed_state
from producer.lean_results import parse_result_lean
from producer.wire import JobState
from schemas import keys
from schemas.command_batch import RUN_COMMANDS, CommandBatch
from schemas.durability import Durability, NotReplicated
from schemas.scripts import AsyncScript

__all__ = ["Admission", "SettlingReader"]

SET_TTL_S = 7 * 24 * 3600  # an idle tenant's set expires
GRACE_S = 30

# admit(set, queue, first, last, packed, cap, depth, now, ttl, grace): admit the ids ARGV[first..last]
# into the tenant's sorted set `set` under its cap (after sweeping out ids that ended, when full), unless
# the list `queue` ("" for none) holds `depth` or more (0: no limit); run the packed commands `packed`
# ("" for none) once every id was admitted, taking the ids out again if one fails. Returns -1 (queue
# too deep), the number of ids admitted from the first, or the failed command's error reply.
_ADMIT_FUNCTION = """
local function admit(set, queue, first, last, packed, cap, depth, now, ttl, grace)
  if depth > 0 and queue ~= '' and redis.call('LLEN', queue) >= depth then return -1 end
  local want = last - first + 1
  local n = redis.call('ZCARD', set)
  if n + want > cap then
    local entries = redis.call('ZRANGE', set, 0, -1, 'WITHSCORES')
    for i = 1, #entries, 2 do
      local member, score = entries[i], tonumber(entries[i + 1])
      if redis.call('EXISTS', '""" + keys.result_key("") + """' .. member) == 1
          or (score < now - grace
          and redis.call('EXISTS', '""" + Job.redis_job_namespace_prefix + """' .. member) == 0) then
        redis.call('ZREM', set, member)
      end
    end
    n = redis.call('ZCARD', set)
  end
  local admitted = math.min(math.max(cap - n, 0), want)
  for i = 0, admitted - 1 do redis.call('ZADD', set, now, ARGV[first + i]) end
  if admitted > 0 then redis.call('EXPIRE', set, ttl) end
  if packed ~= '' and admitted == want then""" + RUN_COMMANDS + """
    for _, reply in ipairs(replies) do
      if type(reply) == 'table' and reply.err then
        for i = first, last do redis.call('ZREM', set, ARGV[i]) end
        return reply
      end
    end
  end
  return admitted
end
"""

# KEYS[1] the tenant's set, KEYS[2] the queue's list (or "" for no depth check). ARGV: cap, max depth
# (0: none), now, set ttl, grace, the commands that enqueue the ids (or ""), then the ids. The
# gateway's batches call it with no queue and no commands.
_ADMIT = _ADMIT_FUNCTION + """
return admit(KEYS[1], KEYS[2], 7, #ARGV, ARGV[6], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
             ARGV[4], tonumber(ARGV[5]))
"""

# One job each of several requests: KEYS per job its tenant's set and its queue's list; ARGV: cap, max
# depth, now, set ttl, grace, then per job its id and the commands that enqueue it. Returns per job
# what `admit` returns, a failed command's error as its message (the others are not undone).
_ADMIT_EACH = _ADMIT_FUNCTION + """
local out = {}
for j = 1, #KEYS / 2 do
  local reply = admit(KEYS[2 * j - 1], KEYS[2 * j], 4 + 2 * j, 4 + 2 * j, ARGV[5 + 2 * j], tonumber(ARGV[1]),
                      tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5]))
  if type(reply) == 'table' then reply = reply.err end
  out[j] = reply
end
return out
"""

# KEYS: per job its result key, its RQ hash and its tenant's set; ARGV: the job ids. Returns per job
# its result and RQ status (what `AsyncClient._read_states` reads), flat, and takes each job that has
# a result out of its tenant's set: the read that finds a result also releases the job's slot.
_SETTLE = """
local replies = {}
for i = 1, #ARGV do
  local result = redis.call('GET', KEYS[3 * i - 2])
  replies[2 * i - 1] = result
  replies[2 * i] = redis.call('HGET', KEYS[3 * i - 1], 'status')
  if result then redis.call('ZREM', KEYS[3 * i], ARGV[i]) end
end
return replies
"""


class Admission:
    def __init__(self, connection: aioredis.Redis, tenant_cap: int, max_queue_depth: int,
                 durability: Optional[Durability] = None) -> None:
        self._connection = connection
        self._durability = durability
        self._script = AsyncScript(connection, _ADMIT)
        self._each_script = AsyncScript(connection, _ADMIT_EACH)
        # Single jobs admitted in one turn of the event loop (concurrent requests) share one call.
        self._admit_each: Coalescer[tuple[Tenant, str, str, bytes], int | bytes | NotReplicated] = Coalescer(
            self._admit_many)
        self._settle_script = AsyncScript(connection, _SETTLE)
        self._settle: Coalescer[tuple[Tenant, str], tuple[bytes | None, bytes | None]] = Coalescer(self._settle_many)
        self.tenant_cap = tenant_cap
        self.max_queue_depth = max_queue_depth

    async def admit(self, tenant: Tenant, job_ids: Sequence[str]) -> int:
        """Admit up to len(job_ids) of the tenant's new jobs (a batch's lines, which it enqueues
        itself); how many were, from the first."""
        return int(await self._script(
            keys=[api_keys.in_flight(tenant.tag), ""],
            args=[self.tenant_cap, 0, time.time(), SET_TTL_S, GRACE_S, b"", *job_ids]))

    async def admit_one(self, tenant: Tenant, job_id: str, queue: str, enqueue: CommandBatch | None = None) -> None:
        """Admit one job, and enqueue it with `enqueue`, or answer 429 (and enqueue nothing). Jobs
        admitted by concurrent requests in one turn of the event loop share one Redis call. With a
        durability, NotReplicated if fewer replicas than it asks confirmed the job in time."""
        commands = enqueue.take()[1] if enqueue is not None and len(enqueue) else b""
        admitted = await self._admit_each((tenant, job_id, queue, commands))
        if isinstance(admitted, NotReplicated):  # enqueued, but fewer replicas than asked have it
            raise admitted
        if isinstance(admitted, bytes):
            raise ResponseError(admitted.decode(errors="replace"))
        if admitted == -1:
            raise ApiError(429, f"The queue {queue!r} holds {self.max_queue_depth} jobs or more; retry later",
                           "rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"})
        if admitted == 0:
            raise ApiError(429, f"This tenant has {self.tenant_cap} jobs in flight, its limit; retry later",
                           "rate_limit_exceeded", code="too_many_jobs_in_flight", headers={"Retry-After": "1"})

    async def _admit_many(self, jobs: Sequence[tuple[Tenant, str, str, bytes]]
                          ) -> list[int | bytes | NotReplicated]:
        script_keys = [key for tenant, _, queue, _ in jobs
                       for key in (api_keys.in_flight(tenant.tag), f"{Queue.redis_queue_namespace_prefix}{queue}")]
        args: list[Any] = [self.tenant_cap, self.max_queue_depth, time.time(), SET_TTL_S, GRACE_S]
        for _, job_id, _, commands in jobs:
            args += [job_id, commands]
        if self._durability is None:
            return list(await self._each_script(keys=script_keys, args=args))
        async with self._connection.client() as single:  # WAIT counts one connection's own writes
            replies: list[int | bytes | NotReplicated] = list(
                await self._each_script(keys=script_keys, args=args, client=single))
            try:
                self._durability.check(await single.wait(self._durability.replicas, self._durability.timeout_ms))
            except NotReplicated as exc:  # the jobs enqueued are named in their answers; refused ones keep theirs
                return [exc if reply == 1 else reply for reply in replies]
        return replies

    async def release(self, tenant: Tenant, job_ids: Sequence[str]) -> None:
        if job_ids:
            await self._connection.zrem(api_keys.in_flight(tenant.tag), *job_ids)

    async def _settle_many(self, jobs: Sequence[tuple[Tenant, str]]) -> list[tuple[bytes | None, bytes | None]]:
        script_keys = [key for tenant, job_id in jobs
                       for key in (keys.result_key(job_id), Job.key_for(job_id), api_keys.in_flight(tenant.tag))]
        with broker_errors():
            flat = await self._settle_script(keys=script_keys, args=[job_id for _, job_id in jobs])
        return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(jobs))]

    def settling(self, tenant: Tenant) -> "SettlingReader":
        """A reader of the tenant's job states that releases each job as its result is read."""
        return SettlingReader(self, tenant)


@dataclass
class SettlingReader:
    """`AsyncClient._read_states`'s twin (a `ReadStates`) that releases a job in the same round trip
    that reads its result, a round trip shared with the other requests' reads of that moment;
    `released` holds the ids it released. A large result is read lean (`parse_result_lean`): it is for
    a response."""

    admission: Admission
    tenant: Tenant
    released: set[str] = field(default_factory=set)

    async def __call__(self, job_ids: Sequence[str]) -> list[JobState]:
        states: list[JobState] = []
        for job_id in job_ids:  # each read shares its round trip with those of other requests
            result, status = await self.admission._settle((self.tenant, job_id))
            if result is not None:
                self.released.add(job_id)
            states.append(await parsed_state(job_id, result, status, parse_result_lean))
        return states

    async def release_rest(self, job_ids: Sequence[str]) -> None:
        """Release the ids of `job_ids` it has not released."""
        await self.admission.release(self.tenant, [job_id for job_id in job_ids if job_id not in self.released])
