"""Connections to the broker from a URL, for producers, workers, the gateway and the command line
alike: plain `redis://`, `rediss://` and `unix://` URLs as redis-py reads them, and Sentinel-managed
primaries, `redis+sentinel://[user:pass@]host:port[,host:port...]/service_name[/db]`, whose clients
ask the sentinels for the current primary on every (re)connect and so follow a failover
(docs/operations.md). No MLX here: producers import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import parse_qsl, unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelConnectionPool
from redis.sentinel import Sentinel, SentinelConnectionPool

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379
# Options a Sentinel URL may carry in its query string, with their types.
_FLOAT_OPTIONS = ("socket_timeout", "socket_connect_timeout")
_STRING_OPTIONS = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True)
class SentinelURL:
    """A parsed `redis+sentinel://` URL. `username` and `password` are the primary's; the sentinels
    get `sentinel_username` / `sentinel_password` from the query string, if they need any."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: Optional[str] = None
    password: Optional[str] = None
    ssl: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    def connection_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"db": self.db}
        if self.username is not None:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password
        if self.ssl:
            kwargs["ssl"] = True
        kwargs.update({k: v for k, v in self.options.items() if k in _FLOAT_OPTIONS})
        return kwargs

    def sentinel_kwargs(self) -> dict[str, Any]:
        kwargs = {k: v for k, v in self.options.items() if k in _FLOAT_OPTIONS}
        for name in _STRING_OPTIONS:
            if name in self.options:
                kwargs[name.removeprefix("sentinel_")] = self.options[name]
        return kwargs


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelURL:
    """Read a `redis+sentinel://` URL; ValueError names what is wrong with it."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"a Sentinel URL starts with redis+sentinel://, got {scheme or url!r}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        hosts, userinfo = netloc, ""
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_host_port(part) for part in hosts.split(",") if part.strip())
    if not sentinels:
        raise ValueError("a Sentinel URL names at least one sentinel: redis+sentinel://host:port/service_name")
    segments = [unquote(s) for s in path.split("/") if s]
    if not segments or len(segments) > 2:
        raise ValueError("a Sentinel URL's path is /service_name or /service_name/db")
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise ValueError(f"a Sentinel URL's db must be a number, got {segments[1]!r}")
        db = int(segments[1])
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in _FLOAT_OPTIONS:
            try:
                options[name] = float(value)
            except ValueError:
                raise ValueError(f"{name} in a Sentinel URL must be a number of seconds, got {value!r}") from None
        elif name in _STRING_OPTIONS:
            options[name] = value
        else:
            raise ValueError(f"unknown option {name!r} in a Sentinel URL (known: "
                             f"{', '.join(_FLOAT_OPTIONS + _STRING_OPTIONS)})")
    return SentinelURL(sentinels, segments[0], db, username, password, scheme.lower().startswith("rediss"), options)


def _host_port(part: str) -> tuple[str, int]:
    part = part.strip()
    if part.startswith("["):  # [::1]:26379
        host, _, tail = part[1:].partition("]")
        port_text = tail.removeprefix(":")
    else:
        host, _, port_text = part.partition(":")
    if not host:
        raise ValueError(f"a sentinel address needs a host, got {part!r}")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"a sentinel port must be a number from 1 to 65535, got {port_text!r}")
    return host, int(port_text)


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A client for `url`: `Redis.from_url`, or the primary a Sentinel URL's sentinels name (found again
    after every reconnect). `kwargs` go to each connection (e.g. socket_timeout). ValueError for a bad URL."""
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **kwargs)
    parsed = parse_sentinel_url(url)
    sentinel = Sentinel(list(parsed.sentinels), sentinel_kwargs=parsed.sentinel_kwargs())
    return sentinel.master_for(parsed.service_name, **{**parsed.connection_kwargs(), **kwargs})


class _BlockingAsyncSentinelPool(AsyncSentinelConnectionPool, aioredis.BlockingConnectionPool):
    """A Sentinel pool that waits for a free connection past `max_connections` rather than failing."""


def connect_async(url: str, *, max_connections: Optional[int] = None, **kwargs: Any) -> aioredis.Redis:
    """The asyncio twin of `connect`. With `max_connections`, a command past that many waits for a
    connection to be free rather than failing (a `max_connections` in a plain URL wins)."""
    if not is_sentinel_url(url):
        if max_connections is None:
            return aioredis.Redis.from_url(url, **kwargs)
        return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=None, **kwargs))
    parsed = parse_sentinel_url(url)
    sentinel = AsyncSentinel(list(parsed.sentinels), sentinel_kwargs=parsed.sentinel_kwargs())
    options = {**parsed.connection_kwargs(), **kwargs}
    if max_connections is None:
        return sentinel.master_for(parsed.service_name, **options)
    return sentinel.master_for(parsed.service_name, connection_pool_class=_BlockingAsyncSentinelPool,
                               max_connections=max_connections, timeout=None, **options)


def sibling(connection: redis.Redis, **overrides: Any) -> redis.Redis:
    """A new client, with its own pool, to wherever `connection` goes (the same Sentinel service, or
    the same server), with some connection settings changed (e.g. a shorter socket_timeout)."""
    pool = connection.connection_pool
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k != "connection_pool"}
    kwargs.update(overrides)
    if isinstance(pool, SentinelConnectionPool):
        kwargs["connection_class"] = pool.connection_class
        return redis.Redis(connection_pool=SentinelConnectionPool(pool.service_name, pool.sentinel_manager,
                                                                  is_master=pool.is_master, **kwargs))
    return redis.Redis(connection_pool=pool.__class__(connection_class=pool.connection_class, **kwargs))


def redact_url(url: str) -> str:
    """The URL with any password replaced, for messages and reprs."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return f"{scheme}://{user}:***@{hosts}{slash}{tail}"

