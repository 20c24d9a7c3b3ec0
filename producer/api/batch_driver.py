"""What moves OpenAI batches forward, with no process of its own: every gateway replica runs a
BatchDriver, and each batch in `mlxq:api:batches:active` is advanced by whichever replica holds its
lease (a Redis key with a TTL) at that moment. One advance, from the state in Redis alone:

- validating: every input line is parsed; a bad one fails the batch with OpenAI's `errors` list;
- in progress: the jobs that ended are collected into the output or error list (and leave the
  batch's in-flight hash in the same script, so a line is written once; a result that cannot be read
  or written as a line goes to the error list as `result_unreadable`, and never holds the batch up),
  then new lines are submitted up to `batch_max_in_flight` (and the tenant's cap), their job hashes,
  the in-flight entries and the new position in the file written in one atomic batch whose job ids
  are fixed by the line, so no line is submitted twice;
- past the completion window, or cancelled: the jobs in flight are cancelled, the lines never sent go
  to the error file (`batch_expired` / `batch_cancelled`), and once nothing is in flight the batch
  ends `expired` / `cancelled`; otherwise, once every line is written, `completed`. The output and
  error files are then made from the lists;
- once the tenant's files (this batch's lines counted as they are written) fill its storage quota,
  the lines never sent go to the error file (`storage_quota_exceeded`), the jobs in flight end, and the
  batch ends `completed`.

A replica that dies mid-advance loses nothing: its lease expires and the next one starts from Redis.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

from rq.job import Job

from producer.aio import execute_batch
from producer.api import keys as api_keys
from producer.api.batches import FINAL, BatchErrors, BatchState, BatchStore
from producer.api.gateway import Gateway
from producer.batchfile import BatchLine, LineError, error_line, outcome_line_json, parse_line, unreadable_line
from producer.errors import JobNotFound
from producer.lean_results import parse_result_lean
from producer.openai_responses import encode
from producer.wire import NO_CONNECTION, job_options, job_state, lost_result, plan_jobs, record_enqueue
from schemas import GenerationResult, keys
from schemas.command_batch import CommandBatch
from schemas.scripts import AsyncScript

__all__ = ["BatchDriver"]

log = logging.getLogger("mlxq.api.batches")

LEASE_S = 60
VALIDATE_CHUNK = 2000
MAX_ERRORS_LISTED = 100
COLLECT_BYTES = 16 * 1024 * 1024  # results read (and their lines written) together at most
RESULT_MARGIN_S = 3600  # a batch's lists outlive its window by this much

# KEYS: in-flight hash, output list, error list, batch hash, tenant's in-flight set.
# ARGV: next piece ('' to leave it), next offset, list ttl, then (job id or '', '0' output | '1' error, line)
# triples. A line is written only if its job id left the in-flight hash here (or it has none). Returns the
# bytes written.
_COLLECT = """
if ARGV[1] ~= '' then redis.call('HSET', KEYS[4], 'next_piece', ARGV[1], 'next_offset', ARGV[2]) end
local written = 0
for i = 4, #ARGV, 3 do
  local id, kind, line = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if id == '' or redis.call('HDEL', KEYS[1], id) == 1 then
    local list, count, size = KEYS[2], 'completed', 'out_bytes'
    if kind == '1' then list, count, size = KEYS[3], 'failed', 'err_bytes' end
    redis.call('RPUSH', list, line)
    redis.call('EXPIRE', list, ARGV[3])
    redis.call('HINCRBY', KEYS[4], count, 1)
    redis.call('HINCRBY', KEYS[4], size, #line + 1)
    if id ~= '' then redis.call('ZREM', KEYS[5], id) end
    written = written + #line + 1
  end
end
return written
"""

EXPIRED = "the batch's completion window ended before this request did"
OVER_QUOTA = "over_quota"  # a stop: the tenant's files fill its storage quota

_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class BatchDriver:
    def __init__(self, gateway: Gateway, batches: BatchStore) -> None:
        self._gw = gateway
        self._batches = batches
        self._connection = gateway.client.connection
        self._collect = AsyncScript(self._connection, _COLLECT)
        self._release = AsyncScript(self._connection, _RELEASE)
        self._owner = uuid.uuid4().hex

    async def run(self) -> None:
        """Advance every active batch, forever (the gateway's background task)."""
        while True:
            try:
                await self.advance_all()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batch driver: a round failed; retrying")
            await asyncio.sleep(self._gw.settings.batch_drive_interval_s)

    async def advance_all(self) -> None:
        for raw in await self._connection.smembers(api_keys.ACTIVE_BATCHES):
            try:
                await self.advance(raw.decode())
            except asyncio.CancelledError:
                raise
            except Exception:  # one batch that cannot advance must not hold the others back
                log.exception("batch driver: batch %s could not advance; retrying", raw.decode())

    async def advance(self, batch_id: str) -> None:
        lease = api_keys.batch_lease(batch_id)
        if not await self._connection.set(lease, self._owner, nx=True, ex=LEASE_S):
            return  # another replica is on it
        try:
            state = await self._batches.load(batch_id)
            if state is None or state.object.status in FINAL:
                await self._connection.srem(api_keys.ACTIVE_BATCHES, batch_id)
                return
            await self._step(state)
        finally:
            await self._release(keys=[lease], args=[self._owner])

    async def _step(self, state: BatchState) -> None:
        now = int(time.time())
        batch = state.object
        if state.stop is None:
            if state.cancel_at:
                state.stop = "cancelled"
            elif batch.expires_at is not None and now >= batch.expires_at:
                state.stop = "expired"
            if state.stop:
                await self._batches.save(state, stop=state.stop)
        if batch.status == "validating":
            if state.stop:
                return await self._finish(state)
            return await self._validate(state)
        await self._collect_ended(state)
        if state.stop is None and await self._gw.files.quota.full(state.tenant):  # (what was just written counts)
            state.stop = OVER_QUOTA
            await self._batches.save(state, stop=state.stop)
        if state.stop:
            await self._stop(state)
        else:
            await self._submit(state)
        state = await self._batches.load(state.id) or state
        if state.counts["next_piece"] >= state.counts["pieces"] and not await self._in_flight_count(state):
            await self._finish(state)

    # -- validating

    async def _validate(self, state: BatchState) -> None:
        batch = state.object
        record = await self._gw.files.get(state.tenant, batch.input_file_id)
        errors: list[dict[str, Any]] = []
        seen: set[str] = set()
        lines_of: dict[str, list[tuple[int, str]]] = {}  # model -> its first lines (number, custom_id)
        total, pieces, offset, model = 0, 0, 0, None
        while True:
            chunk = await self._gw.files.read_lines(record, pieces, offset, VALIDATE_CHUNK)
            if not chunk:
                break
            pieces, offset = chunk[-1][0] + 1, chunk[-1][2]
            parsed = await asyncio.to_thread(self._parse_all, chunk, batch.endpoint)
            for line in parsed:
                total += 1
                if isinstance(line, LineError):
                    errors.append(line.as_batch_error())
                elif line.custom_id in seen:
                    errors.append(LineError(line.number, line.custom_id, f"line {line.number}: custom_id "
                                            f"{line.custom_id!r} appears twice", "custom_id",
                                            "duplicate_custom_id").as_batch_error())
                else:
                    seen.add(line.custom_id)
                    model = model or line.body.model
                    named = lines_of.setdefault(line.body.model, [])
                    if len(named) < MAX_ERRORS_LISTED:
                        named.append((line.number, line.custom_id))
        for name in await self._gw.fleet.unknown(lines_of):  # no queue is made for a model nobody serves
            errors += [_unknown_model(number, custom_id, name).as_batch_error() for number, custom_id in lines_of[name]]
        errors.sort(key=lambda error: error["line"] or 0)
        if total > self._gw.settings.file_max_lines:
            errors.insert(0, {"code": "too_many_lines", "message": f"more than {self._gw.settings.file_max_lines} "
                              "requests", "param": None, "line": None})
        now = int(time.time())
        batch.request_counts.total = total
        batch.model = model
        if errors:
            batch.status, batch.failed_at = "failed", now
            batch.errors = BatchErrors(data=errors[:MAX_ERRORS_LISTED])
            await self._batches.save(state, pieces=pieces)
            await self._connection.srem(api_keys.ACTIVE_BATCHES, state.id)
            return
        batch.status, batch.in_progress_at = "in_progress", now
        await self._batches.save(state, pieces=pieces, next_piece=0, next_offset=0)

    def _parse_all(self, chunk: list[tuple[int, bytes, int]], endpoint: str) -> list[BatchLine | LineError]:
        limits = self._gw.settings.limits
        return [parse_line(text, number + 1, limits, endpoint) for number, text, _ in chunk if text.strip()]

    # -- in progress

    async def _in_flight_count(self, state: BatchState) -> int:
        return int(await self._connection.hlen(api_keys.batch_in_flight(state.id)))

    async def _collect_ended(self, state: BatchState) -> None:
        """Write the lines of the jobs that ended. Results are read a group at a time, each group at most
        COLLECT_BYTES of them (or one larger result), and written before the next is read."""
        in_flight = {k.decode(): v for k, v in (await self._connection.hgetall(api_keys.batch_in_flight(state.id))).items()}
        if not in_flight:
            return
        ids = list(in_flight)
        async with self._connection.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.strlen(keys.result_key(job_id))
                pipe.hget(Job.key_for(job_id), "status")
            raw = await pipe.execute()
        sized = [(job_id, int(raw[2 * i])) for i, job_id in enumerate(ids) if raw[2 * i]]
        without = [(job_id, raw[2 * i + 1]) for i, job_id in enumerate(ids) if not raw[2 * i]]
        written: list[tuple[str, bool, bytes]] = []
        for job_id, status in without:  # not ended, or ended by something other than a worker
            try:
                result: Optional[GenerationResult] = await self._gw.client._settled(job_state(job_id, None, status))
            except JobNotFound:
                result = lost_result(job_id)
            if result is not None:
                written.append(self._line(state, job_id, in_flight[job_id], lambda result=result: result))
        await self._write(state, written)
        for group in _groups(sized, COLLECT_BYTES):
            async with self._connection.pipeline(transaction=False) as pipe:
                for job_id in group:
                    pipe.get(keys.result_key(job_id))
                results = await pipe.execute()
            # Parsed and made into lines on a thread: a large result takes the event loop's time otherwise.
            written = await asyncio.to_thread(self._lines, state, [(job_id, in_flight[job_id], raw_result) for
                                                                  job_id, raw_result in zip(group, results)])
            del results
            await self._write(state, written)

    def _lines(self, state: BatchState, ended: list[tuple[str, bytes, Optional[bytes]]]) -> list[tuple[str, bool, bytes]]:
        """The lines of (job id, input line, raw result) triples; a result that expired meanwhile is left
        for the next round, which finds it lost."""
        return [self._line(state, job_id, text, lambda job_id=job_id, raw=raw: parse_result_lean(job_id, raw))
                for job_id, text, raw in ended if raw is not None]

    def _line(self, state: BatchState, job_id: str, text: bytes, read: Callable[[], GenerationResult]
              ) -> tuple[str, bool, bytes]:
        """The output or error line of a job that ended, as (job id, is_error, the line's JSON). A result
        that cannot be read or made into a line becomes this line's error: it never stops the others."""
        try:
            result = read()
            line = parse_line(text, _piece_of(job_id) + 1, None, state.object.endpoint)
            if isinstance(line, LineError):  # it parsed when it was submitted; only a change of code gets here
                return job_id, True, encode(error_line(line.custom_id, line.code, line.message, job_id))
            if result.status == "cancelled" and state.stop == "expired":
                return job_id, True, encode(error_line(line.custom_id, "batch_expired", EXPIRED, job_id))
            return (job_id, *outcome_line_json(line, job_id, result, int(time.time())))
        except Exception as exc:
            log.exception("batch %s: the result of %s cannot be written as a line", state.id, job_id)
            return job_id, True, encode(unreadable_line(_custom_id(text), job_id, exc))

    async def _write(self, state: BatchState, lines: Sequence[tuple[str, bool, dict[str, Any] | bytes]],
                     position: Optional[tuple[int, int]] = None) -> None:
        if not lines and position is None:
            return
        args: list[Any] = [position[0] if position else "", position[1] if position else 0, self._lists_ttl(state)]
        for job_id, is_error, line in lines:
            args += [job_id, "1" if is_error else "0", line if isinstance(line, bytes) else encode(line)]
        written = await self._collect(keys=[api_keys.batch_in_flight(state.id), api_keys.batch_lines(state.id, False),
                                            api_keys.batch_lines(state.id, True), api_keys.batch_record(state.id),
                                            api_keys.in_flight(state.tenant.tag)], args=args)
        if written:  # the tenant's storage, as the lines are written (producer/api/quota.py)
            await self._gw.files.quota.reserve(state.tenant, _usage_name(state.id), int(written),
                                               time.time() + self._lists_ttl(state), force=True)

    def _lists_ttl(self, state: BatchState) -> int:
        return max(int(state.object.expires_at or time.time()) - int(time.time()), 0) + RESULT_MARGIN_S

    async def _submit(self, state: BatchState) -> None:
        settings = self._gw.settings
        room = settings.batch_max_in_flight - await self._in_flight_count(state)
        start, offset = state.counts["next_piece"], state.counts["next_offset"]
        if room <= 0 or start >= state.counts["pieces"]:
            return
        record = await self._gw.files.get(state.tenant, state.object.input_file_id)
        # Each request line, with the file positions before and after it; `scanned` is where reading stopped.
        lines: list[tuple[str, bytes, BatchLine | LineError, tuple[int, int]]] = []
        scanned = (start, offset)
        for number, text, end in await self._gw.files.read_lines(record, start, offset, room + 64):
            if text.strip():
                if len(lines) == room:
                    break
                job_id = f"{state.tenant.tag}-{state.id.removeprefix('batch_')}-{number}"
                lines.append((job_id, text, parse_line(text, number + 1, settings.limits, state.object.endpoint),
                              scanned))
            scanned = (number + 1, end)
        lines = await self._known_models_only(lines)
        admitted = await self._gw.admission.admit(state.tenant, [job_id for job_id, *_ in lines]) if lines else 0
        taken = lines[:admitted]
        position = scanned if admitted == len(lines) else lines[admitted][3]
        valid = [(job_id, text, line) for job_id, text, line, _ in taken if isinstance(line, BatchLine)]
        invalid = [(job_id, line) for job_id, _, line, _ in taken if isinstance(line, LineError)]
        if invalid:
            await self._gw.admission.release(state.tenant, [job_id for job_id, _ in invalid])
        errors = [("", True, error_line(line.custom_id, line.code, line.message)) for _, line in invalid]
        if not valid:
            await self._write(state, errors, position)
            return
        options = job_options(timeout=settings.job_timeout_s, result_ttl=settings.batch_result_ttl)
        planned = plan_jobs([line.request for *_, line in valid], None, options, priority=settings.batch_priority,
                            job_ids=[job_id for job_id, *_ in valid])
        batch = CommandBatch(NO_CONNECTION)
        record_enqueue(batch, planned, await self._gw.client._redis_version())
        batch.hset(api_keys.batch_in_flight(state.id), mapping={job_id: text for job_id, text, _ in valid})
        batch.expire(api_keys.batch_in_flight(state.id), self._lists_ttl(state))
        batch.hset(api_keys.batch_record(state.id), mapping={"next_piece": position[0], "next_offset": position[1]})
        if await execute_batch(self._connection, batch, unless_exists=[Job.key_for(valid[0][0])]) is None:
            return  # a driver whose lease ran out submitted these already
        await self._write(state, errors)

    async def _known_models_only(self, lines: list[tuple[str, bytes, BatchLine | LineError, tuple[int, int]]]
                                 ) -> list[tuple[str, bytes, BatchLine | LineError, tuple[int, int]]]:
        """The lines, each naming a model no worker serves (any more: it was checked at validation) made an
        error line, never a job: its queue would be one nobody serves."""
        unknown = await self._gw.fleet.unknown(line.body.model for _, _, line, _ in lines if isinstance(line, BatchLine))
        if not unknown:
            return lines
        return [(job_id, text, _unknown_model(line.number, line.custom_id, line.body.model)
                 if isinstance(line, BatchLine) and line.body.model in unknown else line, scanned)
                for job_id, text, line, scanned in lines]

    # -- stopping and finishing

    async def _stop(self, state: BatchState) -> None:
        """Cancel what is in flight (unless the quota stops it: that lets them end); write every line never
        sent to the error file."""
        if state.stop != OVER_QUOTA:
            for raw in await self._connection.hkeys(api_keys.batch_in_flight(state.id)):
                await self._gw.cancel_quietly(raw.decode())
        start, offset = state.counts["next_piece"], state.counts["next_offset"]
        if start >= state.counts["pieces"]:
            return
        record = await self._gw.files.get(state.tenant, state.object.input_file_id)
        code, message = {
            "expired": ("batch_expired", EXPIRED),
            OVER_QUOTA: ("storage_quota_exceeded", f"this tenant's files reached its storage quota of "
                         f"{self._gw.files.quota.quota_bytes} bytes (MLXQ_API_FILE_QUOTA_BYTES) before this request "
                         "was sent"),
        }.get(state.stop or "", ("batch_cancelled", "the batch was cancelled before this request ended"))
        while start < state.counts["pieces"]:
            chunk = await self._gw.files.read_lines(record, start, offset, VALIDATE_CHUNK)
            if not chunk:
                break
            start, offset = chunk[-1][0] + 1, chunk[-1][2]
            lines = [("", True, error_line(_custom_id(text), code, message)) for _, text, _ in chunk if text.strip()]
            await self._write(state, lines, (start, offset))

    async def _finish(self, state: BatchState) -> None:
        batch = state.object
        now = int(time.time())
        batch.status, batch.finalizing_at = "finalizing", now
        await self._batches.save(state)
        ttl = state.output_ttl_s or self._gw.settings.file_ttl_s
        for is_error, attribute in ((False, "output_file_id"), (True, "error_file_id")):
            lines = state.counts["failed" if is_error else "completed"]
            if lines:
                made = await self._gw.files.create_from_list(
                    state.tenant, f"{state.id}_{'error' if is_error else 'output'}.jsonl",
                    api_keys.batch_lines(state.id, is_error), lines,
                    state.counts["err_bytes" if is_error else "out_bytes"], ttl)
                setattr(batch, attribute, made.id)
        await self._gw.files.quota.release(state.tenant, _usage_name(state.id))  # the files count it now
        final = {"cancelled": "cancelled", "expired": "expired"}.get(state.stop or "", "completed")
        batch.status = final  # type: ignore[assignment]
        setattr(batch, f"{final}_at", int(time.time()))
        await self._batches.save(state)
        await self._connection.srem(api_keys.ACTIVE_BATCHES, state.id)


def _groups(sized: list[tuple[str, int]], budget: int) -> Iterator[list[str]]:
    """The ids of `sized` ((id, bytes) pairs) in order, in groups of at most `budget` bytes (or one larger)."""
    group: list[str] = []
    total = 0
    for job_id, size in sized:
        if group and total + size > budget:
            yield group
            group, total = [], 0
        group.append(job_id)
        total += size
    if group:
        yield group


def _usage_name(batch_id: str) -> str:
    """What a batch's lines are counted under in its tenant's storage, until its files are made."""
    return f"batch:{batch_id}"


def _unknown_model(number: int, custom_id: str, model: str) -> LineError:
    return LineError(number, custom_id, f"line {number}: body.model: the model {model!r} does not exist (no worker "
                     "serves it)", "body.model", "model_not_found")


def _piece_of(job_id: str) -> int:
    return int(job_id.rsplit("-", 1)[1])


def _custom_id(text: bytes) -> Optional[str]:
    try:
        value = json.loads(text).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
