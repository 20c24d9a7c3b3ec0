"""Which models and queues live workers serve now, from their presence entries (`mlxq:workers`,
`mlxq:worker:<name>`, schemas/presence.py): for `Client.models()`, `submit(require_live_worker=True)`,
`wait(no_worker_timeout=...)` and the gateway's routing. A worker is live while its entry has not
expired; the reading is two round trips, the same for the sync and asyncio clients."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import redis
import redis.asyncio as aioredis
from pydantic import ValidationError

from schemas import keys
from schemas.presence import PRESENCE_WINDOW_S, WorkerPresence

__all__ = ["LiveModel", "PRESENCE_WINDOW_S", "alive", "live_models", "live_queues", "read_live", "aread_live"]


@dataclass(frozen=True)
class LiveModel:
    """A model some live worker serves: the name requests use in `model`."""

    name: str
    workers: int  # live workers serving it
    queues: frozenset[str]  # the queues they listen on
    created: int  # Unix seconds its longest-running live worker started


def alive(raw_entries: Iterable[Optional[bytes]]) -> list[WorkerPresence]:
    """The presence entries, as read, that are still there and readable."""
    workers = []
    for raw in raw_entries:
        if raw is None:
            continue  # expired: not live
        try:
            workers.append(WorkerPresence.model_validate_json(raw))
        except ValidationError:
            continue  # a newer or broken writer
    return workers


def live_models(workers: Iterable[WorkerPresence]) -> dict[str, LiveModel]:
    served: dict[str, list[WorkerPresence]] = {}
    for worker in workers:
        for name in worker.served_names:
            served.setdefault(name, []).append(worker)
    return {name: LiveModel(name, len(group), frozenset(q for w in group for q in w.queues),
                            int(min(w.started_at for w in group)))
            for name, group in sorted(served.items())}


def live_queues(workers: Iterable[WorkerPresence]) -> frozenset[str]:
    return frozenset(q for w in workers for q in w.queues)


def read_live(connection: redis.Redis) -> list[WorkerPresence]:
    names = connection.zrangebyscore(keys.WORKERS_KEY, time.time() - PRESENCE_WINDOW_S, "+inf")
    return alive(connection.mget([keys.worker_key(n.decode()) for n in names]) if names else [])


async def aread_live(connection: aioredis.Redis) -> list[WorkerPresence]:
    names = await connection.zrangebyscore(keys.WORKERS_KEY, time.time() - PRESENCE_WINDOW_S, "+inf")
    return alive(await connection.mget([keys.worker_key(n.decode()) for n in names]) if names else [])


class UnservedWatch:
    """For a wait with `no_worker_timeout`: since when no live worker has listened on each pending job's
    queue (its RQ `origin`), and the error once that has lasted `limit_s`. Fed by the wait's own polls."""

    def __init__(self, limit_s: float) -> None:
        if limit_s < 0:
            raise ValueError(f"no_worker_timeout: must be >= 0 seconds, got {limit_s}")
        self.limit_s = limit_s
        self._queue: dict[str, Optional[str]] = {}
        self._since: dict[str, float] = {}  # queue -> time.monotonic() it was first seen unserved

    def unknown(self, pending: Iterable[str]) -> list[str]:
        """The pending jobs whose queue has not been read yet."""
        return [job_id for job_id in pending if job_id not in self._queue]

    def learn(self, job_ids: list[str], origins: list[Optional[bytes]]) -> None:
        for job_id, origin in zip(job_ids, origins):
            self._queue[job_id] = origin.decode() if origin else None

    def check(self, pending: Iterable[str], live: frozenset[str], now: float) -> None:
        """Raise NoLiveWorker for the first queue unserved for `limit_s`; forget queues served again."""
        from producer.errors import NoLiveWorker

        by_queue: dict[str, list[str]] = {}
        for job_id in pending:
            queue = self._queue.get(job_id)
            if queue is not None and queue not in live:
                by_queue.setdefault(queue, []).append(job_id)
        for queue in list(self._since):
            if queue not in by_queue:
                del self._since[queue]
        for queue, job_ids in sorted(by_queue.items()):
            since = self._since.setdefault(queue, now)
            if now - since >= self.limit_s:
                shown = ", ".join(job_ids[:5]) + (", ..." if len(job_ids) > 5 else "")
                raise NoLiveWorker(f"no live worker for queue {queue!r} for {now - since:.0f} s "
                                   f"({len(job_ids)} job(s) waiting in it: {shown})", queue, job_ids)
