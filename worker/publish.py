"""Write results where callers look for them: the result key, the end of the token stream,
then a pub/sub nudge on `mlxq:done:<id>`. Every call is one round trip (a CommandBatch)."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Optional

import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.utils import now, utcformat

from schemas import GenerationResult, keys
from schemas.result import no_output_result
from schemas.command_batch import CommandBatch, failed_writes
from schemas.durability import Durability
from schemas.events import EndStreamEvent, RestartStreamEvent, TokenStreamEvent, encode_event
from worker.intake import Unreadable

log = logging.getLogger("mlxq.worker")


class Publication(NamedTuple):
    result: GenerationResult
    ttl: Optional[int]  # seconds the key lives; None = forever
    write_key: bool = True  # False for a failed attempt that RQ will retry: the job has not ended
    ends_stream: bool = False
    encoded: Optional[str] = None  # the result's JSON, when the caller has it already


STATS_TTL_S = 3600  # a worker's stats hash outlives it by this much at most


class WorkerStats(NamedTuple):
    key: str  # keys.stats_key(worker name)
    counters: dict[str, Any]


def publish_results(connection: redis.Redis, publications: list[Publication],
                    stats: Optional[WorkerStats] = None, durability: Optional[Durability] = None) -> set[str]:
    """Result keys (and stream ends, and done nudges) in one round trip; the worker's counters
    are refreshed in the same one. The first result written for a job stays (SET NX): a late writer (a
    worker that was cut off while another took its job, a sweep) never replaces it. With `durability`,
    the nudges go out only once that many replicas have the results (NotReplicated, a connection error
    that the bookkeeping thread retries, if they do not confirm in time). A key someone changed to
    another type (a stream turned into a string) costs only its own job's write, logged. Returns the
    jobs whose result key held something else already: another run of the job wrote first (a key
    holding these very bytes is this write's own, tried again after its replicas did not confirm it)."""
    if not publications:
        return set()
    batch = CommandBatch(connection)
    nudges = CommandBatch(connection) if durability is not None else batch
    owners: list[str] = []  # the job (or the stats key) each of the batch's commands writes for
    if stats is not None and stats.counters:
        batch.hset(stats.key, mapping={name: str(value) for name, value in stats.counters.items()})
        batch.expire(stats.key, STATS_TTL_S)
        owners += [stats.key, stats.key]
    sets: list[tuple[str, str, int]] = []
    for item in publications:
        if not item.write_key:
            continue
        job_id = item.result.id
        encoded = item.encoded if item.encoded is not None else item.result.model_dump_json()
        # GET first: a write tried again (its replicas did not confirm) finds its own bytes, not another
        # run's. (The batch is atomic; `SET ... NX GET` would say the same, but only from Redis 7.0 on.)
        batch.execute_command("GET", keys.result_key(job_id))
        sets.append((job_id, encoded, len(batch) - 1))
        expiry = ("EX", item.ttl) if item.ttl else ()
        batch.execute_command("SET", keys.result_key(job_id), encoded, *expiry, "NX")
        if item.ends_stream:
            end = EndStreamEvent(status=item.result.status,
                                 finish_reasons=[c.finish_reason for c in item.result.choices])
            batch.xadd(keys.stream_key(job_id), encode_event(end))
            if item.ttl:
                batch.expire(keys.stream_key(job_id), item.ttl)
        nudges.publish(keys.done_channel(job_id), job_id)
        owners += [job_id] * (len(batch) - len(owners))
    replies = batch.execute(durability=durability, raise_errors=False) or []
    if nudges is not batch:
        nudges.execute()
    for owner, error in failed_writes(replies, owners).items():
        log.warning("%s: %s: not written (a key changed by someone else); the other jobs' writes were", owner, error)
    return {job_id for job_id, encoded, at in sets
            if at < len(replies) and replies[at] is not None and replies[at] != encoded.encode()}


def publish_stream_deltas(connection: redis.Redis, deltas: list[Any], ttls: dict[str, Optional[int]]) -> dict[str, str]:
    """One XADD per choice that produced something this step, all in one round trip. Returns the
    jobs whose stream could not be written (its key changed to another type by someone else), with
    the error; every other job's deltas were written all the same."""
    if not deltas:
        return {}
    batch = CommandBatch(connection)
    owners: list[str] = []
    for delta in deltas:
        event = TokenStreamEvent(index=delta.index, token_ids=delta.token_ids, text=delta.text,
                                 logprobs=delta.logprobs, top_logprobs=delta.top_logprobs,
                                 reasoning_content=delta.reasoning or None, tool_calls=delta.tool_calls or None)
        batch.xadd(keys.stream_key(delta.job_id), encode_event(event))
        owners.append(delta.job_id)
    for job_id in {d.job_id for d in deltas}:
        if ttls.get(job_id):
            batch.expire(keys.stream_key(job_id), ttls[job_id])
            owners.append(job_id)
    return failed_writes(batch.execute(raise_errors=False), owners)



def restart_stream(connection: redis.Redis, job_id: str, reason: str) -> None:
    """A streaming job goes back to its queue: what its stream holds so far is void."""
    connection.xadd(keys.stream_key(job_id), encode_event(RestartStreamEvent(reason=reason)))


def refuse_unreadable(connection: redis.Redis, refused: list[tuple[Unreadable, Queue]],
                      model: Optional[str] = None, worker: Optional[str] = None) -> None:
    """Queue entries that cannot run leave their queue's intermediate list (where rq's own
    maintenance would trip on them); each identifiable one ends failed, with a result key that names
    the broken field, and its hash, if any, is marked failed and kept only as long as that key."""
    batch = CommandBatch(connection)
    publications = []
    ttl = keys.result_key_ttl(None)
    for bad, queue in refused:
        batch.lrem(queue.intermediate_queue.key, 1, bad.raw_id)
        if bad.job_id is None:
            log.warning("removed an unreadable entry %r from %s: %s", bad.raw_id[:64], queue.key, bad.message)
            continue
        log.warning("job %s cannot run: %s", bad.job_id, bad.message)
        if bad.ended == "canceled":  # cancelled while queued, its result key not written yet
            result = no_output_result(bad.job_id, "cancelled", request=bad.payload, model=model, worker=worker)
        else:
            result = no_output_result(bad.job_id, "failed", error_type="InvalidJob", message=bad.message,
                                      request=bad.payload, model=model, worker=worker)
        publications.append(Publication(result, ttl))
        if bad.is_hash:
            job_key = Job.key_for(bad.job_id)
            batch.hset(job_key, mapping={"status": JobStatus.FAILED.value, "ended_at": utcformat(now())})
            batch.expire(job_key, ttl or keys.DEFAULT_RESULT_TTL)
    batch.execute()
    publish_results(connection, publications)
