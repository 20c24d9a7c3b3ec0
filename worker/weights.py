"""Weight versions: a published version's safetensors fetched (from a directory the worker can read,
or from chunks streamed through Redis, each file checksummed) and checked against the served model's
parameters on a thread of their own, before the loop swaps them in between two engine steps
(worker/engines/weight_swap.py).

A version is the model's parameters in MLX's own naming (what `model.parameters()` flattens to,
as `mx.save_safetensors` or mlx-lm's `save_weights` write them): every parameter, with its shape
and dtype, and nothing else, every byte range sound and every float finite (worker/tensor_files.py).
Any mismatch, and anything else that raises while a version is read, fails the version and leaves
the model as it was: the command is answered `ok=false`, never left unanswered.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import redis

from schemas import keys
from schemas.control import ControlCommand
from worker.engines.weight_swap import ParameterSpec, WeightsError
from worker.adapters import WEIGHTS_FILE as ADAPTER_WEIGHTS_FILE
from worker.tensor_files import TensorFileError, check_tensor_file, check_values, read_header

log = logging.getLogger("mlxq.worker")

def safetensors_spec(path: Path) -> ParameterSpec:
    """The tensors a safetensors file holds, from its header alone, each byte range checked."""
    try:
        tensors = read_header(path).tensors
    except TensorFileError as exc:
        raise WeightsError(str(exc)) from None
    return {name: (entry.mlx_dtype, entry.shape) for name, entry in tensors.items()}


def check_finite(files: list[Path]) -> None:
    """Every floating-point value of the version finite: NaN or infinite weights make every later
    result unreadable."""
    for path in files:
        try:
            check_values(read_header(path))
        except TensorFileError as exc:
            raise WeightsError(str(exc)) from None


def check_files(files: list[Path], expected: ParameterSpec) -> None:
    """Every parameter of the model, once, with its shape and dtype, and nothing else."""
    found: ParameterSpec = {}
    for path in files:
        for name, spec in safetensors_spec(path).items():
            if name in found:
                raise WeightsError(f"{path.name}: parameter {name!r} appears in two files")
            found[name] = spec
    missing = sorted(set(expected) - set(found))
    if missing:
        raise WeightsError(f"{len(missing)} of the model's parameters are missing, e.g. {missing[0]!r}")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise WeightsError(f"{len(extra)} tensors are not parameters of this model, e.g. {extra[0]!r}")
    for name, (dtype, shape) in expected.items():
        if found[name][1] != shape or found[name][0] not in dtype.split("|"):
            raise WeightsError(f"parameter {name!r}: the version has {found[name][1]} {found[name][0]}, the model "
                               f"{shape} {dtype.replace('|', ' or ')}")


def fetch(connection: redis.Redis, command: ControlCommand, into: Path) -> list[Path]:
    """The version's safetensors files: listed from its directory, or assembled from Redis chunks
    into `into` and checked against their checksums."""
    if command.path is not None:
        files = sorted(Path(command.path).glob("*.safetensors"))
        if not files:
            raise WeightsError(f"path: {command.path!r} holds no .safetensors files the worker can read")
        return files
    if command.blob_prefix is None or not command.files:
        raise WeightsError("the weights command names neither a path nor files streamed through Redis")
    paths = []
    for entry in command.files:
        digest = hashlib.sha256()
        target = into / entry.name
        with target.open("wb") as out:
            for chunk in range(entry.chunks):
                data = connection.get(keys.blob_key(command.blob_prefix, entry.name, chunk))
                if data is None:
                    raise WeightsError(f"{entry.name}: chunk {chunk} of {entry.chunks} is gone from Redis (expired?)")
                digest.update(data)
                out.write(data)
        if target.stat().st_size != entry.size or digest.hexdigest() != entry.sha256:
            raise WeightsError(f"{entry.name}: checksum mismatch (the file was changed or cut in transit)")
        paths.append(target)
    return paths


@dataclass(frozen=True)
class FetchedVersion:
    """A version ready to be swapped in (`files`), or why it cannot be (`error`)."""

    command: ControlCommand
    files: list[Path]
    error: Optional[str] = None


class WeightLoader:
    """The thread that fetches and checks published versions while the loop goes on decoding; the
    loop takes what it finished (`ready`) between two steps and swaps it in then."""

    def __init__(self, connection: redis.Redis, expected: Optional[ParameterSpec]) -> None:
        """`expected`: what a version must hold (None: an engine without weights, which takes any)."""
        self._connection = connection
        self._expected = expected
        self._todo: "queue.SimpleQueue[Optional[ControlCommand]]" = queue.SimpleQueue()
        self.ready: "queue.SimpleQueue[FetchedVersion]" = queue.SimpleQueue()
        self._workdir = Path(tempfile.mkdtemp(prefix="mlxq-weights-"))
        self._thread = threading.Thread(target=self._run, name="mlxq-weights", daemon=True)
        self._thread.start()

    def submit(self, command: ControlCommand) -> None:
        self._todo.put(command)

    def stop(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=5)
        shutil.rmtree(self._workdir, ignore_errors=True)

    def _run(self) -> None:
        while True:
            command = self._todo.get()
            if command is None:
                return
            try:
                fetched = self._fetch(command)
            except Exception as exc:  # whatever a version holds, the thread goes on and the command is answered
                log.exception("could not fetch %s %s", command.op, command.id)
                what = f"adapter {command.adapter!r}" if command.op == "adapter" else f"version {command.version}"
                fetched = FetchedVersion(command, [], f"{what}: {type(exc).__name__}: {exc}")
            self.ready.put(fetched)

    def _fetch(self, command: ControlCommand) -> FetchedVersion:
        if command.op == "adapter":
            return self._fetch_adapter(command)
        into = self._workdir / f"v{command.version}-{command.id}"
        shutil.rmtree(into, ignore_errors=True)
        into.mkdir(parents=True)
        try:
            files = fetch(self._connection, command, into)
            if self._expected is not None:
                check_files(files, self._expected)
            else:
                for path in files:
                    safetensors_spec(path)
            check_finite(files)
        except (WeightsError, OSError, redis.RedisError) as exc:
            shutil.rmtree(into, ignore_errors=True)
            return FetchedVersion(command, [], f"version {command.version}: {exc}")
        return FetchedVersion(command, files)

    def _fetch_adapter(self, command: ControlCommand) -> FetchedVersion:
        """A published adapter's directory: its `path`, or its files assembled from Redis into a
        folder of their own, kept while the worker runs (the engine reads them when a request
        first names the adapter). Its tensors are checked here (byte ranges, finite values); the
        engine checks the adapter against the model."""
        if command.path is not None:
            directory = Path(command.path)
            error = _adapter_file_error(directory)
            return FetchedVersion(command, [directory] if error is None else [],
                                  None if error is None else f"adapter: {command.adapter!r}: {error}")
        into = self._workdir / "adapters" / command.id
        shutil.rmtree(into, ignore_errors=True)
        into.mkdir(parents=True)
        try:
            fetch(self._connection, command, into)
        except (WeightsError, OSError, redis.RedisError) as exc:
            shutil.rmtree(into, ignore_errors=True)
            return FetchedVersion(command, [], f"adapter: {command.adapter!r}: {exc}")
        error = _adapter_file_error(into)
        if error is not None:
            shutil.rmtree(into, ignore_errors=True)
            return FetchedVersion(command, [], f"adapter: {command.adapter!r}: {error}")
        return FetchedVersion(command, [into])


def _adapter_file_error(directory: Path) -> Optional[str]:
    """Why the adapter's tensor file must not be loaded, if it must not."""
    try:
        check_tensor_file(directory / ADAPTER_WEIGHTS_FILE)
    except TensorFileError as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot read {ADAPTER_WEIGHTS_FILE} ({exc})"
    return None


def release(fetched: Union[FetchedVersion, None]) -> None:
    """Remove a fetched version's copies once swapped in (or refused): files of a `path` stay, and
    an adapter's stay while it is served."""
    if fetched is not None and fetched.command.path is None and fetched.command.op != "adapter":
        for path in fetched.files:
            path.unlink(missing_ok=True)
