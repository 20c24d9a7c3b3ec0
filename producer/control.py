"""The control plane, producer side (schemas/control.py, docs/rl.md): what a trainer calls to drive
the workers of one model, and the waiting for every live worker's acknowledgement.

The command building and the reading of acknowledgements do no I/O; `ControlCalls` and
`AsyncControlCalls` are the two clients' I/O around them, round trip for round trip the same.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
import uuid
import zlib
from pathlib import Path
from typing import Any, Optional

import redis
import redis.asyncio as aioredis

from producer.errors import InvalidRequest, broker_errors
from producer.presence import aread_live, read_live
from schemas import keys
from schemas.control import (
    WEIGHT_CHUNK_BYTES,
    ControlAck,
    ControlCommand,
    ControlOutcome,
    PauseMode,
    WeightFile,
    WeightPolicy,
)
from schemas.presence import WorkerPresence

__all__ = ["AsyncControlCalls", "ControlCalls", "adapter_command", "control_command", "weights_command"]

STREAM_LENGTH = 1000  # commands kept on a model's control stream (approximately)
BLOB_TTL_S = 24 * 3600  # weights streamed through Redis stay this long for workers to catch up
ACK_POLL_S = 0.05
# A fleet can be briefly invisible: a broker that failed over or restarted may have lost the presence
# entries, a host that stalled past their TTL let them expire. Each worker writes its entry again within a
# heartbeat interval (5 s by default), so a command that finds no live worker waits this long for one.
NO_LIVE_WORKER_WAIT_S = 10.0


def control_command(op: str, model: str, **fields: Any) -> ControlCommand:
    if not model:
        raise InvalidRequest("model: name the model whose workers the command is for", "model")
    return ControlCommand(id=uuid.uuid4().hex, op=op, model=model, issued_at=time.time(),  # type: ignore[arg-type]
                          **fields)


def weights_command(model: str, version: int, path: str, policy: WeightPolicy = "drain", upload: bool = False
                    ) -> tuple[ControlCommand, dict[str, bytes]]:
    """A weights command and the Redis values it needs: none when the workers read `path` themselves,
    the safetensors files cut into chunks when `upload` (small models and adapters)."""
    if policy not in ("drain", "abort", "inflight"):
        raise InvalidRequest(f"policy: {policy!r} is not one of drain, abort, inflight", "policy")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidRequest(f"version: expected a whole number >= 0, got {version!r}", "version")
    directory = Path(path)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise InvalidRequest(f"path: {path!r} is not a directory of .safetensors files", "path")
    if not upload:
        return control_command("weights", model, version=version, path=str(directory.resolve()), policy=policy), {}
    command_id = uuid.uuid4().hex
    prefix = f"{model}:{version}:{command_id}"
    entries, chunks = _chunked(files, prefix)
    command = ControlCommand(id=command_id, op="weights", model=model, issued_at=time.time(), version=version,
                             blob_prefix=prefix, files=entries, policy=policy)
    return command, chunks


ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")  # as mlx_lm.lora writes them


def adapter_command(model: str, name: str, path: str, upload: bool = False
                    ) -> tuple[ControlCommand, dict[str, bytes]]:
    """An adapter command and the Redis values it needs: none when the workers read `path`
    themselves, its two files cut into chunks when `upload`."""
    if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9._:/-]{1,256}$", name) or \
            any(part in ("", ".", "..") for part in name.split("/")):
        raise InvalidRequest(f"name: {name!r} is not an adapter name (letters, digits, . _ : / -, no empty, '.' "
                             "or '..' path parts)", "name")
    directory = Path(path)
    missing = [f for f in ADAPTER_FILES if not (directory / f).is_file()]
    if missing:
        raise InvalidRequest(f"path: {path!r} is not an mlx-lm adapter directory (no {', '.join(missing)})", "path")
    if not upload:
        return control_command("adapter", model, adapter=name, path=str(directory.resolve())), {}
    command_id = uuid.uuid4().hex
    prefix = f"{model}:adapter:{command_id}"
    entries, chunks = _chunked([directory / f for f in ADAPTER_FILES], prefix)
    command = ControlCommand(id=command_id, op="adapter", model=model, issued_at=time.time(), adapter=name,
                             blob_prefix=prefix, files=entries)
    return command, chunks


def _chunked(files: list[Path], prefix: str) -> tuple[list[WeightFile], dict[str, bytes]]:
    """Each file's entry (size, checksum, chunk count) and its chunks under `prefix`."""
    chunks: dict[str, bytes] = {}
    entries = []
    for file in files:
        data = file.read_bytes()
        pieces = [data[i:i + WEIGHT_CHUNK_BYTES] for i in range(0, len(data), WEIGHT_CHUNK_BYTES)] or [b""]
        for index, piece in enumerate(pieces):
            chunks[keys.blob_key(prefix, file.name, index)] = piece
        entries.append(WeightFile(name=file.name, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                                  chunks=len(pieces)))
    return entries, chunks


