"""The fleet's last minutes, for the gateway's `/dashboard` charts, kept in Redis so that every gateway
replica draws the same history and a restarted one loses none (the gateway holds no state).

Each gateway samples the fleet every `interval_s` (producer/fleet_stats.py, and the TTFT of jobs that
ended since the previous sample, read from their result keys) and appends the sample to the stream
`mlxq:history` with the interval's start as its entry id. Redis refuses an id that is not above the
stream's last, so with several replicas exactly one sample per interval lands; entries older than
`window_s` are trimmed as new ones are added.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError
from rq.registry import FinishedJobRegistry

from producer.fleet_stats import FleetSnapshot, aread_snapshot
from schemas import keys

__all__ = ["HistorySampler", "Sample", "read_history", "recent_ttfts"]

log = logging.getLogger("mlxq.api")

TTFT_JOBS_PER_QUEUE = 50  # results read per queue and sample: a sample of a busy queue's jobs, not all
TIMINGS_TAIL_BYTES = 8192  # of each: a result's timings and the short fields after them


@dataclass(frozen=True)
class Sample:
    t: float  # Unix seconds the fleet was read
    tokens_per_s: dict[str, float]  # worker -> completion tokens/s over its last minute
    models: dict[str, str]  # worker -> model
    queued: int  # jobs waiting, all queues
    in_flight: int
    ttft_p50_s: Optional[float]  # over the jobs that ended since the previous sample
    ttft_p90_s: Optional[float]
    ttft_jobs: int

    @classmethod
    def of(cls, snapshot: FleetSnapshot, ttfts: list[float]) -> "Sample":
        ordered = sorted(ttfts)
        return cls(t=snapshot.taken_at, tokens_per_s={w.name: round(w.tokens_per_s_1m, 3) for w in snapshot.workers},
                   models={w.name: w.model for w in snapshot.workers},
                   queued=snapshot.jobs_waiting, in_flight=snapshot.in_flight,
                   ttft_p50_s=statistics.median(ordered) if ordered else None,
                   ttft_p90_s=ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else None,
                   ttft_jobs=len(ordered))


async def recent_ttfts(connection: aioredis.Redis, queues: list[str], since: float) -> list[float]:
    """TTFT of the jobs that finished after `since` (Unix seconds): the newest entries of each queue's
    finished registry (scored by expiry, so newest last for one result TTL), their result keys read."""
    pipe = connection.pipeline(transaction=False)
    for queue in queues:
        # "(+inf": jobs kept forever (result_ttl=-1) score +inf and would always come first
        pipe.zrevrangebyscore(FinishedJobRegistry.key_template.format(queue), "(+inf", "-inf",
                              start=0, num=TTFT_JOBS_PER_QUEUE)
    job_ids = [job_id.decode() for ids in await pipe.execute() for job_id in ids]
    if not job_ids:
        return []
    # Each result's last TIMINGS_TAIL_BYTES: its timings come after its choices, which can be megabytes.
    pipe = connection.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.getrange(keys.result_key(job_id), -TIMINGS_TAIL_BYTES, -1)
    ttfts = []
    for tail in await pipe.execute():
        timings = _timings(tail)
        if timings and timings.get("ttft_s") is not None and (timings.get("finished_at") or 0) > since:
            ttfts.append(float(timings["ttft_s"]))
    return ttfts


def _timings(tail: bytes) -> Optional[dict[str, Any]]:
    """The `timings` object in the end of a result's JSON, if it is there. (`"timings":{` cannot occur
    inside a JSON string, whose quotes are escaped.)"""
    at = tail.rfind(b'"timings":{')
    if at < 0:
        return None
    try:
        timings, _ = json.JSONDecoder().raw_decode(tail[at + len(b'"timings":'):].decode(errors="replace"))
    except ValueError:
        return None
    return timings if isinstance(timings, dict) else None


async def read_history(connection: aioredis.Redis, window_s: float, now: Optional[float] = None) -> list[Sample]:
    start_ms = int(((now or time.time()) - window_s) * 1000)
    samples = []
    for _, fields in await connection.xrange(keys.HISTORY_KEY, min=start_ms, max="+"):
        try:
            samples.append(Sample(**json.loads(fields[b"data"])))
        except (KeyError, TypeError, ValueError):
            continue  # written by a newer gateway
    return samples


class HistorySampler:
    """One gateway's sampling task (`run`), a sample an interval unless a replica took it already."""

    def __init__(self, connection: aioredis.Redis, interval_s: float, window_s: float) -> None:
        self._connection = connection
        self.interval_s = interval_s
        self.window_s = window_s

    async def run(self) -> None:
        while True:
            try:
                await self.sample_once()
            except (RedisError, OSError) as exc:
                log.warning("dashboard history: %s", exc)
            await asyncio.sleep(self.interval_s - time.time() % self.interval_s)

    async def sample_once(self) -> bool:
        """Take this interval's sample; False when a replica has taken it already."""
        now = time.time()
        bucket_ms = int(now // self.interval_s * self.interval_s * 1000)
        last = await self._connection.xrevrange(keys.HISTORY_KEY, count=1)
        since = now - 2 * self.interval_s
        if last:
            if int(last[0][0].split(b"-")[0]) >= bucket_ms:
                return False
            try:
                since = max(since, float(json.loads(last[0][1][b"data"])["t"]))
            except (KeyError, TypeError, ValueError):
                pass
        snapshot = await aread_snapshot(self._connection)
        sample = Sample.of(snapshot, await recent_ttfts(self._connection, [q.name for q in snapshot.queues], since))
        try:
            await self._connection.xadd(keys.HISTORY_KEY, {"data": json.dumps(asdict(sample))}, id=f"{bucket_ms}-0",
                                        minid=int((now - self.window_s) * 1000), approximate=True)
        except ResponseError:  # a replica added this interval's sample meanwhile
            return False
        return True


def history_json(samples: list[Sample]) -> list[dict[str, Any]]:
    return [asdict(sample) for sample in samples]
