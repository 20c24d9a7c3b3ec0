"""AsyncJobStream: `Client.stream`'s iterator for the asyncio client.

What it yields is the sync `JobStream`'s (producer/wire.py's `StreamCursor` decides); how it waits
differs. Entries come through the client's `StreamHub` (one blocking read for all of its streams),
and the job's state is read only where the stream alone cannot tell that the job ended: when the
stream opens, when the job's done message arrives (or messages may have been lost) while the stream
is silent, and after STATE_CHECK_S of silence.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Optional

from producer.done_listener import DoneWake
from producer.errors import WaitTimeout, broker_errors
from producer.stream_hub import Following, StreamHub
from producer.wire import STREAM_BATCH, StreamCursor, block_slice
from schemas import keys

if TYPE_CHECKING:
    from producer.aio import AsyncClient

__all__ = ["AsyncJobStream", "STATE_CHECK_S"]

# A silent stream's job state is read this often, besides on its done message (which the worker
# publishes after the stream's end entry): for a job that RQ ended without its worker.
STATE_CHECK_S = 5.0


class _StreamWake(DoneWake):
    """A stream's registration for its job's done message: it also cuts the stream's wait short."""

    def __init__(self) -> None:
        super().__init__()
        self.following: Optional[Following] = None

    def notify(self, job_id: str) -> None:
        super().notify(job_id)
        if self.following is not None:
            self.following.interrupt()

    def notify_lost(self) -> None:
        super().notify_lost()
        if self.following is not None:
            self.following.interrupt()


class AsyncJobStream(AsyncIterator[dict[str, Any]]):
    """The async iterator `AsyncClient.stream` returns; `last_event_id` is where a new one would resume."""

    def __init__(self, client: "AsyncClient", cursor: StreamCursor, timeout: float | None) -> None:
        self._client, self._cursor, self._timeout = client, cursor, timeout
        self._pending: list[tuple[str, dict[str, Any]]] = []
        self._wake = _StreamWake()
        self._following: Optional[Following] = None
        self._stop_following: Optional[weakref.finalize] = None
        self._next_check = 0.0  # the state is read before the first wait

    @property
    def job_id(self) -> str:
        return self._cursor.job_id

    @property
    def last_event_id(self) -> str:
        return self._cursor.last_event_id

    def __aiter__(self) -> "AsyncJobStream":
        return self

    async def __anext__(self) -> dict[str, Any]:
        deadline = None if self._timeout is None else time.monotonic() + max(self._timeout, 0.0)
        try:
            while not self._pending:
                if self._cursor.ended:
                    raise StopAsyncIteration
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WaitTimeout(f"no stream event for job {self.job_id} within {self._timeout} s",
                                      pending=[self.job_id])
                self._pending = await self._read(block_slice(left, self._client._socket_timeout()))
        except BaseException:
            self._stop()
            raise
        event_id, event = self._pending.pop(0)
        self._cursor.last_event_id = event_id
        return event

    def take_ready(self) -> list[dict[str, Any]]:
        """Every event that iterating would yield next without waiting (what was read already), at once."""
        following = self._following
        if following is not None and following.buffered and not self._cursor.ended:
            entries, following.buffered = following.buffered, []
            self._pending += self._cursor.from_entries(entries)
            self._next_check = time.monotonic() + STATE_CHECK_S
        ready, self._pending = self._pending, []
        if ready:
            self._cursor.last_event_id = ready[-1][0]
        return [event for _, event in ready]

    async def _read(self, block_s: float) -> list[tuple[str, dict[str, Any]]]:
        """The events after the cursor: those the hub read; the job's end if it ended with nothing
        more in its stream; else nothing, after up to `block_s` s."""
        cursor = self._cursor
        with broker_errors():
            following = await self._follow()
            wake = self._wake
            # (Entries read already come first: a job's end entry is written before its done message.)
            if not following.buffered and (wake.woken or wake.lost or time.monotonic() >= self._next_check):
                wake.woken.clear()
                wake.lost = False
                self._next_check = time.monotonic() + STATE_CHECK_S
                events = await self._state_check(following)
                if events is not None:
                    return events
            entries = await self._hub.take(following, block_s)
        if entries:
            self._next_check = time.monotonic() + STATE_CHECK_S
        return cursor.from_entries(entries)

    async def _state_check(self, following: Following) -> Optional[list[tuple[str, dict[str, Any]]]]:
        """The stream read directly, then the job's state: its events if the stream has more, its
        end if it ended, None if neither (as the sync client's read after a silence)."""
        client, cursor = self._client, self._cursor
        key = keys.stream_key(cursor.job_id)
        for _ in range(2):  # an end event can arrive between the first read and the state's
            batch = await client.connection.xread({key: cursor.last_event_id}, count=STREAM_BATCH)
            if batch:
                following.skip_to(batch[0][1][-1][0])
                return cursor.from_entries(batch[0][1])
            settled = await client._settled((await client._read_states([cursor.job_id]))[0])
            if settled is None:
                return None
        return cursor.from_result(settled, bool(await client.connection.exists(key)))

    @property
    def _hub(self) -> StreamHub:
        return self._client._streams

    async def _follow(self) -> Following:
        """The hub follows this job's stream, and the done listener its job, until `_stop`."""
        if self._following is None:
            client = self._client
            await client._listener.start()
            following = self._hub.follow(keys.stream_key(self._cursor.job_id), self._cursor.last_event_id)
            self._wake.following = following
            client._listener.add([self._cursor.job_id], self._wake)
            self._following = following
            # An iterator left unfinished stops following when it is collected.
            self._stop_following = weakref.finalize(self, _unfollow, client, following, self._cursor.job_id,
                                                    self._wake)
        return self._following

    def _stop(self) -> None:
        if self._stop_following is not None:
            self._stop_following()
        self._following = self._stop_following = None
        self._wake.following = None


def _unfollow(client: "AsyncClient", following: Following, job_id: str, wake: DoneWake) -> None:
    client._streams.close(following)
    client._listener.remove([job_id], wake)
