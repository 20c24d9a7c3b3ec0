"""Write results where callers look for them: the result key, the end of the token stream,
then a pub/sub nudge on `mlxq:done:<id>`. Every call is one round trip (a CommandBatch)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import redis

from schemas import GenerationResult, keys
from schemas.command_batch import CommandBatch
from schemas.events import EndStreamEvent, TokenStreamEvent, encode_event


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
                    stats: Optional[WorkerStats] = None) -> None:
    """Result keys (and stream ends, and done nudges) in one round trip; the worker's counters
    are refreshed in the same one."""
    if not publications:
        return
    batch = CommandBatch(connection)
    if stats is not None and stats.counters:
        batch.hset(stats.key, mapping={name: str(value) for name, value in stats.counters.items()})
        batch.expire(stats.key, STATS_TTL_S)
    for item in publications:
        if not item.write_key:
            continue
        job_id = item.result.id
        encoded = item.encoded if item.encoded is not None else item.result.model_dump_json()
        batch.set(keys.result_key(job_id), encoded, ex=item.ttl)
        if item.ends_stream:
            end = EndStreamEvent(status=item.result.status,
                                 finish_reasons=[c.finish_reason for c in item.result.choices])
            batch.xadd(keys.stream_key(job_id), encode_event(end))
            if item.ttl:
                batch.expire(keys.stream_key(job_id), item.ttl)
        batch.publish(keys.done_channel(job_id), job_id)
    batch.execute()


def publish_stream_deltas(connection: redis.Redis, deltas: list[Any], ttls: dict[str, Optional[int]]) -> None:
    """One XADD per choice that produced something this step, all in one round trip."""
    if not deltas:
        return
    batch = CommandBatch(connection)
    for delta in deltas:
        event = TokenStreamEvent(index=delta.index, token_ids=delta.token_ids, text=delta.text)
        batch.xadd(keys.stream_key(delta.job_id), encode_event(event))
    for job_id in {d.job_id for d in deltas}:
        if ttls.get(job_id):
            batch.expire(keys.stream_key(job_id), ttls[job_id])
    batch.execute()

