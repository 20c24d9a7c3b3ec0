"""Both producer clients behind one synchronous face, so one test body runs against each.

`BlockingAsyncClient` drives a real `AsyncClient` on a private event loop thread: every call is
the async client's own coroutine, awaited there; its streams become ordinary iterators.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from producer import AsyncClient, Client

T = TypeVar("T")
KINDS = ("sync", "async")


class BlockingAsyncClient:
    def __init__(self, make: Callable[[], AsyncClient]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="async-client-loop", daemon=True)
        self._thread.start()

        async def build() -> AsyncClient:
            return make()

        try:
            self.client = self.run(build())
        except BaseException:
            self._stop()
            raise

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if name == "stream":
            return lambda *args, **kwargs: BlockingStream(self, attr(*args, **kwargs))
        if inspect.iscoroutinefunction(attr):
            return lambda *args, **kwargs: self.run(attr(*args, **kwargs))
        return attr

    def close(self) -> None:
        try:
            self.run(self.client.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "BlockingAsyncClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class BlockingStream(Iterator[dict[str, Any]]):
    def __init__(self, owner: BlockingAsyncClient, stream: Any) -> None:
        self._owner, self._stream = owner, stream

    @property
    def last_event_id(self) -> str:
        return self._stream.last_event_id

    def __next__(self) -> dict[str, Any]:
        try:
            return self._owner.run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None


def make_client(kind: str, url: str | None, **kwargs: Any) -> Any:
    """A `Client`, or an `AsyncClient` behind the blocking face."""
    if kind == "sync":
        return Client(url, **kwargs)
    return BlockingAsyncClient(lambda: AsyncClient(url, **kwargs))


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def new_client(kind: str) -> Iterator[Callable[..., Any]]:
    """`new_client(url, **kwargs)`: a client of this test's kind, closed at the end."""
    made: list[Any] = []

    def make(url: str | None, **kwargs: Any) -> Any:
        made.append(make_client(kind, url, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def client(new_client: Callable[..., Any], redis_url: str) -> Any:
    return new_client(redis_url)