def outcome(command: ControlCommand, raw_acks: dict[bytes, bytes], live: set[str]) -> ControlOutcome:
    acked = {name.decode(): ControlAck.model_validate_json(raw) for name, raw in raw_acks.items()}
    return ControlOutcome(command=command, acked=acked, missing=sorted(live - set(acked)))


def settled(result: ControlOutcome, now: float, deadline: float, nobody_until: float) -> bool:
    """Whether a command's wait ends: every live worker acknowledged (and some worker did, or none has
    shown up by `nobody_until`), or the deadline passed. Times are time.monotonic()'s."""
    return now >= deadline or (not result.missing and (bool(result.acked) or now >= nobody_until))


def serving(workers: list[WorkerPresence], model: str) -> set[str]:
    """The names of the live workers, as read, that serve `model`."""
    return {worker.name for worker in workers if model in worker.served_names}


def _command_or_none(raw: Optional[bytes]) -> Optional[ControlCommand]:
    return None if raw is None else ControlCommand.model_validate_json(raw)


# Puts back what a refused command replaced, unless something else was published since. KEYS[1]:
# the model's weights key, or its adapters hash; ARGV: the refused command's JSON, what it replaced
# ('' for nothing), and for an adapter its name (the hash field).
WITHDRAW_SCRIPT = """
local field = ARGV[3]
local now
if field then now = redis.call('HGET', KEYS[1], field) else now = redis.call('GET', KEYS[1]) end
if now ~= ARGV[1] then return 0 end
if ARGV[2] == '' then
  if field then redis.call('HDEL', KEYS[1], field) else redis.call('DEL', KEYS[1]) end
elseif field then redis.call('HSET', KEYS[1], field, ARGV[2])
else redis.call('SET', KEYS[1], ARGV[2]) end
return 1
"""


def refused_by_all(result: ControlOutcome) -> bool:
    """A weights or adapter command that at least one worker refused and none accepted: the fleet
    stays on what it had, and so must the workers that start later."""
    return (result.command.op in ("weights", "adapter") and bool(result.acked)
            and not any(a.ok for a in result.acked.values()))


def _withdraw_args(command: ControlCommand, previous: Optional[bytes]) -> tuple[Any, ...]:
    if command.op == "adapter":
        return (WITHDRAW_SCRIPT, 1, keys.adapters_key(command.model), command.model_dump_json(), previous or b"",
                str(command.adapter))
    return WITHDRAW_SCRIPT, 1, keys.weights_key(command.model), command.model_dump_json(), previous or b""


def _publish_commands(pipe: Any, command: ControlCommand, chunks: dict[str, bytes]) -> None:
    """Queue the command's writes; for a weights or adapter command, the reply at index len(chunks)
    is what it replaces (None for nothing)."""
    for key, value in chunks.items():
        pipe.set(key, value, ex=BLOB_TTL_S)
    if command.op == "weights":
        pipe.set(keys.weights_key(command.model), command.model_dump_json(), get=True)
    elif command.op == "adapter":
        pipe.hget(keys.adapters_key(command.model), str(command.adapter))
        pipe.hset(keys.adapters_key(command.model), str(command.adapter), command.model_dump_json())
    elif command.op == "pause":
        pipe.set(keys.paused_key(command.model), command.mode or "keep")
    elif command.op == "resume":
        pipe.delete(keys.paused_key(command.model))
    pipe.xadd(keys.control_stream(command.model), {"command": command.model_dump_json()}, maxlen=STREAM_LENGTH,
              approximate=True)


