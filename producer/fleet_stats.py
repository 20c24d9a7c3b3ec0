"""The fleet at one instant, read from Redis: queues (depth, oldest job's age, jobs started and
failed), live workers (model, jobs and sequences in flight, tokens/s over the last minute, prefix-cache
hit rate, failures by type). `mlxq stats`, the gateway's `/metrics` and its `/dashboard` show it
(docs/operations.md).

Where each number comes from: queues from RQ's own keys (`rq:queues`, `rq:queue:<q>`, its started and
failed registries, the head job's `enqueued_at`); workers from their heartbeat entries
(`mlxq:worker:<name>`, schemas/presence.py) and their stats hashes (`mlxq:stats:<name>`). The queues listed
are those live workers listen on and the deepest that hold jobs (producer/fleet_queues.py): a view's cost
does not grow with queues nobody uses.

The reading is a plan of three pipelined round trips that does no I/O itself (`snapshot_plan`);
`read_snapshot` and `aread_snapshot` are its sync and asyncio drivers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import redis
import redis.asyncio as aioredis
from pydantic import ValidationError
from rq.job import Job
from rq.queue import Queue
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.utils import utcparse

from producer.fleet_queues import MAX_LISTED, active_queues_command
from schemas import keys
from schemas.presence import PRESENCE_WINDOW_S, WorkerPresence

__all__ = ["FleetSnapshot", "LiveWorker", "QueueStats", "aread_snapshot", "read_snapshot", "snapshot_plan"]

RATE_WINDOW_S = 60.0  # tokens_per_s_1m covers this long before the stats hash was written
FAILED_PREFIX = "jobs_failed_"


@dataclass(frozen=True)
class QueueStats:
    name: str
    depth: int  # jobs waiting
    oldest_age_s: Optional[float]  # how long the job at the head (the next one taken) has waited
    started: int  # jobs taken and not ended (RQ's started registry)
    failed: int  # RQ's failed registry (cancelled jobs are not there: they are not failures)
    served: bool = True  # some live worker listens on it

    @property
    def unserved(self) -> bool:
        """Jobs wait in it and no live worker listens on it: they wait until one comes (or their TTL)."""
        return self.depth > 0 and not self.served


@dataclass(frozen=True)
class LiveWorker:
    name: str
    model: str  # the name requests use (its alias), else its hub id
    kind: str
    host: str
    queues: tuple[str, ...]
    max_num_seqs: int
    running: int  # jobs in flight
    sequences: int  # sequences decoding
    weight_version: Optional[int]
    heartbeat_age_s: float
    tokens_per_s_1m: float  # completion tokens of the jobs that ended in its last minute, per second
    prefix_cache_hit_rate: Optional[float]
    jobs_finished: int
    tokens: int
    failures: dict[str, int] = field(default_factory=dict)  # error type -> jobs, since it started
    jobs_cancelled: int = 0  # since it started; not failures


@dataclass(frozen=True)
class FleetSnapshot:
    taken_at: float  # Unix seconds
    queues: tuple[QueueStats, ...]
    workers: tuple[LiveWorker, ...]
    queues_registered: int = 0  # in RQ's registry (`rq:queues`), listed or not
    queues_with_jobs: int = 0  # of those, the ones holding jobs (listed up to MAX_LISTED)
    jobs_waiting: int = 0  # in every queue, listed or not

    @property
    def models(self) -> dict[str, int]:
        """Live workers by model."""
        counts: dict[str, int] = {}
        for worker in self.workers:
            counts[worker.model] = counts.get(worker.model, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def failures(self) -> dict[str, int]:
        """Failed jobs by error type over the live workers."""
        total: dict[str, int] = {}
        for worker in self.workers:
            for error_type, count in worker.failures.items():
                total[error_type] = total.get(error_type, 0) + count
        return dict(sorted(total.items()))

    @property
    def cancelled(self) -> int:
        """Jobs the live workers ended cancelled (not counted among the failures)."""
        return sum(w.jobs_cancelled for w in self.workers)

    @property
    def unserved(self) -> list[str]:
        """Queues where jobs wait and no live worker listens."""
        return [q.name for q in self.queues if q.unserved]

    @property
    def in_flight(self) -> int:
        return sum(w.running for w in self.workers)

    @property
    def tokens_per_s(self) -> float:
        return sum(w.tokens_per_s_1m for w in self.workers)

    def to_json(self) -> dict[str, Any]:
        return {"taken_at": self.taken_at, "queues": [asdict(q) for q in self.queues],
                "workers": [{**asdict(w), "queues": list(w.queues)} for w in self.workers],
                "models": self.models, "failures": self.failures, "cancelled": self.cancelled,
                "unserved": self.unserved, "in_flight": self.in_flight, "tokens_per_s": self.tokens_per_s,
                "queues_registered": self.queues_registered, "queues_with_jobs": self.queues_with_jobs,
                "jobs_waiting": self.jobs_waiting}


Fill = Callable[[Any], None]  # queues commands on a pipeline (sync or asyncio: the same calls)


def snapshot_plan(now: float, queue_names: tuple[str, ...] = (), max_listed: int = MAX_LISTED
                  ) -> Generator[Fill, list[Any], FleetSnapshot]:
    """The reading, as a generator: it yields what to queue on a fresh pipeline and is sent that
    pipeline's replies. Queues: `queue_names`, else every one a live worker listens on and the `max_listed`
    deepest that RQ knows and that hold jobs (producer/fleet_queues.py): a model nobody serves any more
    leaves the views once its queue has drained."""
    names_reply, active = yield lambda pipe: (
        pipe.zrangebyscore(keys.WORKERS_KEY, now - PRESENCE_WINDOW_S, "+inf"),
        pipe.execute_command(*active_queues_command(max_listed)))
    names = sorted(_text(n) for n in names_reply)
    prefix = Queue.redis_queue_namespace_prefix
    registered, with_jobs, jobs_waiting = int(active[0]), int(active[1]), int(active[2])
    rq_queues = {_text(name) for name in active[3:]}

    def presences_and_queues(pipe: Any) -> None:
        for name in names:
            pipe.get(keys.worker_key(name))
            pipe.hgetall(keys.stats_key(name))

    replies = yield presences_and_queues
    workers = []
    for i, name in enumerate(names):
        worker = _live_worker(replies[2 * i], replies[2 * i + 1], now)
        if worker is not None:
            workers.append(worker)
    queues = sorted(set(queue_names) or rq_queues | {q for w in workers for q in w.queues})

    def queue_counts(pipe: Any) -> None:
        for queue in queues:
            pipe.llen(prefix + queue)
            pipe.lindex(prefix + queue, 0)
            pipe.zcard(StartedJobRegistry.key_template.format(queue))
            pipe.zcard(FailedJobRegistry.key_template.format(queue))

    counts = yield queue_counts
    heads = [_text(counts[4 * i + 1]) if counts[4 * i + 1] is not None else None for i in range(len(queues))]
    waiting = [h for h in heads if h]
    enqueued = (yield lambda pipe: [pipe.hget(Job.redis_job_namespace_prefix + h, "enqueued_at") for h in waiting]
                ) if waiting else []
    enqueued_at = dict(zip(waiting, enqueued))
    rows = []
    served = {q for w in workers for q in w.queues}
    for i, queue in enumerate(queues):
        head = heads[i]
        started = _unix(enqueued_at.get(head)) if head else None
        row = QueueStats(queue, int(counts[4 * i]), max(0.0, now - started) if started else None,
                         int(counts[4 * i + 2]), int(counts[4 * i + 3]), served=queue in served)
        if queue_names or row.served or row.depth or row.started:
            rows.append(row)
    jobs_waiting = max(jobs_waiting, sum(row.depth for row in rows))  # (a listed queue need not be registered)
    return FleetSnapshot(now, tuple(rows), tuple(workers), registered, with_jobs, jobs_waiting)


def read_snapshot(connection: redis.Redis, queue_names: tuple[str, ...] = ()) -> FleetSnapshot:
    plan = snapshot_plan(time.time(), queue_names)
    fill = next(plan)
    while True:
        pipe = connection.pipeline(transaction=False)
        fill(pipe)
        try:
            fill = plan.send(pipe.execute())
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


async def aread_snapshot(connection: aioredis.Redis, queue_names: tuple[str, ...] = ()) -> FleetSnapshot:
    plan = snapshot_plan(time.time(), queue_names)
    fill = next(plan)
    while True:
        pipe = connection.pipeline(transaction=False)
        fill(pipe)
        try:
            fill = plan.send(await pipe.execute())
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def _live_worker(raw_presence: Optional[bytes], raw_stats: dict[bytes, bytes], now: float) -> Optional[LiveWorker]:
    if raw_presence is None:
        return None  # its entry expired: not live
    try:
        presence = WorkerPresence.model_validate_json(raw_presence)
    except ValidationError:
        return None  # a newer or broken writer
    stats = {_text(k): _text(v) for k, v in raw_stats.items()}
    updated_at = _number(stats.get("updated_at")) or 0.0
    # The hash is written as jobs end: a minute after the last write, no job ended in the last minute.
    rate = (_number(stats.get("tokens_per_s_1m")) or 0.0) if now - updated_at < RATE_WINDOW_S else 0.0
    failures = {k[len(FAILED_PREFIX):]: int(_number(v) or 0) for k, v in stats.items() if k.startswith(FAILED_PREFIX)}
    return LiveWorker(
        name=presence.name, model=presence.alias or presence.model_id or "", kind=presence.kind, host=presence.host,
        queues=tuple(presence.queues), max_num_seqs=presence.max_num_seqs, running=presence.running,
        sequences=presence.sequences, weight_version=presence.weight_version,
        heartbeat_age_s=max(0.0, now - presence.heartbeat_at), tokens_per_s_1m=rate,
        prefix_cache_hit_rate=_number(stats.get("prefix_cache_hit_rate")),
        jobs_finished=int(_number(stats.get("jobs_finished")) or 0), tokens=int(_number(stats.get("tokens")) or 0),
        failures=dict(sorted(failures.items())), jobs_cancelled=int(_number(stats.get("jobs_cancelled")) or 0))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _number(value: Optional[str]) -> Optional[float]:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _unix(value: Optional[bytes]) -> Optional[float]:
    """RQ's timestamp (`2024-01-02T03:04:05.678901Z`) as Unix seconds."""
    try:
        return utcparse(_text(value)).timestamp() if value else None
    except ValueError:
        return None
