"""Lua scripts that survive the loss of the server's script cache (`SCRIPT FLUSH`, a restarted or
failed-over server), for workers, producers and the gateway alike.

A call is EVALSHA; where the server answers NOSCRIPT, the same call goes again as EVAL, which carries
the script's text, so no flush between a reload and the retry can make it miss again (redis-py's own
`register_script` reloads and retries once, and fails when a flush lands in between), and the server
caches the script again for the next EVALSHA. Producers therefore need EVAL and EVALSHA, and no
SCRIPT subcommand (docs/operations.md#redis-acls).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Optional

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

__all__ = ["AsyncScript", "Script"]


class Script:
    """A Lua script called on a sync connection: `script(keys=[...], args=[...])`."""

    def __init__(self, connection: redis.Redis, text: str) -> None:
        self._connection = connection
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        try:
            return self._connection.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return self._connection.eval(self.text, len(keys), *keys, *args)


class AsyncScript:
    """The same on an asyncio connection: `await script(keys=[...], args=[...])`."""

    def __init__(self, connection: aioredis.Redis, text: str) -> None:
        self._connection = connection
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = (),
                       client: Optional[aioredis.Redis] = None) -> Any:
        """`client`: another connection to run it on (one whose own writes a WAIT will count)."""
        connection = client if client is not None else self._connection
        try:
            return await connection.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await connection.eval(self.text, len(keys), *keys, *args)
