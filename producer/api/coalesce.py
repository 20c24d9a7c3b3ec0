"""Calls that concurrent requests make in the same turn of the event loop, run together in one Redis
round trip: requests woken together (a worker ends a batch of jobs at once) then share one call."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, Optional, TypeVar

__all__ = ["Coalescer"]

T = TypeVar("T")
R = TypeVar("R")


class Coalescer(Generic[T, R]):
    """`await coalescer(item)`: the item's own reply from `run_many(items)`, which is called once
    with every item asked for in one turn of the loop and returns their replies in order. An
    exception from `run_many` is raised to every caller of that batch."""

    def __init__(self, run_many: Callable[[Sequence[T]], Awaitable[Sequence[R]]]) -> None:
        self._run_many = run_many
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._flushing: set[asyncio.Task[None]] = set()  # held so that a running batch is not collected

    async def __call__(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((item, future))
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _run(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        error: Optional[Exception] = None
        try:
            replies = await self._run_many([item for item, _ in batch])
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # handed to the callers, whose requests answer it
            error, replies = exc, []
        for i, (_, future) in enumerate(batch):
            if future.done():  # its caller went away meanwhile
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(replies[i])
