"""`mlxq worker --processes N`: N worker processes on one host, started and watched by one parent.

A second worker process on the same device raised throughput where one process leaves it idle:
MLX's CPU backend runs everything but matmul on one thread per process, and on a big GPU a small
model's decode step waits on the worker's Python (README, Platforms). The parent loads no model.
It shares the host's settings out among the processes, forwards stop signals to them, and starts
again a process that dies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Optional

from worker.settings import WorkerSettings

log = logging.getLogger("mlxq.worker")

MIB = 1024 * 1024
QUICK_EXIT_S = 60.0  # a process that fails sooner than this after its start counts toward giving up
MAX_QUICK_EXITS = 5  # in a row: a model that cannot load, a bad setting, a Redis that refuses us
MAX_BACKOFF_S = 30.0
WATCH_INTERVAL_S = 0.2
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def share(total: int, parts: int, index: int) -> int:
    """Part `index` of `total` cut into `parts` whole parts that differ by at most one and add up to it."""
    return total // parts + (1 if index < total % parts else 0)


def child_settings(host: WorkerSettings, processes: int, cpu_count: int, split_blas_threads: bool,
                   group: Optional[str] = None) -> list[WorkerSettings]:
    """Each process's settings. The host's sequences, KV budget and prefix cache are its totals,
    shared out, so N processes together hold what one would; with `split_blas_threads` (mlxq loaded
    the BLAS: Linux CPU) each process also gets its share of the BLAS threads (default: the cores).
    Processes of one `group` share waiting jobs out among themselves (worker/poll.py)."""
    if processes < 1:
        raise ValueError(f"MLXQ_PROCESSES must be >= 1, got {processes}")
    if processes > host.max_num_seqs:
        raise ValueError(f"MLXQ_PROCESSES ({processes}) must not exceed MLXQ_MAX_NUM_SEQS ({host.max_num_seqs}): "
                         "each process needs at least one sequence")
    kv_budget_mb = host.kv_budget_mb if host.kv_budget_mb is not None else host.kv_budget_bytes // MIB
    blas_threads = host.blas_threads
    if split_blas_threads:
        blas_threads = max(1, (host.blas_threads or cpu_count) // processes)
    return [host.replace(max_num_seqs=share(host.max_num_seqs, processes, i),
                    kv_budget_mb=share(kv_budget_mb, processes, i),
                    prefix_cache_mb=host.prefix_cache_mb // processes,
                    blas_threads=blas_threads, group=group,
                    metrics_port=None if host.metrics_port is None else host.metrics_port + i)
            for i in range(processes)]


@dataclass
class RestartPolicy:
    """When to start a failed process again: at once after a long run, then backing off 1, 2, 4 ...
    seconds while it keeps failing soon after its start, and never after MAX_QUICK_EXITS such
    failures in a row. A process that exits 0 (burst, --max-jobs, a stop) stays stopped."""

    quick_exits: int = 0

    def delay(self, returncode: int, ran_s: float) -> Optional[float]:
        """Seconds to wait before the next start; None to leave the process stopped."""
        if returncode == 0:
            return None
        if ran_s >= QUICK_EXIT_S:
            self.quick_exits = 0
            return 0.0
        self.quick_exits += 1
        if self.quick_exits >= MAX_QUICK_EXITS:
            return None
        return min(MAX_BACKOFF_S, 2.0 ** (self.quick_exits - 1))


@dataclass
class _Child:
    index: int
    settings: WorkerSettings
    proc: Optional[subprocess.Popen[bytes]] = None
    started_at: float = 0.0
    starts: int = 0
    start_at: Optional[float] = 0.0  # when to start it (next); None: it stays stopped
    returncode: Optional[int] = None  # of its last run
    policy: RestartPolicy = field(default_factory=RestartPolicy)


class WorkerGroup:
    """Runs one `mlxq worker` process per entry of `settings` until every one has stopped.

    The first SIGTERM or SIGINT is passed to every process (each does a warm shutdown: it finishes
    its jobs), a second one too (a cold shutdown, as rq's). The processes run in their own session,
    so a terminal's Ctrl-C reaches them once, through this parent; on Linux each is sent SIGTERM if
    the parent dies. Returns 0 when every process's last exit was clean."""

    def __init__(self, settings: list[WorkerSettings], url: str, worker_args: list[str],
                 name: Optional[str] = None) -> None:
        self._children = [_Child(i, s) for i, s in enumerate(settings)]
        self._url = url
        self._worker_args = worker_args  # the non-settings flags and the queues, for every process
        self._name = name
        self._stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._forward)
        signal.signal(signal.SIGINT, self._forward)
        while True:
            now = time.monotonic()
            for child in self._children:
                if child.proc is not None and child.proc.poll() is not None:
                    self._exited(child, now)
                if child.proc is None and child.start_at is not None and now >= child.start_at:
                    self._spawn(child)
            if not any(c.proc is not None or c.start_at is not None for c in self._children):
                break
            time.sleep(WATCH_INTERVAL_S)
        return 0 if all(c.returncode == 0 for c in self._children) else 1

    def _process_name(self, child: _Child) -> Optional[str]:
        """`NAME-i`, then `NAME-i.k` for its k-th restart (rq refuses a name whose worker key is
        still alive, and a killed worker's key outlives it)."""
        if self._name is None:
            return None
        base = f"{self._name}-{child.index + 1}"
        return base if child.starts == 0 else f"{base}.{child.starts}"

    def _spawn(self, child: _Child) -> None:
        name = self._process_name(child)
        argv = [sys.executable, "-m", "mlxq", "worker", *(["--name", name] if name else []), *self._worker_args]
        env = {**os.environ, **child.settings.to_env(), "MLXQ_PROCESSES": "1", "MLXQ_REDIS_URL": self._url}
        child.proc = subprocess.Popen(argv, env=env, start_new_session=True,
                                      preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        child.started_at = time.monotonic()
        child.starts += 1
        child.start_at = None
        s = child.settings
        log.info("worker process %d/%d (pid %d%s): %d sequences, KV budget %s MB, prefix cache %d MB%s",
                 child.index + 1, len(self._children), child.proc.pid, f", {name}" if name else "",
                 s.max_num_seqs, s.kv_budget_mb, s.prefix_cache_mb,
                 f", BLAS threads {s.blas_threads}" if s.blas_threads else "")

    def _exited(self, child: _Child, now: float) -> None:
        assert child.proc is not None
        child.returncode = child.proc.returncode
        child.proc = None
        if self._stopping:
            return
        delay = child.policy.delay(child.returncode, now - child.started_at)
        if delay is not None:
            log.warning("worker process %d exited with code %d; starting it again in %.0f s",
                        child.index + 1, child.returncode, delay)
            child.start_at = now + delay
        elif child.returncode != 0:
            log.error("worker process %d failed %d times in a row within %.0f s of its start; stopping the group",
                      child.index + 1, MAX_QUICK_EXITS, QUICK_EXIT_S)
            self._forward(signal.SIGTERM, None)

    def _forward(self, signum: int, frame: Optional[FrameType]) -> None:
        self._stopping = True
        running = [c.proc for c in self._children if c.proc is not None and c.proc.poll() is None]
        log.info("passing %s to %d worker process(es)", signal.Signals(signum).name, len(running))
        for child in self._children:
            child.start_at = None  # none starts again
        for proc in running:
            proc.send_signal(signum)


def _die_with_parent() -> None:
    """In the child, before exec (Linux): have the kernel send SIGTERM when the parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
