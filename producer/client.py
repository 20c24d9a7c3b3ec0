"""Client: enqueue generation jobs, read their status and results, wait, cancel.

Jobs are plain RQ jobs (JSON serializer, function `worker.tasks.generate`, one kwarg
`request`); results are read from the contract's `mlxq:result:<id>` key. Everything that
does no I/O (validation, job data, key names, parsing) lives in module-level functions so
an asyncio twin can share it; the Client methods only talk to Redis.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any

import redis
from rq import Queue, Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import EnqueueData
from rq.registry import ScheduledJobRegistry

from producer.errors import BrokerError, JobNotFound, WaitTimeout, broker_errors
from producer.pubsub import read_burst
from producer.wire import (
    JobState,
    PlannedJob,
    RQ_ENDED,
    RequestLike,
    cancelled_result,
    done_channels,
    job_enqueued_at,
    job_options,
    job_payload,
    job_state,
    orphan_result,
    plan_jobs,
    public_status,
    redact_url,
    resolve_url,
    rq_status,
)
from schemas import GenerationResult, RequestLimits, keys
from schemas.command_batch import CommandBatch
from schemas.events import parse_event
from schemas.serializer import JSON_SERIALIZER

__all__ = ["CANCEL_TTL", "SAFETY_POLL_S", "Client"]

CANCEL_TTL = 24 * 3600  # seconds a cancel flag outlives its job, at most
# Waiters re-read the result key this often, in case a done message was missed (reconnects).
SAFETY_POLL_S = 2.0


# ---------------------------------------------------------------- the client


class Client:
    """A synchronous mlxq producer.

    `url` defaults to $MLXQ_REDIS_URL, else redis://127.0.0.1:6379/0; redis://, rediss:// and
    unix:// URLs may carry a password or ACL user. Pass `connection` to share an existing
    redis.Redis instead (it must not use decode_responses=True: RQ stores bytes); the client
    closes only a connection it opened. `limits` are operator caps checked before enqueueing.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        connection: redis.Redis | None = None,
        limits: RequestLimits | None = None,
    ) -> None:
        if connection is not None and url is not None:
            raise ValueError("pass url or connection, not both")
        if connection is None:
            self.url = resolve_url(url)
            try:
                connection = redis.Redis.from_url(self.url)
            except ValueError as exc:
                raise BrokerError(f"invalid Redis URL {redact_url(self.url)}: {exc}") from exc
            self._owns_connection = True
        else:
            self.url = ""
            self._owns_connection = False
        if connection.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("the Redis connection must not use decode_responses=True (RQ stores bytes)")
        self.connection: redis.Redis = connection
        self.limits = limits
        self._queues: dict[str, Queue] = {}

    def __repr__(self) -> str:
        return f"Client({redact_url(self.url) if self.url else self.connection!r})"

    # -- submitting

    def submit(
        self,
        request: RequestLike,
        *,
        queue: str | None = None,
        job_id: str | None = None,
        timeout: int | None = None,
        ttl: int | None = None,
        result_ttl: int | None = None,
        retry: Retry | int | None = None,
    ) -> str:
        """Validate `request` and enqueue it; returns the job id.

        `queue` defaults to `mlxq:<model>` (or `mlxq` without a model). `timeout` is the RQ
        job timeout, `ttl` how long the job may wait in its queue, `result_ttl` how long its
        result is kept (default 500 s, -1 forever), `retry` an rq.Retry or a retry count.
        Raises InvalidRequest (nothing enqueued) or BrokerError.
        """
        options = job_options(timeout, ttl, result_ttl, retry)
        planned = plan_jobs([request], self.limits, options, queue=queue, job_ids=[job_id], indexed=False)
        self._enqueue(planned)
        return planned[0].job_id

    def submit_many(
        self,
        requests: Iterable[RequestLike],
        *,
        queue: str | None = None,
        job_ids: Sequence[str] | None = None,
        timeout: int | None = None,
        ttl: int | None = None,
        result_ttl: int | None = None,
        retry: Retry | int | None = None,
    ) -> list[str]:
        """Validate every request, then enqueue them all in one Redis transaction.

        All or nothing: if any request is invalid, InvalidRequest names it
        (`requests[3].max_tokens: ...`) and nothing is enqueued. Returns the job ids in order.
        """
        options = job_options(timeout, ttl, result_ttl, retry)
        planned = plan_jobs(list(requests), self.limits, options, queue=queue, job_ids=job_ids)
        self._enqueue(planned)
        return [job.job_id for job in planned]

    def _queue(self, name: str) -> Queue:
        if name not in self._queues:
            self._queues[name] = Queue(name, connection=self.connection, serializer=JSON_SERIALIZER)
        return self._queues[name]

    def _enqueue(self, planned: Sequence[PlannedJob]) -> None:
        if not planned:
            return
        by_queue: dict[str, list[EnqueueData]] = {}
        for job in planned:
            by_queue.setdefault(job.queue, []).append(job.data)
        # One atomic call for every queue: one round trip, and all or nothing. A CommandBatch
        # rather than a MULTI/EXEC pipeline: half the producer's CPU per job (8,000 jobs: 0.53 s
        # against 1.0 s). (RQ reads the server version once per connection before the first enqueue.)
        with broker_errors():
            batch = CommandBatch(self.connection)
            for name, datas in by_queue.items():
                self._queue(name).enqueue_many(datas, pipeline=batch)
            batch.execute()

    # -- reading

    def _read_states(self, job_ids: Sequence[str]) -> list[JobState]:
        """One atomic snapshot of result keys and RQ statuses; JobNotFound for an unknown id."""
        with broker_errors(), self.connection.pipeline() as pipe:
            for job_id in job_ids:
                pipe.get(keys.result_key(job_id))
                pipe.hget(Job.key_for(job_id), "status")
            raw = pipe.execute()
        return [job_state(job_id, raw[2 * i], raw[2 * i + 1]) for i, job_id in enumerate(job_ids)]

    def _settled(self, state: JobState) -> GenerationResult | None:
        if state.result is not None:
            return state.result
        if state.ended_without_result:
            return self._orphan(state)
        return None

    def _orphan(self, state: JobState) -> GenerationResult:
        assert state.rq_status is not None
        payload, enqueued_at, detail = None, None, None
        with broker_errors():
            try:
                job = Job.fetch(state.job_id, connection=self.connection, serializer=JSON_SERIALIZER)
            except NoSuchJobError:
                job = None
            if job is not None:
                payload, enqueued_at = job_payload(job), job_enqueued_at(job)
                try:
                    latest = job.latest_result()
                    if latest is not None and latest.exc_string:
                        detail = latest.exc_string.strip().splitlines()[-1]
                except Exception:  # the detail is a courtesy; never fail the read over it
                    detail = None
        return orphan_result(state.job_id, state.rq_status, payload, enqueued_at, detail)

    def status(self, job_id: str) -> str:
        """One of "queued", "started", "finished", "failed", "cancelled", "deferred",
        "scheduled", "stopped". The result key's status wins over RQ's; JobNotFound if neither exists."""
        return public_status(self._read_states([job_id])[0])

    def result(self, job_id: str) -> GenerationResult | None:
        """The job's result, or None while it has none yet; JobNotFound for an unknown job.

        A job that RQ ended without an mlxq result (e.g. its worker was killed and RQ
        cleaned it up) gets a stand-in result with status failed (error type NoResult) or cancelled.
        """
        return self._settled(self._read_states([job_id])[0])

    def wait(self, job_id: str, timeout: float | None = None) -> GenerationResult:
        """Block until the job has a result (finished, failed or cancelled) and return it.

        Subscribes to the job's done channel, so it returns as soon as the worker publishes,
        without polling; re-reads the result key every ~2 s in case a message was missed.
        Raises WaitTimeout after `timeout` seconds (None: no limit), JobNotFound for an unknown job.
        """
        return self.wait_many([job_id], timeout)[job_id]

    def wait_many(self, job_ids: Iterable[str], timeout: float | None = None) -> dict[str, GenerationResult]:
        """Like `wait` for several jobs over one subscription; returns {job_id: result}.

        WaitTimeout carries the ids still pending in `.pending`.
        """
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return {}
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        results: dict[str, GenerationResult] = {}
        pending = set(ids)

        def settle(candidates: Iterable[str]) -> None:
            wanted = [job_id for job_id in candidates if job_id in pending]
            for state in self._read_states(wanted) if wanted else []:
                found = self._settled(state)
                if found is not None:
                    results[state.job_id] = found
                    pending.discard(state.job_id)

        settle(ids)  # fast path: already done, no subscription needed
        if not pending:
            return {job_id: results[job_id] for job_id in ids}
        with broker_errors():
            pubsub = self.connection.pubsub()
            try:
                channels = done_channels(pending)
                pubsub.subscribe(*channels)
                # Wait for the subscribe confirmations before reading again: only then can no
                # publish slip between that read and the subscription.
                confirmed = 0
                while confirmed < len(channels):
                    message = pubsub.get_message(timeout=_time_left(deadline, SAFETY_POLL_S))
                    if message is not None and message["type"] == "subscribe":
                        confirmed += 1
                    elif message is None and deadline is not None and time.monotonic() >= deadline:
                        break
                settle(list(pending))
                next_poll = time.monotonic() + SAFETY_POLL_S
                while pending:
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        late = [job_id for job_id in ids if job_id in pending]
                        shown = ", ".join(late[:5]) + (", ..." if len(late) > 5 else "")
                        raise WaitTimeout(f"no result after {timeout} s for {len(late)} job(s): {shown}", late)
                    messages, whole = read_burst(pubsub, _time_left(deadline, max(next_poll - now, 0.0)))
                    woken = {channels[m["channel"]] for m in messages
                             if m["type"] == "message" and m["channel"] in channels}
                    if not whole or time.monotonic() >= next_poll:
                        settle(list(pending))
                        next_poll = time.monotonic() + SAFETY_POLL_S
                    elif woken:
                        settle(woken)
            finally:
                pubsub.close()
        return {job_id: results[job_id] for job_id in ids}

    # -- cancelling

    def cancel(self, job_id: str) -> bool:
        """Ask for the job to stop; returns False if it had already ended.

        Sets `mlxq:cancel:<id>` (a running job's worker ends the sequence within one step
        and writes a cancelled result). A job still waiting in its queue (or scheduled for
        a retry) is removed from it right here, marked canceled in RQ, and gets a cancelled
        result. Raises JobNotFound for an unknown job.
        """
        with broker_errors():
            try:
                job = Job.fetch(job_id, connection=self.connection, serializer=JSON_SERIALIZER)
            except NoSuchJobError:
                if self.connection.exists(keys.result_key(job_id)):
                    return False
                raise JobNotFound(job_id) from None
            status = rq_status(job)
            if status in RQ_ENDED or self.connection.exists(keys.result_key(job_id)):
                return False
            self.connection.set(keys.cancel_key(job_id), "1", ex=CANCEL_TTL)
            # LREM / ZREM are atomic: only the caller that actually removed the job finishes it,
            # so a worker that popped it meanwhile (and sees the flag) never races this write.
            if status == "queued":
                removed = self._queue(job.origin).remove(job)
            elif status == "scheduled":
                removed = ScheduledJobRegistry(queue=self._queue(job.origin)).remove(job)
            else:
                removed = 0
            if removed:
                self._finish_cancelled(job)
        return True

    def _finish_cancelled(self, job: Job) -> None:
        result = cancelled_result(job.id, job_payload(job), job_enqueued_at(job), time.time())
        expiry = keys.result_key_ttl(job.result_ttl)
        # The result first, as the contract orders it. Under the documented producer ACL result keys
        # are read-only (producers must not forge results): then the job is only marked cancelled in
        # RQ, which every mlxq reader reports as cancelled at once, and a worker's next sweep writes
        # the key.
        try:
            self.connection.set(keys.result_key(job.id), result.model_dump_json(), ex=expiry)
        except redis.exceptions.NoPermissionError:
            pass
        with self.connection.pipeline() as pipe:
            # Job.cancel tests `pipeline or ...`: an empty Pipeline is falsy, and it would run on a
            # pipeline of its own that is never executed. The publish keeps `pipe` non-empty.
            pipe.publish(keys.done_channel(job.id), job.id)
            job.cancel(pipeline=pipe)
            job.cleanup(ttl=expiry if expiry is not None else -1, pipeline=pipe)
            pipe.execute()

    # -- lifecycle

    def stream(self, job_id: str, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield a streaming job's events as the worker writes them (one XADD per choice per
        decode step): `{"event": "token", "index", "token_ids", "text"}`, then one
        `{"event": "end", "status", "finish_reasons"}`. The texts of a choice add up to its
        final `text`; its token_ids to its `token_ids`. Raises WaitTimeout if no event arrives
        within `timeout` seconds (None: wait as long as it takes)."""
        last_id = "0-0"
        block_ms = 0 if timeout is None else max(1, int(timeout * 1000))
        while True:
            with broker_errors():
                batch = self.connection.xread({keys.stream_key(job_id): last_id}, block=block_ms, count=256)
            if not batch:
                raise WaitTimeout(f"no stream event for job {job_id} within {timeout} s", pending=[job_id])
            for entry_id, fields in batch[0][1]:
                last_id = entry_id
                event = parse_event(fields)
                yield event.model_dump()
                if event.event == "end":
                    return

    def close(self) -> None:
        """Close the connection if this client opened it."""
        if self._owns_connection:
            self.connection.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _time_left(deadline: float | None, cap: float) -> float:
    """Seconds to block: at most `cap`, never past `deadline`."""
    if deadline is None:
        return cap
    return max(0.0, min(cap, deadline - time.monotonic()))
