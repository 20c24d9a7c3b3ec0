"""Write results where callers look for them: the result key, the end of the token stream,
then a pub/sub nudge on `mlxq:done:<id>`. Every call is one pipelined round trip."""

from __future__ import annotations

import json
from typing import Any, NamedTuple, Optional

import redis

from schemas import GenerationResult, keys


class Publication(NamedTuple):
    result: GenerationResult
    ttl: Optional[int]  # seconds the key lives; None = forever
    write_key: bool = True  # False for a failed attempt that RQ will retry: the job has not ended
    ends_stream: bool = False


def result_ttl(job_result_ttl: Optional[int]) -> Optional[int]:
    """Seconds the result key lives: the job's result_ttl (RQ's default 500 s); None = forever."""
    ttl = keys.DEFAULT_RESULT_TTL if job_result_ttl is None else job_result_ttl
    if ttl < 0:
        return None
    return max(ttl, 1)  # result_ttl=0 still leaves the result readable for a moment


def publish_results(connection: redis.Redis, publications: list[Publication]) -> None:
    if not publications:
        return
    with connection.pipeline(transaction=False) as pipe:
        for item in publications:
            if not item.write_key:
                continue
            job_id = item.result.id
            pipe.set(keys.result_key(job_id), item.result.model_dump_json(), ex=item.ttl)
            if item.ends_stream:
                end = {"event": "end", "status": item.result.status,
                       "finish_reasons": [c.finish_reason for c in item.result.choices]}
                pipe.xadd(keys.stream_key(job_id), {"data": json.dumps(end)})
                if item.ttl:
                    pipe.expire(keys.stream_key(job_id), item.ttl)
            pipe.publish(keys.done_channel(job_id), job_id)
        pipe.execute()


def publish_stream_deltas(connection: redis.Redis, deltas: list[Any], ttls: dict[str, Optional[int]]) -> None:
    """One XADD per choice that produced something this step, all in one round trip."""
    if not deltas:
        return
    with connection.pipeline(transaction=False) as pipe:
        for delta in deltas:
            event = {"event": "token", "index": delta.index, "token_ids": delta.token_ids, "text": delta.text}
            pipe.xadd(keys.stream_key(delta.job_id), {"data": json.dumps(event)})
        for job_id in {d.job_id for d in deltas}:
            if ttls.get(job_id):
                pipe.expire(keys.stream_key(job_id), ttls[job_id])
        pipe.execute()


def cancel_requested(connection: redis.Redis, job_ids: list[str]) -> set[str]:
    """Which of these jobs a producer asked to cancel (one round trip)."""
    if not job_ids:
        return set()
    flags = connection.mget([keys.cancel_key(job_id) for job_id in job_ids])
    return {job_id for job_id, flag in zip(job_ids, flags) if flag is not None}
