"""The batch loop's one round trip per turn: take waiting jobs and find running ones to cancel.

One server-side script does both, so a loop turn costs a single short round trip however many
queues the worker listens on and however many sequences run:
- the running jobs' ids are kept in a set (`mlxq:running:<worker>`, added as jobs start, removed
  by the first poll after they end); the script looks for their cancel keys (`mlxq:cancel:<id>`),
  with one EXISTS per 512 ids and per-id calls only when one exists (256 single EXISTS calls per
  turn made this the costliest part of a turn at 256 in flight);
- in a process group (`mlxq worker --processes N`), `room` is first cut to the worker's fair share:
  the running and waiting jobs of the group over its live workers, less what it runs itself. An
  idle worker would otherwise take a whole burst that its siblings could share (on an H200 one of
  two workers took 127 of a wave of 128 jobs while the other ran one). In a group, taken ids enter
  the running set in the same script, so a sibling's next poll counts them;
- up to `room` job ids move from the queues, in the worker's priority order, to their intermediate
  lists (crash-safe as rq's own LMOVE dequeue), and their job hashes come back with them. An id
  whose job hash is gone (deleted while it waited) is dropped from the intermediate list.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Optional

import redis

from schemas import keys

POLL_SCRIPT = """
for first = 8, #ARGV, 1000 do
  redis.call('SREM', KEYS[1], unpack(ARGV, first, math.min(first + 999, #ARGV)))
end
local room = tonumber(ARGV[1])
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
    for q = 2, #KEYS, 2 do load = load + redis.call('LLEN', KEYS[q]) end
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
local taken = {}
for q = 2, #KEYS, 2 do
  while room > 0 do
    local id = redis.call('LMOVE', KEYS[q], KEYS[q + 1], 'LEFT', 'RIGHT')
    if not id then break end
    local job = redis.call('HGETALL', ARGV[2] .. id)
    if #job == 0 then
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
return {cancelled, taken}
"""


class TakenJob(NamedTuple):
    queue_index: int  # into the queue pairs given to `poll`
    job_id: str
    fields: dict[bytes, bytes]  # the job's hash


class Poll(NamedTuple):
    taken: list[TakenJob]
    cancelled: set[str]


class Poller:
    def __init__(self, connection: redis.Redis, worker_name: str, group: Optional[str] = None,
                 member_ttl_s: int = 20) -> None:
        self.running_key = keys.running_key(worker_name)
        self._name = worker_name
        self._group_key = keys.group_key(group) if group else ""
        self._member_ttl_s = member_ttl_s  # a member that has not polled for this long has left its group
        self._connection = connection
        self._script = connection.register_script(POLL_SCRIPT)
        # Ended jobs still in the running set. The next poll removes them before it looks for
        # cancel keys: left to the result writes, 256 jobs that ended in one step stayed in it
        # for the poll right after (written later, in the next step), which scanned them all.
        self._ended: set[str] = set()

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
        cancelled, flat = self._script(keys=script_keys,
                                       args=[max(0, room), job_key_prefix, cancel_prefix, self._group_key,
                                             self._member_ttl_s, keys.running_key(""), self._name, *ended])
        self._ended.difference_update(ended)
        taken = [TakenJob(int(index), job_id.decode(), dict(zip(fields[::2], fields[1::2])))
                 for index, job_id, fields in zip(flat[::3], flat[1::3], flat[2::3])]
        return Poll(taken, {job_id.decode() for job_id in cancelled})
