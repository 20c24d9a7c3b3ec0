"""Reading the job hashes producers wrote, defensively.

Any producer, in any language, may write an RQ job hash by hand, so every field rq's `Job.restore`
parses is checked here first, with the parser rq uses and a range rq does not check: a job hash
becomes an rq `Job`, or an `Unreadable` that names the broken field. Nothing a producer writes can
raise out of `read_job`. Job data is decompressed here with a bound (rq's own `zlib.decompress` has
none), webhooks are dropped (a worker never calls a URL a job names) and so are repeats.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import redis
from rq.job import JOB_ID_PATTERN, Job, JobStatus
from rq.utils import parse_timeout, str_to_date

from schemas import keys
from schemas.scripts import Script
from schemas.serializer import JSON_SERIALIZER

# Longest job id a worker identifies: its result key is written under it.
MAX_JOB_ID_CHARS = 512
# Seconds: larger TTLs and timeouts overflow Redis's EXPIRE arithmetic or mean "never" by accident.
MAX_SECONDS = 10**9
MAX_RETRIES_FIELD = 10**9


# Statuses after which a job never runs again (rq's retry and re-queue set `queued` or `scheduled` first).
ENDED_STATUSES = ("finished", "failed", "stopped", "canceled")

# Lua: the job hash under `key`, or a note of why it is not sent (a key that is not a hash, too many
# fields, more than `max_bytes` of memory; with `check_ended`, a job that has ended already: its
# result key exists or its status is final), which `read_job` turns into an Unreadable; nil for a
# key that does not exist. The poll scripts (worker/poll.py) take jobs through it, with the check,
# in the same script that moves the id off its queue: a job cannot end between the check and its start.
READ_JOB_LUA = """
local ENDED = {%s}
local function read_job(key, job_id, check_ended, max_bytes)
  local kind = redis.call('TYPE', key).ok
  if kind == 'none' then return nil end
  if check_ended and redis.call('EXISTS', '%s' .. job_id) == 1 then return 'ended:result' end
  if kind ~= 'hash' then return 'type:' .. kind end
  if check_ended then
    local status = redis.call('HGET', key, 'status')
    if status and ENDED[status] then return 'ended:' .. status end
  end
  local fields = redis.call('HLEN', key)
  if fields > 64 then return 'fields:' .. fields end
  local size = redis.call('MEMORY', 'USAGE', key, 'SAMPLES', 0) or 0
  if size > max_bytes then return 'size:' .. size end
  return redis.call('HGETALL', key)
end
""" % (", ".join(f"['{status}'] = true" for status in ENDED_STATUSES), keys.result_key(""))
_FETCH_SCRIPT = READ_JOB_LUA + "return read_job(KEYS[1], ARGV[2], ARGV[3] == '1', tonumber(ARGV[1]))"

JobFields = Union[dict[bytes, bytes], bytes]  # a job hash, or READ_JOB_LUA's note of why it was not sent


def as_job_fields(reply: Any) -> Optional[JobFields]:
    """READ_JOB_LUA's reply as `read_job` takes it."""
    if reply is None or isinstance(reply, bytes):
        return reply
    return dict(zip(reply[::2], reply[1::2]))


def fetch_job_fields(connection: redis.Redis, job_id: str, max_job_bytes: int, check_ended: bool = False
                     ) -> Optional[JobFields]:
    """A job's hash (or why it cannot be sent) by id, outside a poll; None if there is no such key.
    `check_ended`: a job that has ended already comes back as a note that says so."""
    return as_job_fields(Script(connection, _FETCH_SCRIPT)(
        keys=[Job.key_for(job_id)], args=[max_job_bytes, job_id, "1" if check_ended else "0"]))


