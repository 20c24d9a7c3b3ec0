"""Client: enqueue generation jobs, read their status and results, wait, stream, cancel.

Jobs are plain RQ jobs (JSON serializer, function `worker.tasks.generate`, one kwarg
`request`); results are read from the contract's `mlxq:result:<id>` key. Everything that
does no I/O (validation, job data, the commands rq would send, parsing, stream reading) lives in
producer/wire.py, shared with the asyncio twin (producer/aio.py); the Client methods only talk to Redis.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any

import redis
from rq import Retry
from rq.job import Job
from rq.utils import get_version

from producer.control import (ControlCalls, abort_target, adapter_command, control_command, job_model, pause_command,
                              weights_command)
from producer.errors import BrokerError, JobNotFound, WaitTimeout, broker_errors
from producer.presence import LiveModel, UnservedWatch, live_models, live_queues, read_live
from producer.pubsub import read_burst
from producer.wire import (
    RQ_ENDED,
    JobState,
    PlannedJob,
    RequestLike,
    StreamCursor,
    block_slice,
    cancel_removal,
    cancelled_result_write,
    check_live,
    check_priority,
    done_channels,
    job_ended_without_result,
    job_from_hash,
    job_options,
    job_state,
    latest_result_detail,
    not_durable,
    plan_jobs,
    public_status,
    record_cancelled,
    record_enqueue,
    redact_url,
    resolve_url,
    results_stream_key,
    rq_status,
    STREAM_BATCH,
)
from schemas import GenerationResult, RequestLimits, broker, keys
from schemas.control import ControlCommand, ControlOutcome, PauseMode, WeightPolicy
from schemas.redis_busy import sync_parser
from schemas.command_batch import CommandBatch
from schemas.durability import Durability, NotReplicated

__all__ = ["CANCEL_TTL", "SAFETY_POLL_S", "Client", "JobStream"]

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
    `priorities` are the names `submit(priority=...)` accepts (docs/producer.md). A
    `redis+sentinel://host:port[,host:port...]/service_name[/db]` URL follows the primary the sentinels
    name through a failover (docs/operations.md). `durability` is what `submit(durable=True)` waits for
    (default: one replica, 2 s).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        connection: redis.Redis | None = None,
        limits: RequestLimits | None = None,
        priorities: Sequence[str] = keys.DEFAULT_PRIORITIES,
        durability: Durability | None = None,
    ) -> None:
        if connection is not None and url is not None:
            raise ValueError("pass url or connection, not both")
        if connection is None:
            self.url = resolve_url(url)
            try:
                connection = broker.connect(self.url, parser_class=sync_parser())
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
        self.priorities = tuple(priorities)
        self.durability = durability or Durability()
        self._control = ControlCalls(connection)

    def __repr__(self) -> str:
        return f"Client({redact_url(self.url) if self.url else self.connection!r})"

    # -- submitting

    def submit(
        self,
        request: RequestLike,
        *,
        queue: str | None = None,
        priority: str | None = None,
        job_id: str | None = None,
        timeout: int | None = None,
        ttl: int | None = None,
        result_ttl: int | None = None,
        retry: Retry | int | None = None,
        durable: bool = False,
        require_live_worker: bool = False,
    ) -> str:
        """Validate `request` and enqueue it; returns the job id.

        `queue` defaults to `mlxq:<model>` (or `mlxq` without a model); `priority` (one of the
        client's `priorities`) sends it to that queue's `@<priority>` sibling instead, "default"
        to the queue itself. `timeout` is the RQ job timeout, `ttl` how long the job may wait in
        its queue, `result_ttl` how long its result is kept (default 500 s, -1 forever), `retry`
        an rq.Retry or a retry count. Raises InvalidRequest (nothing enqueued) or BrokerError.

        `durable`: return only once a replica has the job too (the client's `durability`), so a failover
        of the primary cannot lose it; NotDurable (a BrokerError naming the ids) if none confirmed in
        time. `require_live_worker`: NoLiveWorker, and nothing enqueued, unless a live worker listens
        on the job's queue (without it a job for a model nobody serves waits in its queue, `ttl` deciding how long).
        """
        check_priority(priority, self.priorities)
        options = job_options(timeout, ttl, result_ttl, retry)
        planned = plan_jobs([request], self.limits, options, queue=queue, priority=priority, job_ids=[job_id],
                            indexed=False)
        self._enqueue(planned, durable, require_live_worker)
        return planned[0].job_id

    def submit_many(
        self,
        requests: Iterable[RequestLike],
        *,
        queue: str | None = None,
        priority: str | None = None,
        job_ids: Sequence[str] | None = None,
        timeout: int | None = None,
        ttl: int | None = None,
        result_ttl: int | None = None,
        retry: Retry | int | None = None,
        durable: bool = False,
        require_live_worker: bool = False,
    ) -> list[str]:
        """Validate every request, then enqueue them all in one Redis transaction.

        All or nothing: if any request is invalid, InvalidRequest names it
        (`requests[3].max_tokens: ...`) and nothing is enqueued. Returns the job ids in order.
        `durable` and `require_live_worker` as for `submit`, for the whole batch.
        """
        check_priority(priority, self.priorities)
        options = job_options(timeout, ttl, result_ttl, retry)
        planned = plan_jobs(list(requests), self.limits, options, queue=queue, priority=priority, job_ids=job_ids)
        self._enqueue(planned, durable, require_live_worker)
        return [job.job_id for job in planned]

    def _enqueue(self, planned: Sequence[PlannedJob], durable: bool = False, require_live_worker: bool = False) -> None:
        if not planned:
            return
        # One atomic call for every queue: one round trip, and all or nothing. A CommandBatch
        # rather than a MULTI/EXEC pipeline: half the producer's CPU per job (8,000 jobs: 0.53 s
        # against 1.0 s). (RQ reads the server version once per connection before the first enqueue.)
        with broker_errors():
            if require_live_worker:
                workers = read_live(self.connection)
                check_live(planned, live_queues(workers), live_models(workers))
            batch = CommandBatch(self.connection)
            record_enqueue(batch, planned, get_version(self.connection))
            try:
                batch.execute(durability=self.durability if durable else None)
            except NotReplicated as exc:
                raise not_durable(exc, planned) from exc

    def models(self) -> list[LiveModel]:
        """The models live workers serve now (from their heartbeats), by name: how many workers
        serve each, and the queues they listen on."""
        with broker_errors():
            return list(live_models(read_live(self.connection)).values())

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
        with broker_errors(), self.connection.pipeline(transaction=False) as pipe:
            pipe.hgetall(Job.key_for(state.job_id))
            pipe.xrevrange(results_stream_key(state.job_id), "+", "-", count=1)
            raw, latest = pipe.execute()
        job = job_from_hash(state.job_id, raw) if raw else None
        return job_ended_without_result(state.job_id, state.rq_status, job, latest_result_detail(state.job_id, latest))

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

    def wait(self, job_id: str, timeout: float | None = None, *, no_worker_timeout: float | None = None
             ) -> GenerationResult:
        """Block until the job has a result (finished, failed or cancelled) and return it.

        Subscribes to the job's done channel, so it returns as soon as the worker publishes,
        without polling; re-reads the result key every ~2 s in case a message was missed.
        Raises WaitTimeout after `timeout` seconds (None: no limit), JobNotFound for an unknown job.
        With `no_worker_timeout`, raises NoLiveWorker once no live worker has listened on the job's
        queue for that many seconds (checked every ~2 s; the job still waits in its queue).
        """
        return self.wait_many([job_id], timeout, no_worker_timeout=no_worker_timeout)[job_id]

    def wait_many(self, job_ids: Iterable[str], timeout: float | None = None, *,
                  no_worker_timeout: float | None = None) -> dict[str, GenerationResult]:
        """Like `wait` for several jobs over one subscription; returns {job_id: result}.

        WaitTimeout carries the ids still pending in `.pending`.
        """
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return {}
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        results: dict[str, GenerationResult] = {}
        pending = set(ids)
        unserved = UnservedWatch(no_worker_timeout) if no_worker_timeout is not None else None

        def settle(candidates: Iterable[str]) -> None:
            wanted = [job_id for job_id in candidates if job_id in pending]
            polled_all = len(wanted) == len(pending)
            for state in self._read_states(wanted) if wanted else []:
                found = self._settled(state)
                if found is not None:
                    results[state.job_id] = found
                    pending.discard(state.job_id)
            if unserved is not None and pending and polled_all:  # a poll of all: check the queues too
                self._check_served(unserved, pending)

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

    def _check_served(self, unserved: UnservedWatch, pending: set[str]) -> None:
        with broker_errors():
            unknown = unserved.unknown(pending)
            if unknown:
                with self.connection.pipeline(transaction=False) as pipe:
                    for job_id in unknown:
                        pipe.hget(Job.key_for(job_id), "origin")
                    unserved.learn(unknown, pipe.execute())
            live = live_queues(read_live(self.connection))
        unserved.check(pending, live, time.monotonic())

    # -- cancelling

    def cancel(self, job_id: str) -> bool:
        """Ask for the job to stop; returns False if it had already ended.

        Sets `mlxq:cancel:<id>` (a running job's worker ends the sequence within one step
        and writes a cancelled result). A job still waiting in its queue (or scheduled for
        a retry) is removed from it right here, marked canceled in RQ, and gets a cancelled
        result. Raises JobNotFound for an unknown job.
        """
        with broker_errors():
            with self.connection.pipeline(transaction=False) as pipe:
                pipe.hgetall(Job.key_for(job_id))
                pipe.exists(keys.result_key(job_id))
                raw, has_result = pipe.execute()
            if not raw:
                if has_result:
                    return False
                raise JobNotFound(job_id)
            job = job_from_hash(job_id, raw)
            status = rq_status(job)
            if status in RQ_ENDED or has_result:
                return False
            self.connection.set(keys.cancel_key(job_id), "1", ex=CANCEL_TTL)
            # LREM / ZREM are atomic: only the caller that actually removed the job finishes it,
            # so a worker that popped it meanwhile (and sees the flag) never races this write.
            removal = cancel_removal(job, status)
            if removal is not None and self.connection.execute_command(*removal):
                key, value, expiry = cancelled_result_write(job, time.time())
                try:
                    if not self.connection.set(key, value, ex=expiry, nx=True):
                        return False  # a result came first (a result key is never replaced)
                except redis.exceptions.NoPermissionError:
                    pass  # read-only result keys (the producer ACL): a worker's sweep writes it
                batch = CommandBatch(self.connection)
                record_cancelled(batch, job)
                batch.execute()
        return True

    # -- the control plane (docs/rl.md): each call returns once every live worker of the model has
    # applied the command, or after `timeout` seconds with those that did not named in `missing`
    # (with no live worker, after waiting up to 10 s for one)

    def publish_weights(self, model: str, version: int, path: str, policy: WeightPolicy = "drain", *,
                        upload: bool = False, timeout: float = 300) -> ControlOutcome:
        """Make `version` (a directory of safetensors in MLX's parameter naming) the weights of
        every worker serving `model`. The workers read `path` themselves, or with `upload` the files
        are streamed through Redis in checksummed chunks (small models and adapters). `policy`:
        drain (running sequences finish on the old weights), abort (they go back to their queues),
        inflight (they go on under the new weights)."""
        return self._control.send(*weights_command(model, version, path, policy, upload), timeout)

    def publish_adapter(self, model: str, name: str, path: str, *, upload: bool = False,
                        timeout: float = 300) -> ControlOutcome:
        """Make the LoRA adapter in `path` (a directory as `mlx_lm.lora` writes it: adapter_config.json
        and adapters.safetensors) the adapter `name` on every worker serving `model`; requests name it
        in `adapter`. The workers read `path` themselves, or with `upload` the files are streamed
        through Redis in checksummed chunks. Publishing a name again replaces that adapter."""
        return self._control.send(*adapter_command(model, name, path, upload), timeout)

    def pause(self, model: str, mode: PauseMode = "keep", *, timeout: float = 60) -> ControlOutcome:
        """Stop the model's workers taking jobs and stepping: `keep` freezes running sequences until
        `resume`, `abort` sends them back to their queues first."""
        return self._control.send(pause_command(model, mode), {}, timeout)

    def resume(self, model: str, *, timeout: float = 60) -> ControlOutcome:
        return self._control.send(control_command("resume", model), {}, timeout)

    def abort(self, model: str | None = None, job_id: str | None = None, *, timeout: float = 60) -> ControlOutcome:
        """End one job (`job_id`, queued or running) or every running job of `model`, each
        `cancelled` with its partial output."""
        model, job_id = abort_target(model, job_id, self._model_of(job_id) if job_id and not model else None)
        if job_id is not None:
            self.cancel(job_id)
        return self._control.send(control_command("abort", model, job_id=job_id), {}, timeout)

    def latest_weights(self, model: str) -> ControlCommand | None:
        """The latest version published for `model` (where it came from, its policy), or None."""
        return self._control.latest_weights(model)

    def reset_prefix_cache(self, model: str, *, timeout: float = 60) -> ControlOutcome:
        return self._control.send(control_command("reset_prefix_cache", model), {}, timeout)

    def _model_of(self, job_id: str) -> str | None:
        with broker_errors():
            return job_model(self.connection.hget(Job.key_for(job_id), "data"))

    # -- lifecycle

    def stream(self, job_id: str, timeout: float | None = None, last_event_id: str | None = None) -> "JobStream":
        """Iterate a job's events as its worker writes them (one per choice per decode step):
        `{"event": "token", "index", "token_ids", "text"}`, then one `{"event": "end", "status",
        "finish_reasons"}`. The texts of a choice add up to its final `text`; its token_ids to its
        `token_ids`, counted from the last `{"event": "restart", "reason"}`, which says the job went back
        to its queue and what came before is void. It ends after the end event, whether the job finished, failed, was cancelled
        or was ended by RQ without a result; a job submitted without `stream` yields its whole
        result as one token event per choice. The iterator's `last_event_id` is the id of the
        last event it yielded: pass it as `last_event_id` to resume after a dropped connection.
        Raises WaitTimeout if no event arrives within `timeout` seconds (None: no limit),
        JobNotFound for an unknown job, StreamExpired if the stream vanished after part of it was read."""
        return JobStream(self, StreamCursor(job_id, last_event_id), timeout)

    def _read_stream(self, cursor: StreamCursor, block_s: float) -> list[tuple[str, dict[str, Any]]]:
        """The events after the cursor: those in the stream; if none, the job's end if it ended; else
        whatever arrives within `block_s` s (maybe nothing). A stream whose entries were read already is
        waited on first, the job's state read only when nothing came."""
        key = keys.stream_key(cursor.job_id)
        with broker_errors():
            if cursor.live:  # one round trip per event while the stream flows; its job's state after a silence
                batch = self._blocking_read(key, cursor.last_event_id, block_s)
                if batch:
                    return cursor.from_entries(batch[0][1])
            for _ in range(2):  # an end event can arrive between the first read and the state's
                batch = self.connection.xread({key: cursor.last_event_id}, count=STREAM_BATCH)
                if batch:
                    return cursor.from_entries(batch[0][1])
                settled = self._settled(self._read_states([cursor.job_id])[0])
                if settled is None:
                    break
            else:
                return cursor.from_result(settled, bool(self.connection.exists(key)))
            if cursor.live:
                return []  # it waited its slice already
            batch = self._blocking_read(key, cursor.last_event_id, block_s)
            return cursor.from_entries(batch[0][1]) if batch else []

    def _blocking_read(self, key: str, after: str, block_s: float) -> Any:
        try:
            return self.connection.xread({key: after}, block=max(1, int(block_s * 1000)), count=STREAM_BATCH)
        except redis.ResponseError as exc:
            if not str(exc).startswith("UNBLOCKED"):
                raise
            return []  # another client ended the wait early (CLIENT UNBLOCK ... ERROR): nothing came

    def _socket_timeout(self) -> float | None:
        return self.connection.connection_pool.connection_kwargs.get("socket_timeout")

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


class JobStream(Iterator[dict[str, Any]]):
    """The iterator `Client.stream` returns; `last_event_id` is where a new one would resume."""

    def __init__(self, client: Client, cursor: StreamCursor, timeout: float | None) -> None:
        self._client, self._cursor, self._timeout = client, cursor, timeout
        self._pending: list[tuple[str, dict[str, Any]]] = []

    @property
    def job_id(self) -> str:
        return self._cursor.job_id

    @property
    def last_event_id(self) -> str:
        return self._cursor.last_event_id

    def __iter__(self) -> "JobStream":
        return self

    def __next__(self) -> dict[str, Any]:
        deadline = None if self._timeout is None else time.monotonic() + max(self._timeout, 0.0)
        while not self._pending:
            if self._cursor.ended:
                raise StopIteration
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WaitTimeout(f"no stream event for job {self.job_id} within {self._timeout} s",
                                  pending=[self.job_id])
            self._pending = self._client._read_stream(self._cursor, block_slice(left, self._client._socket_timeout()))
        event_id, event = self._pending.pop(0)
        self._cursor.last_event_id = event_id
        return event


def _time_left(deadline: float | None, cap: float) -> float:
    """Seconds to block: at most `cap`, never past `deadline`."""
    if deadline is None:
        return cap
    return max(0.0, min(cap, deadline - time.monotonic()))
