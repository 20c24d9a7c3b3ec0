"""Write results where callers look for them: the result key, then a pub/sub nudge."""

from __future__ import annotations

from typing import Optional

import redis

from schemas import GenerationResult, keys


def result_ttl(job_result_ttl: Optional[int]) -> Optional[int]:
    """Seconds the result key lives: the job's result_ttl (RQ's default 500 s); None = forever."""
    ttl = keys.DEFAULT_RESULT_TTL if job_result_ttl is None else job_result_ttl
    if ttl < 0:
        return None
    return max(ttl, 1)  # result_ttl=0 still leaves the result readable for a moment


def publish_results(connection: redis.Redis, results: list[tuple[GenerationResult, Optional[int]]]) -> None:
    """One round trip for many results: SET each key with its TTL, then PUBLISH its id."""
    if not results:
        return
    with connection.pipeline(transaction=False) as pipe:
        for result, ttl in results:
            pipe.set(keys.result_key(result.id), result.model_dump_json(), ex=ttl)
            pipe.publish(keys.done_channel(result.id), result.id)
        pipe.execute()


def cancel_requested(connection: redis.Redis, job_ids: list[str]) -> set[str]:
    """Which of these jobs a producer asked to cancel (one round trip)."""
    if not job_ids:
        return set()
    flags = connection.mget([keys.cancel_key(job_id) for job_id in job_ids])
    return {job_id for job_id, flag in zip(job_ids, flags) if flag is not None}