@dataclass(frozen=True)
class Unreadable:
    """A queue entry that cannot run. `job_id` is None when the entry cannot even be identified
    (not UTF-8, empty, too long): such an entry gets no result key, only a log line."""

    raw_id: bytes
    job_id: Optional[str]
    field: str
    message: str
    payload: Any = None  # the request, when it could be read: the failed result echoes its ids
    # A job that has ended already ("result": its result key exists; else its hash's final status):
    # it is not run again, its hash is left as it is, and a result is written only if it has none.
    ended: Optional[str] = None

    @property
    def is_hash(self) -> bool:
        """Whether a job hash exists under this id that may be marked failed: not one that has ended."""
        return self.field not in ("job", "id") and self.ended is None


def identify(raw_id: bytes) -> Optional[str]:
    try:
        job_id = raw_id.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not job_id or len(job_id) > MAX_JOB_ID_CHARS or not job_id.isprintable():
        return None
    return job_id


def _seconds(raw: bytes) -> None:
    value = parse_timeout(raw.decode())
    if value is None or not -1 <= value <= MAX_SECONDS:
        raise ValueError(f"{value} is outside -1..{MAX_SECONDS} seconds")


def _count(raw: bytes) -> None:
    value = int(raw)
    if not 0 <= value <= MAX_RETRIES_FIELD:
        raise ValueError(f"{value} is outside 0..{MAX_RETRIES_FIELD}")


def _flag(raw: bytes) -> None:
    if int(raw) not in (0, 1):
        raise ValueError("expected 0 or 1")


def _int_list(raw: bytes) -> None:
    value = json.loads(raw.decode())
    if not isinstance(value, list) or not all(isinstance(v, int) and 0 <= v <= MAX_SECONDS for v in value):
        raise ValueError("expected a JSON list of whole seconds")


def _id_list(raw: bytes) -> None:
    value = json.loads(raw.decode())
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("expected a JSON list of job ids")


def _status(raw: bytes) -> None:
    JobStatus(raw.decode())


def _date(raw: bytes) -> None:
    str_to_date(raw)


def _text(raw: bytes) -> None:
    raw.decode("utf-8")


# Every field rq's Job.restore reads, with a check that raises where its parser would (or where a
# later write of rq's would fail). Fields not named here are not read by rq.
FIELD_CHECKS: dict[str, Callable[[bytes], None]] = {
    "created_at": _date, "enqueued_at": _date, "started_at": _date, "ended_at": _date, "last_heartbeat": _date,
    "timeout": _seconds, "result_ttl": _seconds, "failure_ttl": _seconds, "ttl": _seconds,
    "success_callback_timeout": _seconds, "failure_callback_timeout": _seconds, "stopped_callback_timeout": _seconds,
    "number_of_retries": _count, "retries_left": _count, "repeats_left": _count,
    "retry_intervals": _int_list, "repeat_intervals": _int_list, "dependency_ids": _id_list,
    "allow_dependency_failures": _flag, "enqueue_at_front": _flag, "enqueue_at_front_on_retry": _flag,
    "status": _status, "origin": _text, "worker_name": _text, "description": _text, "group_id": _text,
    "success_callback_name": _text, "failure_callback_name": _text, "stopped_callback_name": _text,
    "dependency_id": _text,
}
# Fields whose presence (not only their value) rq reads: an empty value still reaches int().
PRESENCE_FIELDS = ("success_callback_timeout", "failure_callback_timeout", "stopped_callback_timeout",
                   "enqueue_at_front")


def decompress_bounded(data: bytes, max_bytes: int) -> bytes:
    """The job's data, inflated if it is zlib-compressed (as rq allows), never past `max_bytes`."""
    inflater = zlib.decompressobj()
    try:
        inflated = inflater.decompress(data, max_bytes + 1)
    except zlib.error:
        return data  # not compressed: rq reads it as is
    if len(inflated) > max_bytes or inflater.unconsumed_tail:
        raise ValueError(f"decompresses to more than {max_bytes} bytes (MLXQ_MAX_JOB_BYTES)")
    return inflated


