"""The worker's side of the control plane (schemas/control.py, docs/rl.md): the commands a trainer
sends to the workers of one model, applied between two engine steps.

`ControlChannel` reads the model's control stream and writes acknowledgements. `Controller` keeps
what the commands ask of the batch loop (paused or not, a version being fetched, a version waiting
for running sequences to finish) and, each turn, does what is due through the loop's
`LoopControls`. Only the loop's thread calls it; weights are fetched and checked on the
WeightLoader's thread (worker/weights.py) and swapped in by the loop.

Weight policies: `drain` (admit nothing new once the version is fetched, let running sequences
finish on the old weights, swap, go on), `abort` (running jobs go back to their queues, swap, go
on), `inflight` (swap at once; running sequences go on under the new weights, each token's version
recorded). Pause `keep` freezes running sequences until `resume`; `abort` sends them back first.
"""

from __future__ import annotations

import logging
import queue
import time
from pathlib import Path
from typing import Callable, Optional, Protocol

import redis

from schemas import keys
from schemas.control import ControlAck, ControlCommand, PauseMode
from worker.weights import FetchedVersion, WeightLoader, release

log = logging.getLogger("mlxq.worker")

CONTROL_CHECK_INTERVAL_S = 0.1  # how often a busy loop reads its model's control stream
ACK_TTL_S = 24 * 3600


class ControlChannel:
    """One model's control stream, read from where it stood when the worker started."""

    def __init__(self, connection: redis.Redis, model: str, worker_name: str) -> None:
        self._connection = connection
        self._model = model
        self._stream = keys.control_stream(model)
        self._weights_key = keys.weights_key(model)
        self._worker = worker_name
        last = connection.xrevrange(self._stream, count=1)
        self._last_id = last[0][0] if last else b"0-0"

    def paused(self) -> Optional[PauseMode]:
        """The model's pause, for a worker that starts while its model is paused."""
        raw = self._connection.get(keys.paused_key(self._model))
        return None if raw is None else ("abort" if raw == b"abort" else "keep")

    def latest_weights(self) -> Optional[ControlCommand]:
        """The model's latest published version, for a worker that starts or comes back."""
        raw = self._connection.get(self._weights_key)
        return None if raw is None else _parse(raw)

    def published_adapters(self) -> list[ControlCommand]:
        """Every adapter published for the model, for a worker that starts or comes back."""
        raw = self._connection.hgetall(keys.adapters_key(self._model))
        return [command for command in (_parse(value) for value in raw.values()) if command is not None]

    def read(self) -> list[ControlCommand]:
        entries = self._connection.xrange(self._stream, min=b"(" + self._last_id, count=64)
        commands = []
        for entry_id, fields in entries:
            self._last_id = entry_id
            command = _parse(fields.get(b"command", b""))
            if command is not None:
                commands.append(command)
        return commands

    def ack(self, command: ControlCommand, ok: bool, message: str, version: Optional[int],
            seconds: Optional[float] = None) -> None:
        ack = ControlAck(worker=self._worker, ok=ok, message=message, weight_version=version, at=time.time(),
                         seconds=seconds)
        key = keys.ack_key(command.id)
        with self._connection.pipeline(transaction=False) as pipe:
            pipe.hset(key, self._worker, ack.model_dump_json())
            pipe.expire(key, ACK_TTL_S)
            pipe.execute()


def _parse(raw: bytes) -> Optional[ControlCommand]:
    try:
        return ControlCommand.model_validate_json(raw)
    except ValueError:
        log.warning("ignored a control command that does not read: %r", raw[:200])
        return None


