"""What a producer puts on the wire and reads back, without any I/O: URLs, job options, RQ job
data, result parsing, statuses. `Client` (sync) does the I/O around these; an asyncio twin can
reuse them unchanged."""

from __future__ import annotations


import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union
from urllib.parse import urlsplit, urlunsplit

from pydantic import ValidationError
from rq import Queue, Retry
from rq.job import Job, validate_job_id
from rq.queue import EnqueueData

from producer.errors import InvalidRequest, JobNotFound, MlxqError
from schemas.result import request_echo
from schemas import ErrorInfo, GenerationRequest, GenerationResult, InvalidRequestError, RequestLimits, Timings, keys

URL_ENV = "MLXQ_REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"

JOB_STATUSES = ("queued", "started", "finished", "failed", "cancelled", "deferred", "scheduled", "stopped")
RQ_ENDED = frozenset({"finished", "failed", "stopped", "canceled"})

RequestLike = Union[GenerationRequest, Mapping[str, Any]]


def resolve_url(url: str | None) -> str:
    """`url`, else $MLXQ_REDIS_URL, else the local default."""
    return url or os.environ.get(URL_ENV) or DEFAULT_URL


def redact_url(url: str) -> str:
    """The URL with any password replaced, for messages and reprs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


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


def plan_jobs(
    requests: Sequence[RequestLike],
    limits: RequestLimits | None,
    options: JobOptions,
    *,
    queue: str | None = None,
    job_ids: Sequence[str | None] | None = None,
    indexed: bool = True,
) -> list[PlannedJob]:
    """Validate every request and build its job data; raises before anything is enqueued."""
    if job_ids is not None and len(job_ids) != len(requests):
        raise InvalidRequest(f"job_ids: {len(job_ids)} ids for {len(requests)} requests", "job_ids")
    planned: list[PlannedJob] = []
    seen: set[str] = set()
    for i, raw in enumerate(requests):
        request = validate_request(raw, limits, index=i if indexed else None)
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
            ttl=options.ttl,
            description=describe(request),
            job_id=job_id,
            retry=options.retry,
        )
        planned.append(PlannedJob(job_id, queue or keys.queue_for_model(request.model), request, data))
    return planned


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


def job_state(job_id: str, raw_result: bytes | None, rawrq_status: bytes | None) -> JobState:
    """Build a JobState from `GET mlxq:result:<id>` and `HGET rq:job:<id> status`."""
    if raw_result is None and rawrq_status is None:
        raise JobNotFound(job_id)
    result = parse_result(job_id, raw_result) if raw_result is not None else None
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