def read_job(raw_id: bytes, fields: JobFields, connection: redis.Redis,
             max_job_bytes: int) -> Union[Job, Unreadable]:
    """The job taken from a queue: `fields` is its hash, or the poll's note of why it sent none
    (a key that is not a hash, a hash over the size limit)."""
    job_id = identify(raw_id)
    if job_id is None:
        return Unreadable(raw_id, None, "id", "not a readable job id (empty, not UTF-8, or too long)")
    if isinstance(fields, bytes):
        note = fields.decode(errors="replace")
        if note.startswith("ended:"):
            return already_ended(raw_id, job_id, note.removeprefix("ended:"))
        return Unreadable(raw_id, job_id, *_poll_note(note, max_job_bytes))
    if not JOB_ID_PATTERN.fullmatch(job_id):
        return Unreadable(raw_id, job_id, "id", f"job id {job_id!r} is not one rq accepts: letters, digits, "
                                                "underscores and dashes only")
    refusal = _broken_field(fields, max_job_bytes)
    if refusal is not None:
        return Unreadable(raw_id, job_id, *refusal, payload=_request_echo_source(fields, max_job_bytes))
    fields = {**fields, b"data": decompress_bounded(fields[b"data"], max_job_bytes)}
    job = Job(job_id, connection=connection, serializer=JSON_SERIALIZER)
    try:
        job.restore(fields)
    except Exception as exc:  # a combination the checks above did not foresee
        return Unreadable(raw_id, job_id, "job", f"rq could not read this job hash: {type(exc).__name__}: {exc}")
    job.webhooks = []
    # A generation job runs once: rq's Repeat would run it again after it finished, without end
    # for a hash that asks for a million repeats.
    job.repeats_left = None
    return job


def already_ended(raw_id: bytes, job_id: str, ended: str) -> Unreadable:
    """A queue entry for a job that has ended: a job runs once, and its first result stays."""
    why = ("its result key exists" if ended == "result" else f"its hash says {ended!r}")
    return Unreadable(raw_id, job_id, "status", f"status: job {job_id} has ended already ({why}); a job runs "
                                                "once and its result is never replaced, so it was not run again",
                      ended=ended)


def _poll_note(note: str, max_job_bytes: int) -> tuple[str, str]:
    kind, _, detail = note.partition(":")
    if kind == "type":
        return "job", f"the job key holds a Redis {detail}, not a hash"
    if kind == "size":
        return "data", f"data: the job hash takes {detail} bytes, over the limit of {max_job_bytes} (MLXQ_MAX_JOB_BYTES)"
    return "job", f"the job hash has {detail} fields; an rq job has fewer than 64"


def _broken_field(fields: dict[bytes, bytes], max_job_bytes: int) -> Optional[tuple[str, str]]:
    if not fields.get(b"data"):
        return "data", "the job hash has no `data` field (the job's function and arguments)"
    try:
        decompress_bounded(fields[b"data"], max_job_bytes)
    except ValueError as exc:
        return "data", f"job data {exc}"
    for name, check in FIELD_CHECKS.items():
        raw = fields.get(name.encode())
        if raw is None or (not raw and name not in PRESENCE_FIELDS):
            continue
        try:
            check(raw)
        except Exception as exc:
            shown = raw[:40].decode(errors="replace")
            return name, f"{name}: cannot read {shown!r}: {exc}"
    return None


def _request_echo_source(fields: dict[bytes, bytes], max_job_bytes: int) -> Any:
    """The request of a refused job, if its data reads, for the failed result's custom_id and model."""
    try:
        _, _, _, kwargs = json.loads(decompress_bounded(fields.get(b"data") or b"", max_job_bytes))
        return kwargs.get("request") if isinstance(kwargs, dict) else None
    except Exception:
        return None


def describe_deserialization_error(exc: BaseException) -> str:
    """What was wrong with a job's data when rq could not decode it (DeserializationError's cause)."""
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        return "job data: JSON nested too deeply to decode"
    if isinstance(cause, (TypeError, ValueError)) and not isinstance(cause, (json.JSONDecodeError, UnicodeDecodeError)):
        return "job data: expected the JSON array [function, null, args, kwargs]"
    return ("job data is not valid JSON: mlxq workers read jobs with rq.serializers.JSONSerializer only and "
            "never unpickle")