class ControlCalls:
    """The sync client's control calls (producer.Client's methods use these)."""

    def __init__(self, connection: redis.Redis) -> None:
        self._connection = connection

    def send(self, command: ControlCommand, chunks: dict[str, bytes], timeout: float) -> ControlOutcome:
        """Publish the command and wait until every live worker of its model has acknowledged it, or
        `timeout` seconds have passed (then `missing` names those that did not)."""
        with broker_errors():
            with self._connection.pipeline(transaction=False) as pipe:
                _publish_commands(pipe, command, chunks)
                replies = pipe.execute()
            started = time.monotonic()
            deadline, nobody_until = started + timeout, started + min(timeout, NO_LIVE_WORKER_WAIT_S)
            while True:
                live = serving(read_live(self._connection), command.model)
                result = outcome(command, self._connection.hgetall(keys.ack_key(command.id)), live)
                if settled(result, time.monotonic(), deadline, nobody_until):
                    break
                time.sleep(ACK_POLL_S)
            if refused_by_all(result):
                withdrawn = self._connection.eval(*_withdraw_args(command, replies[len(chunks)]))
                result.withdrawn = bool(withdrawn)
            return result

    def latest_weights(self, model: str) -> Optional[ControlCommand]:
        with broker_errors():
            return _command_or_none(self._connection.get(keys.weights_key(model)))


class AsyncControlCalls:
    """The asyncio client's control calls, the twin of ControlCalls."""

    def __init__(self, connection: aioredis.Redis) -> None:
        self._connection = connection

    async def send(self, command: ControlCommand, chunks: dict[str, bytes], timeout: float) -> ControlOutcome:
        with broker_errors():
            async with self._connection.pipeline(transaction=False) as pipe:
                _publish_commands(pipe, command, chunks)
                replies = await pipe.execute()
            started = time.monotonic()
            deadline, nobody_until = started + timeout, started + min(timeout, NO_LIVE_WORKER_WAIT_S)
            while True:
                live = serving(await aread_live(self._connection), command.model)
                result = outcome(command, await self._connection.hgetall(keys.ack_key(command.id)), live)
                if settled(result, time.monotonic(), deadline, nobody_until):
                    break
                await asyncio.sleep(ACK_POLL_S)
            if refused_by_all(result):
                withdrawn = await self._connection.eval(*_withdraw_args(command, replies[len(chunks)]))
                result.withdrawn = bool(withdrawn)
            return result

    async def latest_weights(self, model: str) -> Optional[ControlCommand]:
        with broker_errors():
            return _command_or_none(await self._connection.get(keys.weights_key(model)))


def abort_target(model: Optional[str], job_id: Optional[str], job_model: Optional[str]) -> tuple[str, Optional[str]]:
    """The model an abort goes to: `model`, else the model of the job (`job_model`, read from it)."""
    if model is None and job_id is None:
        raise InvalidRequest("abort: name a model (every job it runs) or a job_id", "model")
    target = model or job_model
    if not target:
        raise InvalidRequest(f"model: job {job_id} names no model; give the model its workers serve", "model")
    return target, job_id


def job_model(data: Optional[bytes]) -> Optional[str]:
    """The `model` a job's request names, from its rq job data (JSON, maybe zlib-compressed)."""
    if not data:
        return None
    try:
        data = zlib.decompress(data)
    except zlib.error:
        pass
    try:
        request = json.loads(data)[3].get("request", {})
        return request.get("model") if isinstance(request, dict) else None
    except (ValueError, TypeError, IndexError, AttributeError):
        return None


def pause_command(model: str, mode: PauseMode) -> ControlCommand:
    if mode not in ("keep", "abort"):
        raise InvalidRequest(f"mode: {mode!r} is not one of keep, abort", "mode")
    return control_command("pause", model, mode=mode)
