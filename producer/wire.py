"""What a producer puts on the wire and reads back, without any I/O: URLs, job options, RQ job
data and the commands that enqueue or cancel a job (recorded from rq's own helpers), result
parsing, statuses, the reading of token streams. `Client` (sync) and `AsyncClient` (asyncio) do
the I/O around these and nothing else."""

from __future__ import annotations

import functools
import os
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Optional, Union

import redis
from pydantic import ValidationError
from rq import Queue, Retry
from rq.job import Job, JobStatus, validate_job_id
from rq.queue import EnqueueData
from rq.registry import CanceledJobRegistry, ScheduledJobRegistry
from rq.results import Result

from producer.errors import InvalidRequest, JobNotFound, MlxqError, NoLiveWorker, NotDurable, StreamExpired
from schemas import broker
from schemas.command_batch import CommandBatch
from schemas.events import EndStreamEvent, TokenStreamEvent, event_data, parse_event
from schemas.result import request_echo
from schemas.serializer import JSON_SERIALIZER
from schemas import ErrorInfo, GenerationRequest, GenerationResult, InvalidRequestError, RequestLimits, Timings, keys

URL_ENV = "MLXQ_REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"

JOB_STATUSES = ("queued", "started", "finished", "failed", "cancelled", "deferred", "scheduled", "stopped")
RQ_ENDED = frozenset({"finished", "failed", "stopped", "canceled"})

RequestLike = Union[GenerationRequest, Mapping[str, Any]]


def resolve_url(url: str | None) -> str:
    """`url`, else $MLXQ_REDIS_URL, else the local default."""
    return url or os.environ.get(URL_ENV) or DEFAULT_URL


def check_live(planned: Sequence["PlannedJob"], live: frozenset[str], models: Iterable[str]) -> None:
    """`submit(require_live_worker=True)`: NoLiveWorker unless a live worker listens on every job's queue."""
    for job in planned:
        if job.queue not in live:
            served = ", ".join(sorted(models)) or "none"
            raise NoLiveWorker(f"no live worker listens on queue {job.queue!r}"
                               + (f" (model {job.request.model!r})" if job.request.model else "")
                               + f"; models served now: {served}. Nothing was enqueued.", job.queue)


def not_durable(exc: Exception, planned: Sequence["PlannedJob"]) -> NotDurable:
    ids = [job.job_id for job in planned]
    shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
    return NotDurable(f"{exc}: {len(ids)} job(s) enqueued but not yet safe from a failover of the primary: {shown}",
                      ids)


def redact_url(url: str) -> str:
    """The URL with any password replaced, for messages and reprs."""
    return broker.redact_url(url)


@dataclass(frozen=True)
class JobOptions:
    """RQ job options shared by every job of one submit call."""

    timeout: Optional[int] = None  # RQ job_timeout seconds; -1 = none; None = RQ's default (180)
    ttl: Optional[int] = None  # seconds the job may wait in its queue; None = forever
    result_ttl: int = keys.DEFAULT_RESULT_TTL  # -1 = keep forever
    retry: Optional[Retry] = None


