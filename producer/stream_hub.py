"""StreamHub: every token stream an AsyncClient follows, read with one blocking XREAD.

Each open `AsyncJobStream` follows its job's stream through a `Following`; the hub's task keeps one
`XREAD BLOCK` over all followed streams on a connection of its own, and puts what it reads in each
follower's buffer. So 256 streams in flight cost one round trip per batch of new entries, not one per
stream per entry, and a silent stream costs nothing.

A stream followed while that read blocks wakes it: the read also follows a stream private to this hub
(`mlxq:wake:<random token>`), and the new follower adds an entry there, so it joins the next read at
once. Where the server refuses that key (an ACL without `~mlxq:wake:*`), the hub's reads block for at
most FALLBACK_BLOCK_MS instead, so a new stream joins within that.

The read is shared, its failures are not: an error reply (a stream key that is not a stream, a
`CLIENT UNBLOCK ... ERROR` from another client) makes the hub read each stream alone, in one
pipelined round trip; a stream whose own read fails gets that error, the others get what their reads
returned, and the shared read goes on. A lost connection is read again after a pause; a Redis that
stays gone is noticed by each stream's own reads of its job's state (producer/aio_stream.py).
Positions are checked when a stream is followed (`parse_event_id`), never in the shared read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any, Optional

import redis
import redis.asyncio as aioredis

from producer.done_listener import stop_reader
from producer.wire import STREAM_BATCH, block_slice, parse_event_id
from schemas import keys

__all__ = ["FALLBACK_BLOCK_MS", "Following", "StreamHub"]

log = logging.getLogger("mlxq.producer")

FALLBACK_BLOCK_MS = 20
WAKE_TTL_S = 600  # the wake stream outlives a hub that ended without deleting it by this much
RECONNECT_PAUSE_S = (0.05, 1.0)  # after a lost connection, first and longest pause before reading again
Entry = tuple[Any, Any]  # (entry id, fields) as redis-py returns them


def _position(entry_id: Any) -> tuple[int, int]:
    return parse_event_id(entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id))


class Following:
    """One reader's place in one stream: the entries read for it and not taken yet, or the error that
    ended its reading."""

    def __init__(self, key: str, after: str) -> None:
        self.key = key
        self.after = _position(after)  # the last entry it was given, or has seen by other means
        self.buffered: list[Entry] = []
        self.waiter: Optional[asyncio.Future[None]] = None
        self.closed = False
        self.error: Optional[BaseException] = None  # its own read failed: the hub dropped it

    def skip_to(self, entry_id: Any) -> None:
        """The reader saw the entries up to `entry_id` by other means: never give them again. Those the
        hub read past it meanwhile stay buffered (the reader's own read may have ended before them)."""
        seen = _position(entry_id)
        self._advance(entry_id)
        self.buffered = [e for e in self.buffered if _position(e[0]) > seen]

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

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self.interrupt()


class StreamHub:
    def __init__(self, connection: aioredis.Redis) -> None:
        self._connection = connection  # its pool lends the hub its own connection; wakes go through it
        self._following: dict[str, list[Following]] = {}
        self._task: Optional[asyncio.Task[None]] = None
        self._arrived: Optional[asyncio.Event] = None
        self._reading: Optional[dict[str, str]] = None  # the streams of the read that blocks now
        self._wake_key = keys.wake_key(secrets.token_hex(16))
        self._wake_seen = "0-0"  # the last wake entry the hub's reads returned
        self._waking = False
        # Whether the server lets the hub's reads be woken (it may write its wake stream), once it
        # asked; None before.
        self.wakes_allowed: Optional[bool] = None

    def follow(self, key: str, after: str) -> Following:
        """Follow the stream `key` from after the entry `after` (InvalidRequest if that is not an
        entry id); `close` it when done."""
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
        ([] if none came). Raises the error its own stream's read met (then it is followed no more)."""
        if not following.buffered and not following.closed and following.error is None:
            self._ensure_reading()  # again, if the task ended
            waiter = asyncio.get_running_loop().create_future()
            following.waiter = waiter
            timer = asyncio.get_running_loop().call_later(timeout_s, _resolve, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                following.waiter = None
        entries, following.buffered = following.buffered, []
        if not entries and following.error is not None:
            raise following.error
        return entries

    async def close_all(self) -> None:
        task, self._task = self._task, None
        await stop_reader(task)
        if self.wakes_allowed:
            with contextlib.suppress(redis.RedisError, OSError):
                await self._connection.delete(self._wake_key)

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
        pause = RECONNECT_PAUSE_S[0]
        try:
            while True:
                streams = self._positions()
                if not streams:
                    assert self._arrived is not None
                    self._arrived.clear()
                    await self._arrived.wait()
                    continue
                try:
                    if self.wakes_allowed is None:
                        await self._ask_for_wakes()
                    await self._read_once(connection, streams, socket_timeout)
                    pause = RECONNECT_PAUSE_S[0]
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    log.warning("stream reads: Redis did not answer (%s); reading again in %.2f s", exc, pause)
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, RECONNECT_PAUSE_S[1])
                except Exception:  # a fault of the hub's own must not end every stream: log it, read on
                    log.exception("stream reads: a read failed; reading again")
                    await asyncio.sleep(FALLBACK_BLOCK_MS / 1000)
        finally:
            await connection.aclose()

    async def _read_once(self, connection: aioredis.Redis, streams: dict[str, str],
                         socket_timeout: Optional[float]) -> None:
        """One shared read of `streams` (and the wake stream), what it returned handed out."""
        reading = dict(streams)
        if self.wakes_allowed:
            reading[self._wake_key] = self._wake_seen
            block_s = block_slice(None, socket_timeout)
        else:
            block_s = FALLBACK_BLOCK_MS / 1000
        self._reading = streams
        try:
            reply = await connection.xread(reading, block=max(1, int(block_s * 1000)), count=STREAM_BATCH)
        except redis.ResponseError as exc:
            log.info("stream reads: the shared read failed (%s); reading each stream alone", exc)
        else:
            self._deliver(reply or ())
            return
        finally:
            self._reading = None
        if not self._deliver(await self._read_each(reading)):
            await asyncio.sleep(FALLBACK_BLOCK_MS / 1000)  # an error no stream explains: no busy loop

    async def _read_each(self, reading: dict[str, str]) -> list[tuple[Any, list[Entry]]]:
        """Each stream of `reading` read alone, at once (one pipelined round trip): what they
        returned; a stream whose read fails is handed its error and followed no more."""
        async with self._connection.pipeline(transaction=False) as pipe:
            for key, position in reading.items():
                pipe.xread({key: position}, count=STREAM_BATCH)
            replies = await pipe.execute(raise_on_error=False)
        read: list[tuple[Any, list[Entry]]] = []
        for key, reply in zip(reading, replies):
            if isinstance(reply, Exception):
                self._fail_stream(key, reply)
            elif reply:
                read += list(reply)
        return read

    def _deliver(self, reply: Any) -> int:
        """Hand each follower what the read returned for its stream; how many entries came."""
        count = 0
        for key, entries in reply:
            name = key.decode() if isinstance(key, bytes) else key
            count += len(entries)
            if name == self._wake_key:
                if entries:
                    self._wake_seen = entries[-1][0].decode() if isinstance(entries[-1][0], bytes) else entries[-1][0]
                continue
            for following in list(self._following.get(name, ())):
                following._give(entries)
        return count

    def _fail_stream(self, key: str, error: BaseException) -> None:
        if key == self._wake_key:  # read or written by someone else: wake by polling from now on
            log.warning("stream reads: the wake stream %s cannot be read (%s); polling every %d ms instead",
                        key, error, FALLBACK_BLOCK_MS)
            self.wakes_allowed = False
            return
        log.warning("stream reads: %s cannot be read (%s); its readers get the error", key, error)
        for following in self._following.pop(key, []):
            following._fail(error)

    async def _ask_for_wakes(self) -> None:
        """Whether this server lets the hub write its wake stream (it may not, under an ACL)."""
        try:
            self._wake_seen = await self._add_wake()
            self.wakes_allowed = True
        except redis.ResponseError as exc:
            self.wakes_allowed = False
            log.info("stream reads wake by polling every %d ms: the server refuses the wake stream %s (%s)",
                     FALLBACK_BLOCK_MS, self._wake_key, exc)

    async def _add_wake(self) -> str:
        async with self._connection.pipeline(transaction=False) as pipe:
            pipe.xadd(self._wake_key, {"w": "1"}, maxlen=1, approximate=False)
            pipe.expire(self._wake_key, WAKE_TTL_S)
            entry_id, _ = await pipe.execute()
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    def _positions(self) -> dict[str, str]:
        """Each followed stream and the earliest place one of its followers is at."""
        positions = {}
        for key, followers in self._following.items():
            major, minor = min(following.after for following in followers)
            positions[key] = f"{major}-{minor}"
        return positions

    def _wake(self) -> None:
        if self._waking or not self.wakes_allowed:
            return
        self._waking = True
        asyncio.get_running_loop().create_task(self._send_wake())

    async def _send_wake(self) -> None:
        try:
            await self._add_wake()
        except (redis.RedisError, OSError):
            pass  # the read ends by itself within its block
        finally:
            self._waking = False
        if self._reading is not None and self._reading != self._positions():
            self._wake()  # a stream joined after this wake went out, and missed the read that began


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
