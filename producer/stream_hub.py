"""StreamHub: every token stream an AsyncClient follows, read with one blocking XREAD.

Each open `AsyncJobStream` follows its job's stream through a `Following`; the hub's task keeps one
`XREAD BLOCK` over all followed streams on a connection of its own, and puts what it reads in each
follower's buffer. So 256 streams in flight cost one round trip per batch of new entries, not one per
stream per entry, and a silent stream costs nothing. A stream followed while that read blocks wakes
it (`CLIENT UNBLOCK`, sent from the client's other connections), so it joins the next read at once;
where the server refuses `CLIENT UNBLOCK` (an ACL without `+client|unblock`, a server without it),
the hub's reads block for at most FALLBACK_BLOCK_MS instead, so a new stream joins within that.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

import redis
import redis.asyncio as aioredis

from producer.done_listener import stop_reader
from producer.wire import STREAM_BATCH, block_slice

__all__ = ["FALLBACK_BLOCK_MS", "Following", "StreamHub"]

log = logging.getLogger("mlxq.producer")

FALLBACK_BLOCK_MS = 20
Entry = tuple[Any, Any]  # (entry id, fields) as redis-py returns them


def _position(entry_id: Any) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    major, _, minor = text.partition("-")
    return int(major), int(minor or 0)


class Following:
    """One reader's place in one stream: the entries read for it and not taken yet."""

    def __init__(self, key: str, after: str) -> None:
        self.key = key
        self.after = _position(after)  # the last entry it was given, or has seen by other means
        self.buffered: list[Entry] = []
        self.waiter: Optional[asyncio.Future[None]] = None
        self.closed = False

    def skip_to(self, entry_id: Any) -> None:
        """The reader saw the entries up to `entry_id` by other means: never give them again."""
        self._advance(entry_id)
        self.buffered = [e for e in self.buffered if _position(e[0]) > self.after]

    def _advance(self, entry_id: Any) -> None:
        position = _position(entry_id)
        if position > self.after:
            self.after = position

    def interrupt(self) -> None:
        """End the reader's wait now, with whatever it has (maybe nothing)."""
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _give(self, entries: list[Entry]) -> None:
        fresh = [e for e in entries if _position(e[0]) > self.after]
        if not fresh:
            return
        self.buffered += fresh
        self._advance(fresh[-1][0])
        self.interrupt()


class StreamHub:
    def __init__(self, connection: aioredis.Redis) -> None:
        self._connection = connection  # its pool lends the hub its own connection; unblocks go through it
        self._following: dict[str, list[Following]] = {}
        self._task: Optional[asyncio.Task[None]] = None
        self._arrived: Optional[asyncio.Event] = None
        self._reading: Optional[dict[str, str]] = None  # the streams of the read that blocks now
        self._client_id: Optional[int] = None  # of the hub's connection, for CLIENT UNBLOCK
        self._waking = False
        # Whether the server let the hub's reads be woken (CLIENT UNBLOCK), once it asked; None before.
        self.wakes_allowed: Optional[bool] = None

    def follow(self, key: str, after: str) -> Following:
        """Follow the stream `key` from after the entry `after`; `close` it when done."""
        following = Following(key, after)
        self._following.setdefault(key, []).append(following)
        self._ensure_reading()
        reading = self._reading
        if reading is not None and (key not in reading or _position(reading[key]) > following.after):
            self._wake()
        return following

    def close(self, following: Following) -> None:
        """Stop following (synchronous: safe from a finalizer)."""
        following.closed = True
        followers = self._following.get(following.key)
        if followers is not None and following in followers:
            followers.remove(following)
            if not followers:
                del self._following[following.key]

    async def take(self, following: Following, timeout_s: float) -> list[Entry]:
        """The entries read for `following` since the last take, waiting up to `timeout_s` for some
        ([] if none came). Raises what broke the hub's read."""
        if not following.buffered and not following.closed:
            self._ensure_reading()  # again, after a failed read
            waiter = asyncio.get_running_loop().create_future()
            following.waiter = waiter
            timer = asyncio.get_running_loop().call_later(timeout_s, _resolve, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                following.waiter = None
        entries, following.buffered = following.buffered, []
        return entries

    async def close_all(self) -> None:
        task, self._task = self._task, None
        await stop_reader(task)

    # --- the hub's task -------------------------------------------------------------------
    def _ensure_reading(self) -> None:
        if self._task is None or self._task.done():
            self._arrived = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="mlxq-stream-hub")
        assert self._arrived is not None
        self._arrived.set()

    async def _run(self) -> None:
        connection = aioredis.Redis(connection_pool=self._connection.connection_pool, single_connection_client=True)
        socket_timeout = self._connection.connection_pool.connection_kwargs.get("socket_timeout")
        try:
            self._client_id = await self._own_client_id(connection)
            while True:
                streams = self._positions()
                if not streams:
                    assert self._arrived is not None
                    self._arrived.clear()
                    await self._arrived.wait()
                    continue
                block_s = block_slice(None, socket_timeout) if self._client_id is not None else FALLBACK_BLOCK_MS / 1000
                self._reading = streams
                try:
                    reply = await connection.xread(streams, block=max(1, int(block_s * 1000)), count=STREAM_BATCH)
                finally:
                    self._reading = None
                for key, entries in reply or ():
                    name = key.decode() if isinstance(key, bytes) else key
                    for following in list(self._following.get(name, ())):
                        following._give(entries)
        except (redis.RedisError, OSError) as exc:
            self._fail(exc)
        finally:
            self._client_id = None
            await connection.aclose()

    async def _own_client_id(self, connection: aioredis.Redis) -> Optional[int]:
        """The hub connection's id, if this server lets the client unblock it; else None."""
        try:
            client_id = int(await connection.client_id())
            await self._connection.execute_command("CLIENT", "UNBLOCK", client_id)  # is it allowed?
            self.wakes_allowed = True
            return client_id
        except redis.ResponseError as exc:
            self.wakes_allowed = False
            log.info("stream reads wake by polling every %d ms: the server refuses CLIENT ID/UNBLOCK (%s)",
                     FALLBACK_BLOCK_MS, exc)
            return None

    def _positions(self) -> dict[str, str]:
        """Each followed stream and the earliest place one of its followers is at."""
        positions = {}
        for key, followers in self._following.items():
            major, minor = min(following.after for following in followers)
            positions[key] = f"{major}-{minor}"
        return positions

    def _wake(self) -> None:
        if self._waking or self._client_id is None:
            return
        self._waking = True
        asyncio.get_running_loop().create_task(self._unblock(self._client_id))

    async def _unblock(self, client_id: int) -> None:
        try:
            await self._connection.execute_command("CLIENT", "UNBLOCK", client_id)
        except (redis.RedisError, OSError):
            pass  # the read ends by itself within its block
        finally:
            self._waking = False
        if self._reading is not None and self._reading != self._positions():
            self._wake()  # a stream joined after this unblock went out, and missed the read that began

    def _fail(self, exc: BaseException) -> None:
        """Hand the read's failure to every follower now waiting; the next take reads again."""
        for followers in self._following.values():
            for following in followers:
                if following.waiter is not None and not following.waiter.done():
                    following.waiter.set_exception(exc)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