def job_options(
    timeout: int | None = None,
    ttl: int | None = None,
    result_ttl: int | None = None,
    retry: Retry | int | None = None,
) -> JobOptions:
    """Check the options up front so a bad one never half-enqueues a batch."""
    for name, value, allow_forever in (("timeout", timeout, True), ("ttl", ttl, False), ("result_ttl", result_ttl, True)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequest(f"{name}: expected an integer number of seconds, got {value!r}", name)
        # result_ttl=0 would delete the result the moment it is written: nothing could read it.
        if value <= 0 and not (allow_forever and value == -1):
            hint = " (or -1 for no limit)" if allow_forever else ""
            raise InvalidRequest(f"{name}: must be a positive number of seconds{hint}, got {value}", name)
    if isinstance(retry, bool) or not (retry is None or isinstance(retry, (int, Retry))):
        raise InvalidRequest(f"retry: expected an rq.Retry or a number of retries, got {retry!r}", "retry")
    if isinstance(retry, int):
        if retry < 0:
            raise InvalidRequest(f"retry: must be >= 0, got {retry}", "retry")
        retry = Retry(max=retry) if retry else None
    return JobOptions(
        timeout=timeout,
        ttl=ttl,
        result_ttl=keys.DEFAULT_RESULT_TTL if result_ttl is None else result_ttl,
        retry=retry,
    )


@dataclass(frozen=True)
class PlannedJob:
    """One validated request, ready for `Queue.enqueue_many`."""

    job_id: str
    queue: str
    request: GenerationRequest
    data: EnqueueData


def validate_request(
    request: RequestLike, limits: RequestLimits | None = None, *, index: int | None = None
) -> GenerationRequest:
    """Validate one request; with `index`, errors name its position (`requests[3].max_tokens`)."""
    payload = dict(request) if isinstance(request, Mapping) else request
    try:
        return GenerationRequest.validate_payload(payload, limits)
    except InvalidRequestError as exc:
        raise InvalidRequest.from_schema_error(exc, index=index) from None


def describe(request: GenerationRequest) -> str:
    """A short RQ job description; RQ's default would repeat the whole prompt in the job hash."""
    parts = [keys.JOB_FUNCTION]
    if request.model:
        parts.append(f"model={request.model}")
    if request.custom_id:
        parts.append(f"custom_id={request.custom_id}")
    return " ".join(parts)


def check_priority(priority: str | None, priorities: Sequence[str]) -> None:
    """InvalidRequest unless `priority` is None or one of the client's `priorities`."""
    if priority is not None and priority not in priorities:
        raise InvalidRequest(f"priority: {priority!r} is not one of {list(priorities)}", "priority")


def target_queue(request: GenerationRequest, queue: str | None, priority: str | None) -> str:
    """`queue` if given, else the contract's queue for the request's model; `priority` then picks
    that queue's sibling (`mlxq:qwen@high`)."""
    return keys.priority_queue(queue or keys.queue_for_model(request.model), priority)


def plan_jobs(
    requests: Sequence[RequestLike],
    limits: RequestLimits | None,
    options: JobOptions,
    *,
    queue: str | None = None,
    priority: str | None = None,
    job_ids: Sequence[str | None] | None = None,
    indexed: bool = True,
    validated: bool = False,
) -> list[PlannedJob]:
    """Validate every request and build its job data; raises before anything is enqueued. With
    `validated`, requests that are GenerationRequests already validated against `limits` are not
    validated again."""
    if job_ids is not None and len(job_ids) != len(requests):
        raise InvalidRequest(f"job_ids: {len(job_ids)} ids for {len(requests)} requests", "job_ids")
    planned: list[PlannedJob] = []
    seen: set[str] = set()
    for i, raw in enumerate(requests):
        request = (raw if validated and isinstance(raw, GenerationRequest)
                   else validate_request(raw, limits, index=i if indexed else None))
        job_id = job_ids[i] if job_ids is not None else None
        if job_id is not None:
            field = f"job_ids[{i}]" if indexed else "job_id"
            try:
                validate_job_id(job_id)
            except (TypeError, ValueError) as exc:
                raise InvalidRequest(f"{field}: {exc}", field) from None
        else:
            job_id = str(uuid.uuid4())
        if job_id in seen:
            raise InvalidRequest(f"job_ids[{i}]: duplicate job id {job_id!r}", f"job_ids[{i}]")
        seen.add(job_id)
        data = Queue.prepare_data(
            keys.JOB_FUNCTION,
            kwargs={"request": request.to_payload()},
            timeout=options.timeout,
            result_ttl=options.result_ttl,
            failure_ttl=keys.failure_ttl(None, options.result_ttl),  # a failed job is kept as long as a result
            ttl=options.ttl,
            description=describe(request),
            job_id=job_id,
            retry=options.retry,
        )
        planned.append(PlannedJob(job_id, target_queue(request, queue, priority), request, data))
    return planned


# ---------------------------------------------------------------- rq's writes, recorded


class _NoConnection(redis.Redis):
    """The connection of rq objects that only record commands into a CommandBatch: any I/O is a bug."""

    def execute_command(self, *args: Any, **options: Any) -> NoReturn:
        raise RuntimeError(f"I/O through a recording-only rq object: {args[:2]!r}")

    def pipeline(self, *args: Any, **kwargs: Any) -> NoReturn:  # type: ignore[override]
        raise RuntimeError("I/O through a recording-only rq object: pipeline()")


NO_CONNECTION = _NoConnection()


@functools.lru_cache(maxsize=1024)
def _recording_queue(name: str, server_version: tuple[int, int, int]) -> Queue:
    queue = Queue(name, connection=NO_CONNECTION, serializer=JSON_SERIALIZER)
    queue.redis_server_version = server_version  # rq would ask the server (INFO) for it
    return queue


def parse_server_version(info: Mapping[str, Any]) -> tuple[int, int, int]:
    """The (major, minor, patch) of `INFO server`, as rq reads it."""
    parts = [int(p) for p in str(info["redis_version"]).split(".")[:3]] + [0, 0]
    return parts[0], parts[1], parts[2]


def record_enqueue(batch: CommandBatch, planned: Sequence[PlannedJob], server_version: tuple[int, int, int]) -> None:
    """Record rq's enqueue of every planned job (job hashes, queue pushes) into `batch`."""
    by_queue: dict[str, list[EnqueueData]] = {}
    for job in planned:
        by_queue.setdefault(job.queue, []).append(job.data)
    for name, datas in by_queue.items():
        _recording_queue(name, server_version).enqueue_many(datas, pipeline=batch)  # type: ignore[arg-type]


def job_from_hash(job_id: str, raw: Mapping[bytes, bytes]) -> Job:
    """An rq Job restored from its hash (`HGETALL rq:job:<id>`), for reading only."""
    job = Job(job_id, connection=NO_CONNECTION, serializer=JSON_SERIALIZER)
    job.restore(raw)
    return job


def cancel_removal(job: Job, status: str | None) -> tuple[Any, ...] | None:
    """The one atomic command that takes a waiting job out of where it waits (its queue, or the
    scheduled registry for a retry); None for a job some worker holds. Only the caller whose
    command removed it (reply 1) may then record its cancelled end."""
    if status == "queued":
        return ("LREM", f"{Queue.redis_queue_namespace_prefix}{job.origin}", 1, job.id)
    if status == "scheduled":
        return ("ZREM", ScheduledJobRegistry(job.origin, connection=NO_CONNECTION).key, job.id)
    return None


def cancelled_result_write(job: Job, now: float) -> tuple[str, str, int | None]:
    """(key, JSON, expiry) of the result of a job cancelled before any worker took it. The caller
    writes it first, as the contract orders it; under the documented producer ACL result keys are
    read-only, and then a worker's next sweep writes it (readers see RQ's canceled status meanwhile)."""
    result = cancelled_result(job.id, job_payload(job), job_enqueued_at(job), now)
    return keys.result_key(job.id), result.model_dump_json(), keys.result_key_ttl(job.result_ttl)


def record_cancelled(batch: CommandBatch, job: Job) -> None:
    """Record the rest of that job's end: RQ's canceled status and registry, expiries, the done message."""
    expiry = keys.result_key_ttl(job.result_ttl)
    job.set_status(JobStatus.CANCELED, pipeline=batch)  # type: ignore[arg-type]
    CanceledJobRegistry(job.origin, connection=NO_CONNECTION, serializer=JSON_SERIALIZER).add(
        job, pipeline=batch)  # type: ignore[arg-type]
    job.cleanup(ttl=expiry if expiry is not None else -1, pipeline=batch)  # type: ignore[arg-type]
    batch.publish(keys.done_channel(job.id), job.id)


def latest_result_detail(job_id: str, entries: Sequence[tuple[bytes, Mapping[bytes, bytes]]]) -> str | None:
    """The last line of the exception rq recorded for a job (`XREVRANGE rq:results:<id> + - COUNT 1`)."""
    if not entries:
        return None
    try:
        entry_id, payload = entries[0]
        result = Result.restore(job_id, entry_id.decode(), dict(payload), connection=NO_CONNECTION,
                                serializer=JSON_SERIALIZER)
        return result.exc_string.strip().splitlines()[-1] if result.exc_string else None
    except Exception:  # the detail is a courtesy; never fail the read over it
        return None


def results_stream_key(job_id: str) -> str:
    return Result.get_key(job_id)


@dataclass(frozen=True)
class JobState:
    """What Redis says about a job in one snapshot: its result key and its RQ status."""

    job_id: str
    result: Optional[GenerationResult]
    rq_status: Optional[str]  # None: the RQ job hash is gone (expired or never existed)

    @property
    def ended_without_result(self) -> bool:
        # The worker writes the result key before RQ marks the job ended (contract), so an
        # ended job without one was ended by something else: RQ's abandoned-job cleanup,
        # `rq` tooling, or a worker that does not speak mlxq.
        return self.result is None and self.rq_status in RQ_ENDED


def parse_result(job_id: str, raw: bytes | str) -> GenerationResult:
    try:
        return GenerationResult.model_validate_json(raw)
    except ValidationError as exc:
        raise MlxqError(f"malformed result for job {job_id}: {exc}") from exc


def job_state(job_id: str, raw_result: bytes | None, rawrq_status: bytes | None,
              parse: Callable[[str, bytes], GenerationResult] = parse_result) -> JobState:
    """Build a JobState from `GET mlxq:result:<id>` and `HGET rq:job:<id> status`, the result read by `parse`."""
    if raw_result is None and rawrq_status is None:
        raise JobNotFound(job_id)
    result = parse(job_id, raw_result) if raw_result is not None else None
    rq_status = rawrq_status.decode() if isinstance(rawrq_status, bytes) else rawrq_status
    return JobState(job_id, result, rq_status)


def public_status(state: JobState) -> str:
    """One of JOB_STATUSES. The result key's status wins over RQ's."""
    if state.result is not None:
        return state.result.status
    status = state.rq_status or "queued"
    return {"canceled": "cancelled", "created": "queued"}.get(status, status)


def cancelled_result(job_id: str, payload: Any, enqueued_at: float | None, now: float) -> GenerationResult:
    """The result written for a job cancelled before any worker took it."""
    return GenerationResult(
        id=job_id,
        status="cancelled",
        choices=[],
        timings=Timings(enqueued_at=enqueued_at, finished_at=now),
        **request_echo(payload),
    )


def orphan_result(
    job_id: str, rq_status: str, payload: Any, enqueued_at: float | None, detail: str | None
) -> GenerationResult:
    """Stand-in for a job RQ ended without an mlxq result (see JobState.ended_without_result)."""
    cancelled = rq_status in ("canceled", "stopped")
    message = f"RQ marked the job {rq_status} without writing {keys.result_key(job_id)}"
    return GenerationResult(
        id=job_id,
        status="cancelled" if cancelled else "failed",
        timings=Timings(enqueued_at=enqueued_at),
        error=None if cancelled else ErrorInfo(type="NoResult", message=f"{message}: {detail}" if detail else message),
        **request_echo(payload),
    )


def done_channels(job_ids: Iterable[str]) -> dict[bytes, str]:
    """Pub/sub channel (as redis-py returns it) -> job id."""
    return {keys.done_channel(job_id).encode(): job_id for job_id in job_ids}


def rq_status(job: Job) -> str | None:
    status = job.get_status(refresh=False)
    return None if status is None else str(getattr(status, "value", status))


def job_payload(job: Job) -> Any:
    try:
        return job.kwargs.get("request")
    except Exception:  # a foreign job (pickled, corrupt): the echo fields are optional
        return None


def job_enqueued_at(job: Job) -> float | None:
    return job.enqueued_at.timestamp() if job.enqueued_at else None


def job_ended_without_result(job_id: str, rq_status_: str, job: Job | None, detail: str | None) -> GenerationResult:
    """The stand-in result of a job RQ ended without one, from what could still be read of it."""
    payload = job_payload(job) if job is not None else None
    enqueued_at = job_enqueued_at(job) if job is not None else None
    return orphan_result(job_id, rq_status_, payload, enqueued_at, detail)


def lost_result(job_id: str) -> GenerationResult:
    """Stand-in for a job whose RQ hash and result both expired before anyone read the result."""
    return GenerationResult(id=job_id, status="failed", error=ErrorInfo(
        type="JobNotFound", message=f"job {job_id} and its result expired before the result was read"))


# ---------------------------------------------------------------- token streams

STREAM_START = "0-0"
# A stream reader blocks this long at most per read: below redis-py's socket timeout (5 s by
# default), which would otherwise cut a longer block, and often enough to notice a job that ended
# without a stream.
STREAM_POLL_S = 1.0
STREAM_BATCH = 256  # entries per read


def block_slice(timeout_left: float | None, socket_timeout: float | None) -> float:
    """Seconds one blocking stream read may take: at most STREAM_POLL_S, half the connection's socket
    timeout, and what is left of the caller's timeout; at least 1 ms (XREAD BLOCK 0 would never return)."""
    cap = STREAM_POLL_S if not socket_timeout else min(STREAM_POLL_S, socket_timeout / 2)
    if timeout_left is not None:
        cap = min(cap, timeout_left)
    return max(cap, 0.001)


# A Redis stream entry id: two unsigned 64-bit integers, `<ms>-<seq>` (`<ms>` alone means seq 0).
_EVENT_ID = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?")
_STREAM_ID_PART_MAX = 2**64 - 1


def parse_event_id(text: Any, field: str = "last_event_id") -> tuple[int, int]:
    """An event id as (ms, seq); InvalidRequest naming `field` unless it is one Redis takes (ASCII
    digits, each part below 2**64): a bad id checked here never reaches a read shared with others."""
    match = _EVENT_ID.fullmatch(text) if isinstance(text, str) else None
    if match is not None:
        major, minor = int(match[1]), int(match[2] or 0)
        if major <= _STREAM_ID_PART_MAX and minor <= _STREAM_ID_PART_MAX:
            return major, minor
    shown = repr(text)[:48]
    raise InvalidRequest(f"{field}: {shown} is not an event id (<ms>-<seq>: two integers of 0 to 2**64-1)", field)


class StreamCursor:
    """Where one reader of a job's token stream is, and which events to yield from what Redis returned.

    Events carry the ids of their stream entries; `last_event_id` is the id of the last event
    yielded, the place a reader resumes from after a dropped connection. A job that ended without
    a stream entry (one submitted without `stream`, or whose stream expired before anything was
    read) yields its result instead: one token event per choice with its whole text, then the end
    event, under ids `0-1`, `0-2`, ... that sort below every real entry. A stream that vanished after
    some of it was read cannot be finished that way: StreamExpired.
    """

    def __init__(self, job_id: str, last_event_id: str | None = None) -> None:
        self.job_id = job_id
        major, minor = parse_event_id(last_event_id or STREAM_START)
        self.last_event_id = f"{major}-{minor}"
        self.ended = False

    @property
    def live(self) -> bool:
        """Entries of the job's own stream were yielded: it exists, so a reader waits on it first
        and asks after the job's state only once it has been silent."""
        return self.last_event_id != STREAM_START and self._synthetic_position is None

    @property
    def _synthetic_position(self) -> int | None:
        """How many result-made events were yielded, or None once real entries were."""
        major, _, minor = self.last_event_id.partition("-")
        return int(minor or 0) if major == "0" else None

    def from_entries(self, entries: Sequence[tuple[Any, Mapping[bytes, bytes]]]) -> list[tuple[str, dict[str, Any]]]:
        """(id, event) pairs of the entries an XREAD returned, up to the end event."""
        events = []
        for entry_id, fields in entries:
            event = parse_event(dict(fields))
            events.append((entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id), event_data(event)))
            if event.event == "end":
                self.ended = True
                break
        return events

    def from_result(self, result: GenerationResult, stream_exists: bool) -> list[tuple[str, dict[str, Any]]]:
        """The job ended and the stream holds nothing after `last_event_id`: the events left to yield."""
        self.ended = True
        end = EndStreamEvent(status=result.status, finish_reasons=[c.finish_reason for c in result.choices])
        position = self._synthetic_position
        if stream_exists:  # a stream its worker never ended (it was killed): only the end is missing
            return [(self.last_event_id, end.model_dump())]
        if position is None:
            raise StreamExpired(self.job_id, self.last_event_id)
        made: list[TokenStreamEvent | EndStreamEvent] = [
            TokenStreamEvent(index=c.index, token_ids=c.token_ids, text=c.text, logprobs=c.logprobs,
                             top_logprobs=c.top_logprobs, reasoning_content=c.reasoning_content or None,
                             tool_calls=c.tool_calls or None)
            for c in result.choices if c.token_ids or c.text
        ]
        made.append(end)
        return [(f"0-{i}", event_data(event)) for i, event in enumerate(made, start=1) if i > position]
