"""AsyncClient: the asyncio twin of `Client`, on redis.asyncio, method for method.

Everything that does no I/O (validation, the commands rq would send, parsing, stream reading)
is producer/wire.py's, shared with the sync client; this module only talks to Redis. Two things
differ in how, not in what: a batch of commands runs through the same server-side script from an
asyncio connection (`execute_batch`), every wait and stream of one client shares one pattern
subscription to the done channels (producer/done_listener.py), and its streams share one blocking
read (producer/stream_hub.py), so a thousand concurrent waits or streams hold two connections, not
a thousand. An AsyncClient belongs to the event loop that first uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Optional

import redis
import redis.asyncio as aioredis
from rq import Retry
from rq.job import Job

from producer.aio_stream import AsyncJobStream
from producer.client import CANCEL_TTL, SAFETY_POLL_S
from producer.control import (AsyncControlCalls, abort_target, adapter_command, control_command, job_model,
                              pause_command, weights_command)
from producer.done_listener import DoneListener, DoneWake
from producer.errors import BrokerError, JobNotFound, WaitTimeout, broker_errors
from producer.presence import LiveModel, UnservedWatch, aread_live, live_models, live_queues
from producer.stream_hub import StreamHub
from producer.wire import (
    NO_CONNECTION,
    RQ_ENDED,
    JobState,
    PlannedJob,
    RequestLike,
    StreamCursor,
    cancel_removal,
    cancelled_result_write,
    check_live,
    check_priority,
    job_ended_without_result,
    job_from_hash,
    job_options,
    job_state,
    latest_result_detail,
    parse_result,
    not_durable,
    parse_server_version,
    plan_jobs,
    public_status,
    record_cancelled,
    record_enqueue,
    redact_url,
    resolve_url,
    results_stream_key,
    rq_status,
)
from schemas import GenerationResult, RequestLimits, broker, keys
from schemas.control import ControlCommand, ControlOutcome, PauseMode, WeightPolicy
from schemas.redis_busy import async_parser
from schemas.command_batch import RUN_SCRIPT, RUN_SCRIPT_SHA, CommandBatch, commands_of
from schemas.durability import Durability, NotReplicated

__all__ = ["AsyncClient", "AsyncJobStream", "DoneListener", "JobWatch", "MAX_CONNECTIONS", "ReadStates", "execute_batch",
           "parsed_state"]

# Reads the states of some jobs in one snapshot (AsyncClient._read_states, or a caller's own that does more).
ReadStates = Callable[[Sequence[str]], Awaitable[list[JobState]]]

# A result this large is parsed on a thread, so that the event loop keeps serving meanwhile (parsing a result
# of the largest size a request may make takes a fair part of a second; a raised cap, seconds).
PARSE_ON_THREAD_BYTES = 1 << 20


async def parsed_state(job_id: str, raw_result: bytes | None, raw_status: bytes | None,
                       parse: Callable[[str, bytes], GenerationResult] = parse_result) -> JobState:
    """`job_state`, on a thread for a large result."""
    if raw_result is not None and len(raw_result) > PARSE_ON_THREAD_BYTES:
        return await asyncio.to_thread(job_state, job_id, raw_result, raw_status, parse)
    return job_state(job_id, raw_result, raw_status, parse)


# Connections an AsyncClient that opened its own may hold at once (a `max_connections` in the URL wins);
# past them, a command waits for one to be free.
MAX_CONNECTIONS = 1024


async def execute_batch(
    connection: aioredis.Redis, batch: CommandBatch, unless_exists: Sequence[str] = ()
) -> Optional[list[Any]]:
    """`CommandBatch.execute` from an asyncio connection: the recorded commands in one atomic
    round trip; None (nothing ran) if a key of `unless_exists` exists; raises the first command error."""
    if not len(batch) and not unless_exists:
        return []
    argv, packed = batch.take()
    args = ("EVALSHA", RUN_SCRIPT_SHA, len(unless_exists), *unless_exists, packed)
    try:
        replies = await connection.execute_command(*args)
    except redis.exceptions.NoScriptError:  # a restarted or flushed server: the call carries the script
        replies = await connection.execute_command("EVAL", RUN_SCRIPT, *args[2:])
    except redis.exceptions.ResponseError as exc:
        if unless_exists or not str(exc).lower().startswith("unknown command"):
            raise
        async with connection.pipeline() as pipe:  # a server without Lua (fakeredis without lupa)
            for command in commands_of(argv):
                pipe.execute_command(*command)
            replies = await pipe.execute(raise_on_error=False)
    if replies is None:
        return None
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return list(replies)


class AsyncClient:
    """An asyncio mlxq producer: `Client`'s methods as coroutines, with the same arguments.

    `url` defaults to $MLXQ_REDIS_URL, else redis://127.0.0.1:6379/0; the client's pool holds up to
    MAX_CONNECTIONS connections and a command past them waits for one rather than failing. Pass `connection` to share
    an existing redis.asyncio.Redis instead (not decode_responses=True); the client closes only
    a connection it opened. Use `async with AsyncClient(...) as client:` or `await client.close()`.
    Sentinel URLs and `durability` as for `Client`.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        connection: aioredis.Redis | None = None,
        limits: RequestLimits | None = None,
        priorities: Sequence[str] = keys.DEFAULT_PRIORITIES,
        durability: Durability | None = None,
    ) -> None:
        if connection is not None and url is not None:
            raise ValueError("pass url or connection, not both")
        if connection is None:
            self.url = resolve_url(url)
            try:
                # A pool that waits for a free connection rather than failing: redis-py's default pool
                # raises past 100 connections, and every blocking stream read holds one.
                connection = broker.connect_async(self.url, max_connections=MAX_CONNECTIONS, parser_class=async_parser())
            except ValueError as exc:
                raise BrokerError(f"invalid Redis URL {redact_url(self.url)}: {exc}") from exc
            self._owns_connection = True
        else:
            self.url = ""
            self._owns_connection = False
        if connection.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("the Redis connection must not use decode_responses=True (RQ stores bytes)")
        self.connection: aioredis.Redis = connection
        self.limits = limits
        self.priorities = tuple(priorities)
        self.durability = durability or Durability()
        self._control = AsyncControlCalls(connection)
        self._server_version: Optional[tuple[int, int, int]] = None
        self._listener = DoneListener(connection)
        self._streams = StreamHub(connection)

    def __repr__(self) -> str:
        return f"AsyncClient({redact_url(self.url) if self.url else self.connection!r})"

    # -- submitting

    async def submit(
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
        """`Client.submit`: validate `request`, enqueue it, return the job id."""
        check_priority(priority, self.priorities)
        options = job_options(timeout, ttl, result_ttl, retry)
        planned = plan_jobs([request], self.limits, options, queue=queue, priority=priority, job_ids=[job_id],
                            indexed=False)
        await self._enqueue(planned, durable, require_live_worker)
        return planned[0].job_id

    async def _plan_submit(
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
        validated: bool = False,
    ) -> tuple[str, CommandBatch]:
        """`submit` without running it: the job id and its enqueue recorded in a CommandBatch, for a
        caller that runs those commands inside its own script (the gateway runs them with its admission;
        private, since `Client`, its twin, has no such method).
        `validated`: `request` is a GenerationRequest already validated against this client's limits."""
        check_priority(priority, self.priorities)
        options = job_options(timeout, ttl, result_ttl, retry)
        planned = plan_jobs([request], self.limits, options, queue=queue, priority=priority, job_ids=[job_id],
                            indexed=False, validated=validated)
        batch = CommandBatch(NO_CONNECTION)  # records only
        record_enqueue(batch, planned, await self._redis_version())
        return planned[0].job_id, batch

    async def submit_many(
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
        """`Client.submit_many`: all or nothing, in one round trip; the job ids in order."""
        check_priority(priority, self.priorities)
        options = job_options(timeout, ttl, result_ttl, retry)
        planned = plan_jobs(list(requests), self.limits, options, queue=queue, priority=priority, job_ids=job_ids)
        await self._enqueue(planned, durable, require_live_worker)
        return [job.job_id for job in planned]

    async def models(self) -> list[LiveModel]:
        """`Client.models`: the models live workers serve now."""
        with broker_errors():
            return list(live_models(await aread_live(self.connection)).values())

    async def _redis_version(self) -> tuple[int, int, int]:
        """The Redis server's version, read once (rq records it in every job)."""
        if self._server_version is None:
            with broker_errors():
                self._server_version = parse_server_version(await self.connection.info("server"))
        return self._server_version

    async def _enqueue(self, planned: Sequence[PlannedJob], durable: bool = False,
                       require_live_worker: bool = False) -> None:
        if not planned:
            return
        if require_live_worker:
            with broker_errors():
                workers = await aread_live(self.connection)
            check_live(planned, live_queues(workers), live_models(workers))
        batch = CommandBatch(NO_CONNECTION)  # records only; run below
        record_enqueue(batch, planned, await self._redis_version())
        with broker_errors():
            if not durable:
                await execute_batch(self.connection, batch)
                return
            async with self.connection.client() as single:  # WAIT counts one connection's own writes
                await execute_batch(single, batch)
                try:
                    self.durability.check(await single.wait(self.durability.replicas, self.durability.timeout_ms))
                except NotReplicated as exc:
                    raise not_durable(exc, planned) from exc

    # -- reading

    async def _read_states(self, job_ids: Sequence[str],
                           parse: Callable[[str, bytes], GenerationResult] = parse_result) -> list[JobState]:
        with broker_errors():
            async with self.connection.pipeline() as pipe:
                for job_id in job_ids:
                    pipe.get(keys.result_key(job_id))
                    pipe.hget(Job.key_for(job_id), "status")
                raw = await pipe.execute()
        return [await parsed_state(job_id, raw[2 * i], raw[2 * i + 1], parse) for i, job_id in enumerate(job_ids)]

    async def _settled(self, state: JobState) -> GenerationResult | None:
        if state.result is not None:
            return state.result
        if state.ended_without_result:
            return await self._orphan(state)
        return None

    async def _orphan(self, state: JobState) -> GenerationResult:
        assert state.rq_status is not None
        with broker_errors():
            async with self.connection.pipeline(transaction=False) as pipe:
                pipe.hgetall(Job.key_for(state.job_id))
                pipe.xrevrange(results_stream_key(state.job_id), "+", "-", count=1)
                raw, latest = await pipe.execute()
        job = job_from_hash(state.job_id, raw) if raw else None
        return job_ended_without_result(state.job_id, state.rq_status, job, latest_result_detail(state.job_id, latest))

    async def status(self, job_id: str) -> str:
        """`Client.status`."""
        return public_status((await self._read_states([job_id]))[0])

    async def result(self, job_id: str) -> GenerationResult | None:
        """`Client.result`: the result, or None while there is none yet."""
        return await self._settled((await self._read_states([job_id]))[0])

    async def wait(self, job_id: str, timeout: float | None = None, *, no_worker_timeout: float | None = None
                   ) -> GenerationResult:
        """`Client.wait`: until the job has a result; WaitTimeout after `timeout` s, NoLiveWorker after
        `no_worker_timeout` s without a live worker on its queue."""
        return (await self.wait_many([job_id], timeout, no_worker_timeout=no_worker_timeout))[job_id]

    async def wait_many(self, job_ids: Iterable[str], timeout: float | None = None, *,
                        no_worker_timeout: float | None = None) -> dict[str, GenerationResult]:
        """`Client.wait_many`: {job_id: result}; WaitTimeout carries the ids still pending."""
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return {}
        if not self._listener.started:  # fast path: already done, no subscription needed
            results = await self._settle_all(await self._read_states(ids))
            if len(results) == len(ids):
                return {job_id: results[job_id] for job_id in ids}
        # Registered before the read in `JobWatch.wait`, so a job that ends between them wakes this
        # wait; once the subscription exists that one read is also the fast path.
        async with self._watch(ids) as watch:
            return await watch.wait(timeout, no_worker_timeout=no_worker_timeout)

    @contextlib.asynccontextmanager
    async def _watch(self, job_ids: Iterable[str]) -> AsyncIterator["JobWatch"]:
        """Register for the end of `job_ids` on the client's done subscription, for as long as the
        block runs; `JobWatch.wait` inside it waits for them. Entered before the jobs are submitted,
        every end is announced to it, so its wait needs no read before the first announcement (the
        gateway's blocking requests; private, since `Client`, its twin, has no such method)."""
        with broker_errors():
            await self._listener.start()
        watch = JobWatch(self, list(dict.fromkeys(job_ids)))
        self._listener.add(watch.job_ids, watch.wake)
        try:
            yield watch
        finally:
            self._listener.remove(watch.job_ids, watch.wake)

    async def _check_served(self, unserved: UnservedWatch, pending: set[str]) -> None:
        with broker_errors():
            unknown = unserved.unknown(pending)
            if unknown:
                async with self.connection.pipeline(transaction=False) as pipe:
                    for job_id in unknown:
                        pipe.hget(Job.key_for(job_id), "origin")
                    unserved.learn(unknown, await pipe.execute())
            live = live_queues(await aread_live(self.connection))
        unserved.check(pending, live, time.monotonic())

    async def _settle_all(self, states: Iterable[JobState]) -> dict[str, GenerationResult]:
        """{job_id: result} of the states that have ended."""
        results: dict[str, GenerationResult] = {}
        for state in states:
            found = await self._settled(state)
            if found is not None:
                results[state.job_id] = found
        return results

    # -- cancelling

    async def cancel(self, job_id: str) -> bool:
        """`Client.cancel`: False if the job had already ended."""
        with broker_errors():
            async with self.connection.pipeline(transaction=False) as pipe:
                pipe.hgetall(Job.key_for(job_id))
                pipe.exists(keys.result_key(job_id))
                raw, has_result = await pipe.execute()
            if not raw:
                if has_result:
                    return False
                raise JobNotFound(job_id)
            job = job_from_hash(job_id, raw)
            status = rq_status(job)
            if status in RQ_ENDED or has_result:
                return False
            await self.connection.set(keys.cancel_key(job_id), "1", ex=CANCEL_TTL)
            removal = cancel_removal(job, status)
            if removal is not None and await self.connection.execute_command(*removal):
                key, value, expiry = cancelled_result_write(job, time.time())
                try:
                    if not await self.connection.set(key, value, ex=expiry, nx=True):
                        return False  # a result came first (a result key is never replaced)
                except redis.exceptions.NoPermissionError:
                    pass  # read-only result keys (the producer ACL): a worker's sweep writes it
                batch = CommandBatch(NO_CONNECTION)
                record_cancelled(batch, job)
                await execute_batch(self.connection, batch)
        return True

    # -- the control plane (docs/rl.md): each call returns once every live worker of the model has
    # applied the command, or after `timeout` seconds with those that did not named in `missing`
    # (with no live worker, after waiting up to 10 s for one)

    async def publish_weights(self, model: str, version: int, path: str, policy: WeightPolicy = "drain", *,
                        upload: bool = False, timeout: float = 300) -> ControlOutcome:
        """Make `version` (a directory of safetensors in MLX's parameter naming) the weights of
        every worker serving `model`. The workers read `path` themselves, or with `upload` the files
        are streamed through Redis in checksummed chunks (small models and adapters). `policy`:
        drain (running sequences finish on the old weights), abort (they go back to their queues),
        inflight (they go on under the new weights)."""
        return await self._control.send(*weights_command(model, version, path, policy, upload), timeout)

    async def publish_adapter(self, model: str, name: str, path: str, *, upload: bool = False,
                        timeout: float = 300) -> ControlOutcome:
        """Make the LoRA adapter in `path` (a directory as `mlx_lm.lora` writes it: adapter_config.json
        and adapters.safetensors) the adapter `name` on every worker serving `model`; requests name it
        in `adapter`. The workers read `path` themselves, or with `upload` the files are streamed
        through Redis in checksummed chunks. Publishing a name again replaces that adapter."""
        return await self._control.send(*adapter_command(model, name, path, upload), timeout)

    async def pause(self, model: str, mode: PauseMode = "keep", *, timeout: float = 60) -> ControlOutcome:
        """Stop the model's workers taking jobs and stepping: `keep` freezes running sequences until
        `resume`, `abort` sends them back to their queues first."""
        return await self._control.send(pause_command(model, mode), {}, timeout)

    async def resume(self, model: str, *, timeout: float = 60) -> ControlOutcome:
        return await self._control.send(control_command("resume", model), {}, timeout)

    async def abort(self, model: str | None = None, job_id: str | None = None, *, timeout: float = 60) -> ControlOutcome:
        """End one job (`job_id`, queued or running) or every running job of `model`, each
        `cancelled` with its partial output."""
        model, job_id = abort_target(model, job_id, await self._model_of(job_id) if job_id and not model else None)
        if job_id is not None:
            await self.cancel(job_id)
        return await self._control.send(control_command("abort", model, job_id=job_id), {}, timeout)

    async def latest_weights(self, model: str) -> ControlCommand | None:
        """The latest version published for `model` (where it came from, its policy), or None."""
        return await self._control.latest_weights(model)

    async def reset_prefix_cache(self, model: str, *, timeout: float = 60) -> ControlOutcome:
        return await self._control.send(control_command("reset_prefix_cache", model), {}, timeout)

    async def _model_of(self, job_id: str) -> str | None:
        with broker_errors():
            return job_model(await self.connection.hget(Job.key_for(job_id), "data"))

    # -- streams and lifecycle

    def stream(self, job_id: str, timeout: float | None = None, last_event_id: str | None = None) -> "AsyncJobStream":
        """`Client.stream` as an async iterator (`async for event in client.stream(id)`)."""
        return AsyncJobStream(self, StreamCursor(job_id, last_event_id), timeout)

    def _socket_timeout(self) -> float | None:
        return self.connection.connection_pool.connection_kwargs.get("socket_timeout")

    async def close(self) -> None:
        """Stop the stream reader and the done listener; close the connection if this client opened it."""
        await self._streams.close_all()
        await self._listener.close()
        if self._owns_connection:
            await self.connection.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class JobWatch:
    """Jobs registered on an AsyncClient's done subscription (`AsyncClient._watch`), and their wait."""

    def __init__(self, client: AsyncClient, job_ids: list[str]) -> None:
        self._client = client
        self.job_ids = job_ids
        self.wake = DoneWake()

    async def wait(self, timeout: float | None = None, *, read: ReadStates | None = None,
                   submitted_after: bool = False, no_worker_timeout: float | None = None
                   ) -> dict[str, GenerationResult]:
        """`wait_many` for the watched jobs: {job_id: result}; WaitTimeout carries the ids still pending.
        `read` replaces the client's read of job states; `submitted_after` (every job was submitted
        after the watch began) skips the read of what ended before it."""
        client, ids, wake = self._client, self.job_ids, self.wake
        read_states = read or client._read_states
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        results: dict[str, GenerationResult] = {}
        pending = set(ids)
        unserved = UnservedWatch(no_worker_timeout) if no_worker_timeout is not None else None

        async def settle(candidates: Iterable[str]) -> None:
            wanted = [job_id for job_id in candidates if job_id in pending]
            polled_all = len(wanted) == len(pending)
            if wanted:
                found = await client._settle_all(await read_states(wanted))
                results.update(found)
                pending.difference_update(found)
            if unserved is not None and pending and polled_all:  # a poll of all: check the queues too
                await client._check_served(unserved, pending)

        if not submitted_after:
            await settle(ids)  # what ended before the registration
        next_poll = time.monotonic() + SAFETY_POLL_S
        while pending:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                late = [job_id for job_id in ids if job_id in pending]
                shown = ", ".join(late[:5]) + (", ..." if len(late) > 5 else "")
                raise WaitTimeout(f"no result after {timeout} s for {len(late)} job(s): {shown}", late)
            wait_s = max(next_poll - now, 0.0) if deadline is None else max(min(next_poll, deadline) - now, 0.0)
            try:
                await asyncio.wait_for(wake.event.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
            wake.event.clear()
            woken, wake.woken = wake.woken, set()
            lost, wake.lost = wake.lost, False
            if lost or time.monotonic() >= next_poll:
                await settle(list(pending))
                next_poll = time.monotonic() + SAFETY_POLL_S
            elif woken:
                await settle(woken)
        return {job_id: results[job_id] for job_id in ids}
