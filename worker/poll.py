"""The batch loop's one round trip per turn: take waiting jobs and find running ones to cancel.

One server-side script does both, so a loop turn costs a single short round trip however many
queues the worker listens on and however many sequences run:
- the running jobs' ids are kept in a set (`mlxq:running:<worker>`, added as jobs start, removed
  by the first poll after they end); the script looks for their cancel keys (`mlxq:cancel:<id>`),
  with one EXISTS per 512 ids and per-id calls only when one exists (docs/design-notes.md);
- in a process group (`mlxq worker --processes N`), `room` is first cut to the worker's fair share:
  the running and waiting jobs of the group over its live workers, less what it runs itself. An
  idle worker would otherwise take a whole burst that its siblings could share. In a group, taken ids enter
  the running set in the same script, so a sibling's next poll counts them;
- up to `room` job ids move from the queues, in the worker's priority order, to their intermediate
  lists (crash-safe as rq's own LMOVE dequeue), and their job hashes come back with them. An id
  whose job hash is gone (deleted while it waited) is dropped from the intermediate list. A job key
  that is not a hash, or a hash too big to ship (MLXQ_MAX_JOB_BYTES), comes back as a note of why,
  which worker/intake.py turns into a failed job; so does a job that has ended already (its result
  key exists, or its status is final), which never runs again. A queue key that is not a list is
  skipped;
- the jobs left in the queues after the take are counted: whether requests wait for a full worker
  decides how its engine's speculation weighs a batch (worker/engines/speculation/graded.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import NamedTuple, Optional

import redis

from schemas import keys
from schemas.scripts import Script
from worker.intake import READ_JOB_LUA, JobFields, as_job_fields

log = logging.getLogger("mlxq.worker")

POLL_SCRIPT = READ_JOB_LUA + """
for first = 9, #ARGV, 1000 do
  redis.call('SREM', KEYS[1], unpack(ARGV, first, math.min(first + 999, #ARGV)))
end
local max_bytes = tonumber(ARGV[8])
local room = tonumber(ARGV[1])
local function queued()  -- the jobs waiting in the queues polled (a key that is not a list counts none)
  local total = 0
  for q = 2, #KEYS, 2 do
    local length = redis.pcall('LLEN', KEYS[q])
    if type(length) == 'number' then total = total + length end
  end
  return total
end
if ARGV[4] ~= '' then
  local now = tonumber(redis.call('TIME')[1])
  redis.call('HSET', ARGV[4], ARGV[7], now)
  redis.call('EXPIRE', ARGV[4], 86400)
  if room > 0 then
    local live, load = 0, 0
    local members = redis.call('HGETALL', ARGV[4])
    for i = 1, #members, 2 do
      if now - tonumber(members[i + 1]) <= tonumber(ARGV[5]) then
        live = live + 1
        load = load + redis.call('SCARD', ARGV[6] .. members[i])
      else
        redis.call('HDEL', ARGV[4], members[i])
      end
    end
    load = load + queued()
    local share = math.ceil(load / live) - redis.call('SCARD', KEYS[1])
    room = math.max(0, math.min(room, share))
  end
end
local cancelled = {}
if ARGV[3] ~= '' then
  local ids = redis.call('SMEMBERS', KEYS[1])
  for first = 1, #ids, 512 do
    local chunk, names = {}, {}
    for i = first, math.min(first + 511, #ids) do
      chunk[#chunk + 1] = ids[i]
      names[#names + 1] = ARGV[3] .. ids[i]
    end
    if redis.call('EXISTS', unpack(names)) > 0 then
      for i, id in ipairs(chunk) do
        if redis.call('EXISTS', names[i]) == 1 then cancelled[#cancelled + 1] = id end
      end
    end
  end
end
local taken, broken_queues = {}, {}
for q = 2, #KEYS, 2 do
  while room > 0 do
    local id = redis.pcall('LMOVE', KEYS[q], KEYS[q + 1], 'LEFT', 'RIGHT')
    if type(id) == 'table' and id.err then
      broken_queues[#broken_queues + 1] = (q - 2) / 2
      break
    end
    if not id then break end
    local job = read_job(ARGV[2] .. id, id, true, max_bytes)
    if not job then
      redis.call('LREM', KEYS[q + 1], 1, id)
    else
      taken[#taken + 1] = (q - 2) / 2
      taken[#taken + 1] = id
      taken[#taken + 1] = job
      if ARGV[4] ~= '' then redis.call('SADD', KEYS[1], id) end
      room = room - 1
    end
  end
end
return {cancelled, taken, broken_queues, queued()}
"""


# KEYS[1]: the intermediate list the id was moved to. ARGV: the job key, the size limit, the id. The
# job as the poll script returns one; an id whose hash is gone leaves the intermediate list.
READ_SCRIPT = READ_JOB_LUA + """
local job = read_job(ARGV[1], ARGV[3], true, tonumber(ARGV[2]))
if not job then redis.call('LREM', KEYS[1], 1, ARGV[3]) end
return job
"""


class TakenJob(NamedTuple):
    queue_index: int  # into the queue pairs given to `poll`
    raw_id: bytes
    fields: JobFields  # the job's hash; or, where the script sent none, why (worker/intake.py reads both)

    @property
    def job_id(self) -> str:
        return self.raw_id.decode(errors="replace")


class _Popped(NamedTuple):
    """A job id the idle wait popped and has not taken yet: on its intermediate list or not."""

    queue_key: str
    intermediate_key: str
    raw_id: bytes
    listed: bool


class Poll(NamedTuple):
    taken: list[TakenJob]
    cancelled: set[str]
    broken_queues: list[int]  # queues (indexes into the pairs given) that are not lists
    left: int = 0  # jobs left in the queues polled, after the take


class Poller:
    def __init__(self, connection: redis.Redis, worker_name: str, group: Optional[str] = None,
                 member_ttl_s: int = 20, max_job_bytes: int = 16 * 1024 * 1024) -> None:
        self.running_key = keys.running_key(worker_name)
        self._name = worker_name
        self._group_key = keys.group_key(group) if group else ""
        self._member_ttl_s = member_ttl_s  # a member that has not polled for this long has left its group
        self._max_job_bytes = max_job_bytes  # a bigger job hash is not sent back: it fails unread
        self._connection = connection
        self._script = Script(connection, POLL_SCRIPT)
        self._read = Script(connection, READ_SCRIPT)
        # Ended jobs still in the running set. The next poll removes them before it looks for
        # cancel keys: left to the result writes, 256 jobs that ended in one step stayed in it
        # for the poll right after (written later, in the next step), which scanned them all.
        self._ended: set[str] = set()
        # An id the idle wait popped whose push onto its intermediate list or read then failed (the
        # server BUSY, or gone): the next wait takes it first, so the error does not lose the job.
        self._popped: Optional[_Popped] = None

    def stay_in_group(self) -> None:
        """Be counted in the group's shares while idle, blocked in rq's dequeue: a poll that takes
        nothing (a worker joins with every poll)."""
        if self._group_key:
            self.poll([], 0, "", check_cancels=False)

    def leave_group(self) -> None:
        if self._group_key:
            self._connection.hdel(self._group_key, self._name)

    def ended(self, job_ids: Iterable[str]) -> None:
        self._ended.update(job_ids)

    def started(self, job_ids: Iterable[str]) -> None:
        """Jobs (re)started: running again, whatever an earlier attempt left to remove."""
        self._ended.difference_update(job_ids)

    def remove_ended(self) -> None:
        """Remove the ended jobs now, without a poll (the loop is stopping)."""
        if self._ended:
            self._connection.srem(self.running_key, *self._ended)
            self._ended.clear()

    def poll(self, queue_pairs: list[tuple[str, str]], room: int, job_key_prefix: str,
             check_cancels: bool) -> Poll:
        """Take up to `room` jobs from (queue, intermediate list) pairs, in order; with
        `check_cancels`, also the running jobs that have a cancel key."""
        script_keys = [self.running_key] + [key for pair in queue_pairs for key in pair]
        cancel_prefix = keys.cancel_key("") if check_cancels else ""
        ended = list(self._ended)
        cancelled, flat, broken, left = self._script(
            keys=script_keys, args=[max(0, room), job_key_prefix, cancel_prefix, self._group_key, self._member_ttl_s,
                                    keys.running_key(""), self._name, self._max_job_bytes, *ended])
        self._ended.difference_update(ended)
        taken = [TakenJob(int(index), raw_id, as_job_fields(fields))
                 for index, raw_id, fields in zip(flat[::3], flat[1::3], flat[2::3])]
        return Poll(taken, {job_id.decode() for job_id in cancelled}, [int(i) for i in broken], int(left))

    def wait(self, queue_pairs: list[tuple[str, str]], job_key_prefix: str, timeout_s: float) -> Optional[TakenJob]:
        """Block up to `timeout_s` for one job (an idle worker). With one queue the id moves to its
        intermediate list atomically (BLMOVE, crash-safe); with several, BLPOP takes it from the first
        that has one and it is put in that queue's intermediate list right after, as rq's own dequeue
        does. A queue key that is not a list raises redis.ResponseError. An error after the pop (the
        server BUSY, or gone) leaves the id with the poller, and the next wait takes it first (or, if
        that queue is not among the pairs then, puts it back at the queue's head)."""
        if self._popped is None:
            if len(queue_pairs) == 1:
                intermediate_key = queue_pairs[0][1]
                raw_id = self._connection.blmove(queue_pairs[0][0], intermediate_key, timeout_s, "LEFT", "RIGHT")
                if raw_id is None:
                    return None
                self._popped = _Popped(queue_pairs[0][0], intermediate_key, raw_id, listed=True)
            else:
                popped = self._connection.blpop([queue for queue, _ in queue_pairs], timeout_s)
                if popped is None:
                    return None
                queue_key, raw_id = popped
                index = [queue.encode() for queue, _ in queue_pairs].index(queue_key)
                self._popped = _Popped(*queue_pairs[index], raw_id, listed=False)
        return self._take_popped(queue_pairs, job_key_prefix)

    def _take_popped(self, queue_pairs: list[tuple[str, str]], job_key_prefix: str) -> Optional[TakenJob]:
        popped = self._popped
        assert popped is not None
        index = next((i for i, (queue, intermediate) in enumerate(queue_pairs)
                      if (queue, intermediate) == (popped.queue_key, popped.intermediate_key)), None)
        if index is None:  # its queue is not waited on now (held): the id goes back to the queue's head
            with self._connection.pipeline(transaction=True) as pipe:
                if popped.listed:
                    pipe.lrem(popped.intermediate_key, 1, popped.raw_id)
                pipe.lpush(popped.queue_key, popped.raw_id)
                pipe.execute()
            self._popped = None
            return None
        if not popped.listed:
            self._connection.rpush(popped.intermediate_key, popped.raw_id)
            popped = self._popped = popped._replace(listed=True)
        fields = self._read(keys=[popped.intermediate_key],
                            args=[job_key_prefix.encode() + popped.raw_id, self._max_job_bytes, popped.raw_id])
        self._popped = None
        taken = as_job_fields(fields)
        return None if taken is None else TakenJob(index, popped.raw_id, taken)


class WorkerQueues:
    """A worker's queues, in its priority order, as its batch loop takes jobs from them: the
    Poller's round trips bound to those queues, with a warning (once a minute) for a queue key
    that is not a list, which the poll skips."""

    def __init__(self, poller: Poller, queue_pairs: list[tuple[str, str]], job_key_prefix: str) -> None:
        self._poller, self._pairs, self._prefix = poller, queue_pairs, job_key_prefix
        self._next_warning = 0.0
        self._held: set[int] = set()  # queues whose first job wants newer weights than this worker's

    def hold(self, queue_indexes: Iterable[int]) -> None:
        """Take nothing from these queues until the weights change (`version_changed`)."""
        self._held.update(queue_indexes)

    def version_changed(self) -> None:
        self._held.clear()

    def poll(self, room: int, check_cancels: bool) -> Poll:
        indexes = self._open_queues()
        poll = self._poller.poll([self._pairs[i] for i in indexes], room, self._prefix, check_cancels)
        if poll.broken_queues:
            self._warn([self._pairs[indexes[i]][0] for i in poll.broken_queues])
        return poll._replace(taken=[t._replace(queue_index=indexes[t.queue_index]) for t in poll.taken],
                             broken_queues=[indexes[i] for i in poll.broken_queues])

    def wait(self, timeout_s: float) -> Optional[TakenJob]:
        """Block up to `timeout_s` for one job. Where a queue key is not a list (the blocking pop
        refuses the whole call) poll instead, skipping it, and sleep the round out if nothing came."""
        indexes = self._open_queues()
        if not indexes:
            time.sleep(timeout_s)
            return None
        try:
            taken = self._poller.wait([self._pairs[i] for i in indexes], self._prefix, timeout_s)
            return None if taken is None else taken._replace(queue_index=indexes[taken.queue_index])
        except redis.ResponseError:
            polled = self.poll(1, check_cancels=False).taken
            if not polled:
                time.sleep(timeout_s)
            return polled[0] if polled else None

    def _open_queues(self) -> list[int]:
        return [i for i in range(len(self._pairs)) if i not in self._held]

    def started(self, job_ids: list[str]) -> None:
        self._poller.started(job_ids)

    def ended(self, job_ids: list[str]) -> None:
        self._poller.ended(job_ids)

    def stay_in_group(self) -> None:
        self._poller.stay_in_group()

    def _warn(self, queue_keys: list[str]) -> None:
        now = time.monotonic()
        if now >= self._next_warning:
            self._next_warning = now + 60
            log.error("skipping %s: not a Redis list (a queue must be one)", ", ".join(queue_keys))
