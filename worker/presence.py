"""A worker's entry in the live-worker list (`mlxq:worker:<name>`, scored in `mlxq:workers`): what
it serves and how busy it is, refreshed by the liveness thread every heartbeat interval, busy or
idle (schemas/presence.py)."""

from __future__ import annotations

import os
import socket
import time
from typing import Optional

import redis

from schemas import keys
from schemas.command_batch import CommandBatch
from schemas.presence import PRESENCE_WINDOW_S, WorkerPresence
from worker.settings import WorkerSettings


def public_model_id(model: Optional[str]) -> Optional[str]:
    """The model's hub id, or None when it names a local path (paths are the host's own)."""
    if not model or os.path.isabs(model) or model.startswith(".") or os.path.exists(model):
        return None
    return model


class PresencePublisher:
    def __init__(self, connection: redis.Redis, name: str, settings: WorkerSettings, queues: list[str],
                 kind: str) -> None:
        self._connection = connection
        self._ttl_s = settings.heartbeat_ttl_s
        self._base = WorkerPresence(
            name=name, alias=settings.served_alias, model_id=public_model_id(settings.model), kind=kind,
            queues=queues, group=settings.group, host=socket.gethostname(), pid=os.getpid(),
            max_num_seqs=settings.max_num_seqs, started_at=time.time(), ttl_s=self._ttl_s)

    def refresh(self, running: int, sequences: int, weight_version: Optional[int] = None) -> None:
        now = time.time()
        entry = self._base.model_copy(update={"running": running, "sequences": sequences,
                                              "weight_version": weight_version, "heartbeat_at": now})
        batch = CommandBatch(self._connection)
        batch.set(keys.worker_key(entry.name), entry.model_dump_json(), ex=self._ttl_s)
        batch.zadd(keys.WORKERS_KEY, {entry.name: now})
        batch.zremrangebyscore(keys.WORKERS_KEY, "-inf", now - PRESENCE_WINDOW_S)
        batch.execute()

    def withdraw(self) -> None:
        batch = CommandBatch(self._connection)
        batch.delete(keys.worker_key(self._base.name))
        batch.zrem(keys.WORKERS_KEY, self._base.name)
        batch.execute()

