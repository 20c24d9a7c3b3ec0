"""The producer's exceptions: one hierarchy under MlxqError.

Each also subclasses the builtin a caller would naturally catch (ValueError, KeyError,
TimeoutError, ConnectionError). Redis errors become BrokerError in one place,
`broker_errors()`, so callers never need to import redis to handle them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import redis

from schemas import InvalidRequestError

__all__ = ["BrokerError", "InvalidRequest", "JobNotFound", "MlxqError", "NoLiveWorker", "NotDurable", "StreamExpired",
           "WaitTimeout", "broker_errors"]


class MlxqError(Exception):
    """Base class of every error mlxq raises on purpose."""


class InvalidRequest(MlxqError, ValueError):
    """A request (or a job option) failed validation; nothing was enqueued.

    `field` is the dotted path of the first bad field, e.g. `max_tokens` or
    `requests[3].max_tokens` when it came from `submit_many`.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    @classmethod
    def from_schema_error(cls, exc: InvalidRequestError, *, index: int | None = None) -> "InvalidRequest":
        """Wrap a schemas.InvalidRequestError; with `index`, name the request's position."""
        if index is None:
            return cls(str(exc), exc.field)
        prefix = f"requests[{index}]"
        body = str(exc).removeprefix("invalid request: ")
        field = f"{prefix}.{exc.field}" if exc.field else prefix
        if exc.field and body.startswith(f"{exc.field}:"):
            message = f"invalid request: {prefix}.{body}"
        else:
            message = f"invalid request: {prefix}: {body}"
        return cls(message, field)


class JobNotFound(MlxqError, KeyError):
    """Neither the RQ job nor its result key exists (unknown id, or both expired)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id

    def __str__(self) -> str:  # KeyError would print only repr(job_id)
        return f"no such job: {self.job_id}"


class WaitTimeout(MlxqError, TimeoutError):
    """A wait ran out of time. `pending` holds the ids that had no result yet."""

    def __init__(self, message: str, pending: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.pending = tuple(pending)


class StreamExpired(MlxqError, LookupError):
    """A job's token stream expired (or was deleted) after part of it was read: the rest cannot be
    streamed. The job's result, while it lasts, holds the whole text (`result(job_id)`)."""

    def __init__(self, job_id: str, last_event_id: str) -> None:
        super().__init__(f"the token stream of job {job_id} is gone after event {last_event_id}; "
                         "read the whole text with result()")
        self.job_id = job_id
        self.last_event_id = last_event_id


class BrokerError(MlxqError, ConnectionError):
    """Redis could not be reached, refused the command, or rejected the credentials."""


class NotDurable(BrokerError):
    """A `durable=True` submit: the jobs are enqueued on the primary, but fewer replicas than asked
    confirmed them in time, so they would be lost if the primary failed now. `job_ids` names them:
    they may still run (check with `status`), or submit them again under the same ids."""

    def __init__(self, message: str, job_ids: Sequence[str]) -> None:
        super().__init__(message)
        self.job_ids = tuple(job_ids)


class NoLiveWorker(MlxqError, LookupError):
    """No live worker listens on the queue a job is for: raised by `submit(require_live_worker=True)`
    (nothing enqueued), and by `wait(no_worker_timeout=N)` once no live worker has listened on a
    pending job's queue for N seconds (the job still waits in its queue; its TTL decides how long).
    `queue` names the queue, `job_ids` the jobs (empty for a submit)."""

    def __init__(self, message: str, queue: str, job_ids: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.queue = queue
        self.job_ids = tuple(job_ids)


@contextmanager
def broker_errors() -> Iterator[None]:
    """Translate redis-py errors raised inside the block into BrokerError."""
    try:
        yield
    except redis.RedisError as exc:
        raise BrokerError(f"redis: {type(exc).__name__}: {exc}") from exc
