"""The done channels, as an AsyncClient hears them: one pattern subscription to `mlxq:done:*`
shared by every wait and stream of the client (`DoneListener`), each registered with a `DoneWake`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import redis
import redis.asyncio as aioredis

from producer.errors import BrokerError
from schemas import keys

__all__ = ["DoneListener", "DoneWake", "stop_reader"]


@dataclass(eq=False)
class DoneWake:
    """One wait's mailbox: the ids whose done message arrived, or `lost` when messages may have been."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    woken: set[str] = field(default_factory=set)
    lost: bool = False

    def notify(self, job_id: str) -> None:
        self.woken.add(job_id)
        self.event.set()

    def notify_lost(self) -> None:
        self.lost = True
        self.event.set()


class DoneListener:
    """One pattern subscription to `mlxq:done:*` and the task that reads it, handing each job id
    published there to the waits that registered for it. After a broken read (a reconnect may drop
    messages) every wait is told to re-read everything. It needs the channel permission
    `&mlxq:done:*` under a Redis ACL."""

    def __init__(self, connection: aioredis.Redis) -> None:
        self._connection = connection
        self._pubsub: Optional[aioredis.client.PubSub] = None
        self._task: Optional[asyncio.Task[None]] = None
        self._starting: Optional[asyncio.Lock] = None
        self._waits: dict[str, set[DoneWake]] = {}

    async def start(self) -> None:
        """Subscribe (once) and wait for the confirmation: from then on no publish is missed."""
        if self._task is not None:
            return
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._task is not None:
                return
            pubsub = self._connection.pubsub()
            try:
                await pubsub.psubscribe(keys.done_channel("*"))
                deadline = time.monotonic() + 30
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message["type"] == "psubscribe":
                        break
                    if time.monotonic() > deadline:
                        raise BrokerError("redis: no confirmation of the done-channel subscription in 30 s")
            except BaseException:
                await pubsub.aclose()
                raise
            self._pubsub = pubsub
            self._task = asyncio.get_running_loop().create_task(self._run(), name="mlxq-done-listener")

    @property
    def started(self) -> bool:
        return self._task is not None

    def add(self, job_ids: Iterable[str], wake: DoneWake) -> None:
        for job_id in job_ids:
            self._waits.setdefault(job_id, set()).add(wake)

    def remove(self, job_ids: Iterable[str], wake: DoneWake) -> None:
        for job_id in job_ids:
            waits = self._waits.get(job_id)
            if waits is not None:
                waits.discard(wake)
                if not waits:
                    del self._waits[job_id]

    async def _run(self) -> None:
        assert self._pubsub is not None
        prefix = len(keys.done_channel(""))
        while True:
            try:
                message = await self._pubsub.get_message(timeout=1.0)
            except (redis.RedisError, OSError):
                self._wake_all()
                await asyncio.sleep(0.1)  # get_message reconnects and subscribes again on its next call
                continue
            if message is None or message["type"] != "pmessage":
                continue
            # Anyone allowed to publish there may: a channel that names no job id wakes no one.
            job_id = message["channel"][prefix:].decode(errors="replace")
            for wake in list(self._waits.get(job_id, ())):
                wake.notify(job_id)

    def _wake_all(self) -> None:
        for waits in list(self._waits.values()):
            for wake in list(waits):
                wake.notify_lost()

    async def close(self) -> None:
        task, pubsub = self._task, self._pubsub
        self._task = self._pubsub = None
        await stop_reader(task)
        if pubsub is not None:
            await pubsub.aclose()


async def stop_reader(task: Optional["asyncio.Future[Any]"]) -> None:
    """Cancel a task that reads Redis and wait until it has ended. redis-py can swallow a cancel
    that lands while a command starts, so it is cancelled again until it ends; what it raised is
    dropped (its readers were told already)."""
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.1)
    if task is not None and not task.cancelled():
        task.exception()