class LoopControls(Protocol):
    """What the controller asks of the batch loop (worker/batch_loop.py)."""

    @property
    def weight_version(self) -> int: ...

    def running_count(self) -> int: ...

    def requeue_running(self) -> None:
        """Every running job back to its queue, to run again (on new weights, or after a resume)."""
        ...

    def cancel_running(self, job_id: Optional[str]) -> None:
        """End one running job (or all) as cancelled, with its partial output."""
        ...

    def swap_weights(self, files: list[Path], version: int) -> None:
        """Swap the version into the engine now (raises WeightsError, leaving the old one)."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def add_adapter(self, name: str, directory: Path) -> None:
        """Serve the adapter in `directory` as `name` from now on (raises ValueError naming `adapter`
        if the engine cannot: not a LoRA adapter of this model, or an engine without adapters)."""
        ...

    def ack(self, command: ControlCommand, ok: bool, message: str, seconds: Optional[float]) -> None:
        """Acknowledge a command (written by the bookkeeping thread)."""
        ...


class Controller:
    def __init__(self, channel: ControlChannel, loader: WeightLoader, version: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`version`: the engine's weights at the start (a newer published one is fetched at once)."""
        self.channel, self._loader, self._clock = channel, loader, clock
        self.paused: Optional[PauseMode] = channel.paused()
        self._fetching: Optional[ControlCommand] = None  # handed to the loader
        self._draining: Optional[FetchedVersion] = None  # fetched, waiting for running sequences to end
        self._next_read = 0.0
        self._received: dict[str, float] = {}  # command id -> when it arrived here, until acknowledged
        # The latest published weights and every published adapter are in place before the worker takes
        # a job: a job sent after a publish must not meet the weights it replaced, nor miss an adapter.
        self._catching_up: set[str] = set()
        latest = channel.latest_weights()
        if latest is not None and latest.version is not None and latest.version > version:
            log.info("catching up with version %d of the weights", latest.version)
            self._catching_up.add(latest.id)
            self._fetch(latest)
        for adapter in channel.published_adapters():
            self._catching_up.add(adapter.id)
            self._loader.submit(adapter)

    def stop(self) -> None:
        self._loader.stop()

    @property
    def admitting(self) -> bool:
        """Whether the loop may take new jobs: not while paused, draining for a swap, or catching up with
        what was published before the worker started."""
        return self.paused is None and self._draining is None and not self._catching_up

    @property
    def stepping(self) -> bool:
        """Whether the engine may step: not while paused with sequences kept frozen."""
        return self.paused != "keep"

    def turn(self, loop: LoopControls) -> None:
        """Read new commands (at most every CONTROL_CHECK_INTERVAL_S), apply them, and do what is due."""
        now = self._clock()
        if now >= self._next_read:
            self._next_read = now + CONTROL_CHECK_INTERVAL_S
            for command in self.channel.read():
                self._apply(command, loop)
        while True:
            try:
                fetched = self._loader.ready.get_nowait()
            except queue.Empty:
                break
            self._fetched(fetched, loop)
        if self._draining is not None and not loop.running_count():
            fetched, self._draining = self._draining, None
            self._swap(fetched, loop)

    def _ack(self, loop: LoopControls, command: ControlCommand, ok: bool, message: str) -> None:
        """Acknowledge, with the seconds from the command's arrival here to now."""
        received = self._received.pop(command.id, None)
        loop.ack(command, ok, message, None if received is None else time.monotonic() - received)

    def _apply(self, command: ControlCommand, loop: LoopControls) -> None:
        self._received[command.id] = time.monotonic()
        if command.op == "weights":
            if command.version is None or command.version <= loop.weight_version:
                self._ack(loop, command, True, f"already on version {loop.weight_version}")
                return
            self._fetch(command)  # acknowledged once swapped in, or refused
        elif command.op == "pause":
            if command.mode == "abort":
                loop.requeue_running()
            self.paused = command.mode or "keep"
            self._ack(loop, command, True, f"paused ({self.paused})")
        elif command.op == "resume":
            self.paused = None
            self._ack(loop, command, True, "resumed")
        elif command.op == "abort":
            loop.cancel_running(command.job_id)
            self._ack(loop, command, True, "aborted" + (f" job {command.job_id}" if command.job_id else " every job"))
        elif command.op == "reset_prefix_cache":
            loop.reset_prefix_cache()
            self._ack(loop, command, True, "prefix cache reset")
        elif command.op == "adapter":
            self._loader.submit(command)  # acknowledged once fetched and checked, or refused

    def _fetch(self, command: ControlCommand) -> None:
        self._fetching = command
        self._loader.submit(command)

    def _fetched(self, fetched: FetchedVersion, loop: LoopControls) -> None:
        command = fetched.command
        if command.op == "adapter":
            self._adapter_fetched(fetched, loop)
            return
        self._catching_up.discard(command.id)  # swapped in below (nothing runs yet), or refused
        if self._fetching is not None and command.id == self._fetching.id:
            self._fetching = None
        if fetched.error is not None:
            log.error("weights not swapped: %s", fetched.error)
            self._ack(loop, command, False, fetched.error)
            release(fetched)
            return
        assert command.version is not None
        if command.version <= loop.weight_version:  # a newer one came first
            self._ack(loop, command, True, f"already on version {loop.weight_version}")
            release(fetched)
            return
        policy = command.policy or "drain"
        if policy == "drain" and loop.running_count():
            if self._draining is not None:
                release(self._draining)
            self._draining = fetched
            return
        if policy == "abort":
            loop.requeue_running()
        self._swap(fetched, loop)

    def _adapter_fetched(self, fetched: FetchedVersion, loop: LoopControls) -> None:
        command = fetched.command
        self._catching_up.discard(command.id)
        if fetched.error is None:
            try:
                loop.add_adapter(str(command.adapter), fetched.files[0])
            except ValueError as exc:
                fetched = FetchedVersion(command, fetched.files, str(exc))
            except Exception as exc:  # a refusal, whatever raised it: the worker and the adapters it serves go on
                log.exception("adapter %r not served", command.adapter)
                fetched = FetchedVersion(command, fetched.files,
                                         f"adapter: {command.adapter!r}: {type(exc).__name__}: {exc}")
        if fetched.error is not None:
            log.error("adapter not served: %s", fetched.error)
            self._ack(loop, command, False, fetched.error)
            return
        log.info("serving adapter %s", command.adapter)
        self._ack(loop, command, True, f"adapter {command.adapter!r} ready")

    def _swap(self, fetched: FetchedVersion, loop: LoopControls) -> None:
        command = fetched.command
        assert command.version is not None
        started = time.perf_counter()
        try:
            loop.swap_weights(fetched.files, command.version)
        except ValueError as exc:
            log.error("weights not swapped: version %d: %s", command.version, exc)
            self._ack(loop, command, False, f"version {command.version}: {exc}")
            return
        except Exception as exc:  # refused all the same: the old weights keep serving
            log.exception("weights not swapped: version %d", command.version)
            self._ack(loop, command, False, f"version {command.version}: {type(exc).__name__}: {exc}")
            return
        finally:
            release(fetched)
        log.info("swapped in version %d of the weights (%s) in %.3f s", command.version, command.policy or "drain",
                 time.perf_counter() - started)
        self._ack(loop, command, True, f"on version {command.version}")
