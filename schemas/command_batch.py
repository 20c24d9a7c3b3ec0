"""Many Redis commands in one atomic server-side call, cheaply.

A batching worker writes ~30 commands per job (rq's registries, executions, results; the result
key) for hundreds of jobs per step, and a producer ~8 per job it enqueues; a redis-py pipeline's
Python per command is too slow for that (docs/design-notes.md). A `CommandBatch` is handed to rq's
helpers where they take a `pipeline=`: redis-py's own command methods build each command, the batch
only records it, and `execute` sends them all to one Lua script, which runs them in order and
returns every reply: atomic like MULTI/EXEC.

The commands travel as one MessagePack array (the script's one argument, unpacked by Redis's
built-in cmsgpack), packed in one C call far cheaper than packing each as its own RESP argument,
which held the GIL (and so the worker's decode loop) all along. Numbers reach the script as Lua numbers (doubles), which
Redis writes back in shortest round-trip form (7.0 and later; 6.x writes 17 significant digits,
the same double): integers must stay within +-2**53, as every rq and mlxq write does (TTLs,
counts, Unix timestamps).

Like MULTI/EXEC, a command that fails does not stop the ones after it; `execute` then raises the
first error. Keys are not declared to the script, which Redis and Valkey allow (Redis Cluster
cannot run rq anyway: its transactions span many keys); a server that requires scripts to declare
their keys must be configured to allow undeclared ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Optional

import hiredis
import msgpack
import redis
from redis.commands.core import CoreCommands

from schemas.durability import Durability

# Lua that runs the commands in the string `packed` (one MessagePack array, each command its argument
# count followed by its arguments) and leaves their replies in `replies`; other scripts embed it too.
RUN_COMMANDS = """
local argv = cmsgpack.unpack(packed)
local replies, i, n = {}, 1, 0
while i <= #argv do
  local argc = argv[i]
  n = n + 1
  replies[n] = redis.pcall(unpack(argv, i + 1, i + argc))
  i = i + argc + 1
end
"""

# KEYS: guard keys: if any exists, run nothing and return nil. ARGV[1]: the commands.
RUN_SCRIPT = """
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then return nil end
end
local packed = ARGV[1]""" + RUN_COMMANDS + """return replies
"""
RUN_SCRIPT_SHA = hashlib.sha1(RUN_SCRIPT.encode()).hexdigest()


class CommandBatch(CoreCommands):
    """Record commands through redis-py's command methods (`batch.hset(...)`, or rq helpers given
    `pipeline=batch`), then `execute()` them in one round trip."""

    def __init__(self, connection: redis.Redis) -> None:
        self._connection = connection
        self._argv: list[Any] = []
        self._count = 0

    def execute_command(self, *args: Any, **options: Any) -> "CommandBatch":
        self._argv.append(len(args))
        self._argv.extend(args)
        self._count += 1
        return self

    def __len__(self) -> int:
        return self._count

    def take(self) -> tuple[list[Any], bytes]:
        """The recorded commands, flat (argc, args..., argc, args...), and as RUN_SCRIPT's one argument;
        the batch is empty afterwards. `execute` runs them; the asyncio producer runs them on its own."""
        argv, self._argv, self._count = self._argv, [], 0
        # Raw strings only: the cmsgpack of Redis 7.0 has no bin type (bytes and str both arrive as Lua strings).
        return argv, msgpack.packb(argv, use_bin_type=False)

    def execute(self, unless_exists: Sequence[str] = (), durability: Optional[Durability] = None,
                raise_errors: bool = True) -> Optional[list[Any]]:
        """Run the recorded commands, atomically and in order; return their replies, or None
        (nothing ran) if any key in `unless_exists` exists. Raises the first command error, or with
        `raise_errors=False` leaves each in its place among the replies (a lost connection raises).
        With `durability`, then WAIT on the same connection for that many replicas to have the writes;
        NotReplicated if fewer confirm in time (the writes are on the primary all the same)."""
        if not self._count and not unless_exists:
            return []
        argv, commands = self.take()
        packed = hiredis.pack_command(("EVALSHA", RUN_SCRIPT_SHA, len(unless_exists), *unless_exists, commands))
        try:
            replies = self._send(packed, durability)
        except redis.exceptions.NoScriptError:  # a restarted or flushed server: the call carries the script
            replies = self._send(hiredis.pack_command(("EVAL", RUN_SCRIPT, len(unless_exists), *unless_exists,
                                                       commands)), durability)
        except redis.exceptions.ResponseError as exc:
            if unless_exists or not str(exc).lower().startswith("unknown command"):
                raise
            replies = self._execute_as_transaction(argv)
        if replies is None:
            return None
        for reply in replies if raise_errors else ():
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _execute_as_transaction(self, argv: list[Any]) -> list[Any]:
        return run_as_transaction(self._connection, argv)

    def _send(self, packed: bytes, durability: Optional[Durability] = None) -> Any:
        pool = self._connection.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_packed_command([packed])
            replies = connection.read_response()
            if durability is not None:  # WAIT counts this connection's own writes only
                connection.send_command("WAIT", durability.replicas, durability.timeout_ms)
                durability.check(connection.read_response())
            return replies
        except redis.ResponseError:  # a whole error reply was read: the connection is in step
            raise
        except BaseException:
            # Anything else (a lost connection; a signal's SystemExit between the send and the
            # read) may leave the reply unread, for the connection's next user to take as its own.
            connection.disconnect()
            raise
        finally:
            pool.release(connection)


def failed_writes(replies: Optional[list[Any]], owners: Sequence[Optional[str]]) -> dict[str, str]:
    """The first error reply of each owner (a job id; None for commands no job owns) among a batch's
    replies (`execute(raise_errors=False)`), by owner."""
    failed: dict[str, str] = {}
    for owner, reply in zip(owners, replies or []):
        if isinstance(reply, Exception) and owner is not None:
            failed.setdefault(owner, f"{type(reply).__name__}: {reply}")
    return failed


def commands_of(argv: list[Any]) -> list[tuple[Any, ...]]:
    """The commands of a flat argv from `CommandBatch.take`, one tuple each."""
    commands, i = [], 0
    while i < len(argv):
        argc = argv[i]
        commands.append(tuple(argv[i + 1 : i + 1 + argc]))
        i += argc + 1
    return commands


def run_as_transaction(connection: redis.Redis, argv: list[Any]) -> list[Any]:
    """The same commands in MULTI/EXEC, for a server without Lua scripting (fakeredis without
    lupa, in a producer's unit tests); the replies are then redis-py's parsed ones."""
    with connection.pipeline() as pipe:
        for command in commands_of(argv):
            pipe.execute_command(*command)
        return pipe.execute(raise_on_error=False)
