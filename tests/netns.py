"""Hosts with their own addresses, for tests: Linux network namespaces on one private bridge, all made by the
test and deleted when it ends however it ends (processes in them killed first). The bridge lives in a
namespace of its own with no way out, so no packet of these hosts reaches the machine's own network; the
addresses come from 198.18.0.0/15, the range set aside for network tests. Needs root and iproute2.

A test talks to these hosts as one of them: `Host.run` calls a function on a thread that lives in the
host's namespace, so every socket it opens is that host's.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Optional, TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
SUBNET = "198.18.0"


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def namespaces_available() -> Optional[str]:
    """None if this process can make network namespaces, else why not (the exact error)."""
    name = f"mlxq-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", name)
    except (RuntimeError, OSError) as exc:
        return str(exc)
    _ip("netns", "del", name)
    return None


class Host:
    def __init__(self, lab: "Lab", name: str, address: str) -> None:
        self.lab, self.name, self.address = lab, name, address
        self.netns = f"{lab.prefix}-{name}"
        self.switch_port = f"{lab.tag}{name}"[:15]  # the bridge's end of its cable
        self._thread: Optional[ThreadPoolExecutor] = None
        self.procs: list[subprocess.Popen[str]] = []

    def popen(self, argv: list[str], env: Optional[dict[str, str]] = None) -> subprocess.Popen[str]:
        """Start a process on this host (`ip netns exec` execs it: its pid is the process's own)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        self.procs.append(proc)
        return proc

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on this host's own thread (in its namespace); its result or its exception."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix=self.netns, initializer=self._enter)
        return self._thread.submit(fn, *args).result(timeout=120)

    def _enter(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.netns}")
        finally:
            os.close(fd)

    def cut(self) -> None:
        """Unplug the host's cable at the bridge: its packets go nowhere, its connections hang."""
        _ip("-n", self.lab.switch, "link", "set", self.switch_port, "down")

    def restore(self) -> None:
        _ip("-n", self.lab.switch, "link", "set", self.switch_port, "up")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)


class Lab:
    """Namespaces `<prefix>-<host>` wired to one bridge in `<prefix>-switch`."""

    def __init__(self) -> None:
        self.tag = "mq" + uuid.uuid4().hex[:4]
        self.prefix = f"mlxq-{self.tag}"
        self.switch = f"{self.prefix}-switch"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        self._lock = threading.Lock()

    def start(self) -> "Lab":
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        return self

    def add(self, name: str) -> Host:
        host = Host(self, name, f"{SUBNET}.{len(self.hosts) + 1}")
        _ip("netns", "add", host.netns)
        self._made.append(host.netns)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        # The cable: created in the host's namespace, its other end moved to the switch and bridged.
        _ip("-n", host.netns, "link", "add", "eth0", "type", "veth", "peer", "name", host.switch_port)
        _ip("-n", host.netns, "link", "set", host.switch_port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", host.switch_port, "master", "br0")
        _ip("-n", self.switch, "link", "set", host.switch_port, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        self.hosts[name] = host
        return host

    def close(self) -> None:
        for host in self.hosts.values():
            host.close()
        for netns in reversed(self._made):
            try:
                _ip("netns", "del", netns)
            except RuntimeError:
                pass


@contextmanager
def lab(*names: str) -> Iterator[Lab]:
    made = Lab()
    try:
        made.start()
        for name in names:
            made.add(name)
        yield made
    finally:
        made.close()
