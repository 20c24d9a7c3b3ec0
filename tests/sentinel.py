"""A Sentinel-managed Redis for tests: a primary, replicas and sentinels on free loopback ports, all
started by the test (the same server binary as the suite's: `redis-server --sentinel`, or Valkey's),
and stopped, with their data directories, when the block ends however it ends."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import redis

from mlxq.redis_server import RedisServer, find_redis_server, free_port

SERVICE = "mlxq"


class SentinelSet:
    # Not 1000: that is also the sentinels' ping period, and a primary just promoted, busy taking back
    # every client, was then marked down before its first reply: a second failover, which lost what
    # the first primary had taken (docs/operations.md, "Sentinel URLs").
    def __init__(self, replicas: int = 2, sentinels: int = 3, down_after_ms: int = 3000) -> None:
        # A replica's first sync waits 5 s by default, for more replicas to share it: none here.
        quick = ["--repl-diskless-sync-delay", "0"]
        self.primary = RedisServer(extra_args=quick)
        self.replicas = [RedisServer(extra_args=[*quick, "--replicaof", "127.0.0.1", str(self.primary.port)])
                         for _ in range(replicas)]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self._down_after_ms = down_after_ms
        self._dir = Path(tempfile.mkdtemp(prefix="mlxq-sentinel-"))
        self._sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def start(self) -> "SentinelSet":
        self.primary.start()
        for replica in self.replicas:
            replica.start()
        quorum = len(self.sentinel_ports) // 2 + 1
        for port in self.sentinel_ports:
            conf = self._dir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {self._dir}\nloglevel notice\n"
                f"logfile {self._dir / f'sentinel-{port}.log'}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} {quorum}\n"
                f"sentinel down-after-milliseconds {SERVICE} {self._down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE} 10000\nsentinel parallel-syncs {SERVICE} 2\n")
            self._sentinels.append(subprocess.Popen([find_redis_server(), str(conf), "--sentinel"],
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait(self._settled, 30, "sentinels that know every replica and each other")
        return self

    def sentinel(self, index: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[index], socket_timeout=2)

    def primary_port(self) -> int:
        with contextlib.closing(self.sentinel()) as sentinel:
            return int(sentinel.sentinel_get_master_addr_by_name(SERVICE)[1])

    def _settled(self) -> bool:
        for replica in self.replicas:
            with contextlib.closing(redis.Redis(port=replica.port, socket_timeout=2)) as conn:
                if conn.info("replication").get("master_link_status") != "up":
                    return False
        for index in range(len(self.sentinel_ports)):
            with contextlib.closing(self.sentinel(index)) as sentinel:
                try:
                    if (len(sentinel.sentinel_slaves(SERVICE)) < len(self.replicas)
                            or len(sentinel.sentinel_sentinels(SERVICE)) < len(self.sentinel_ports) - 1):
                        return False
                except redis.RedisError:
                    return False
        return True

    def crash_primary(self) -> int:
        """kill -9 the current primary; returns its port."""
        port = self.primary_port()
        server = next(s for s in [self.primary, *self.replicas] if s.port == port)
        server.crash()
        return port

    def wait_for_new_primary(self, old_port: int, timeout: float = 30) -> int:
        self._wait(lambda: self.primary_port() != old_port, timeout, "a new primary")
        return self.primary_port()

    def _wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if predicate():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.1)

    def events(self) -> str:
        """What each sentinel saw and did (instances down, failovers, reconfigurations), for a failing
        test to print: more than one failover loses writes the first one's primary took."""
        out = []
        for port in self.sentinel_ports:
            path = self._dir / f"sentinel-{port}.log"
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            out.append(f"--- sentinel {port}\n" + "\n".join(line for line in lines if " +" in line or " -" in line))
        return "\n".join(out)

    def stop(self) -> None:
        for proc in self._sentinels:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        for server in [self.primary, *self.replicas]:
            server.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def sentinel_set(**kwargs: int) -> Iterator[SentinelSet]:
    fleet = SentinelSet(**kwargs)
    try:
        yield fleet.start()
    finally:
        fleet.stop()
