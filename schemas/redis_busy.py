"""A Redis server busy running a script is away, like a lost connection, not a command's error.

Any client allowed `EVAL` (the documented producer ACL allows it: docs/operations.md) can run a script
that holds the server: past `busy-reply-threshold` (5 s by default) Redis answers every other client's
command `BUSY` without running it, until the script ends or an admin's `SCRIPT KILL`. redis-py raises
that as a plain ResponseError, which no outage handling catches: a worker's loop died of it, failing
its jobs. Connections made here raise `ServerBusy`, a ConnectionError, instead (redis-py already treats
`LOADING` so): redis-py retries the command, which BUSY left unrun, and past its retries the worker
waits for Redis as for a lost connection and the gateway answers 503.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import redis
import redis.asyncio.connection as async_connection
import redis.connection as sync_connection

from schemas.broker import sibling

__all__ = ["ServerBusy", "async_parser", "busy_as_outage", "sync_parser"]


class ServerBusy(redis.exceptions.ConnectionError):
    """The server is running a script and ran nothing else (`BUSY`): safe to retry."""


class _BusyAware:
    """Marks a parser class that raises ServerBusy for `BUSY` replies."""


def _busy_aware(parser: type) -> type:
    if issubclass(parser, _BusyAware):
        return parser
    classes: dict[str, Any] = {**parser.EXCEPTION_CLASSES, "BUSY": ServerBusy}  # type: ignore[attr-defined]
    return type(f"BusyAware{parser.__name__}", (_BusyAware, parser), {"EXCEPTION_CLASSES": classes})


@lru_cache(maxsize=None)
def sync_parser() -> type:
    """redis-py's parser for sync connections (hiredis's where installed), `BUSY` read as ServerBusy:
    pass it as `parser_class=` to redis.Redis.from_url or a ConnectionPool."""
    return _busy_aware(sync_connection.DefaultParser)


@lru_cache(maxsize=None)
def async_parser() -> type:
    """The same for redis.asyncio connections."""
    return _busy_aware(async_connection.DefaultParser)


def busy_as_outage(connection: redis.Redis) -> redis.Redis:
    """A client on a pool of its own with `connection`'s settings whose connections read `BUSY` as
    ServerBusy; `connection` itself if its pool does already."""
    pool = connection.connection_pool
    parser = pool.connection_kwargs.get("parser_class", sync_connection.DefaultParser)
    if issubclass(parser, _BusyAware):
        return connection
    return sibling(connection, parser_class=_busy_aware(parser))  # (a Sentinel pool stays one)
