"""Real worker processes for tests, and waits on what they write to Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import redis
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from schemas import keys

BIN = Path(sys.executable).parent


class LoggedProcess(subprocess.Popen):  # type: ignore[type-arg]
    """A process whose output (stdout and stderr) a thread reads as it comes, into `lines`: unread, a
    long log fills the pipe, and a worker blocked writing a log line stalls its bookkeeping (a fake
    worker given 2,000 one-token jobs stopped after ~570). `communicate` waits and returns it all."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        super().__init__(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        stream = self.stdout
        assert stream is not None
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(stream.readline, "")), daemon=True)
        self._reader.start()

    def communicate(self, input: Optional[str] = None, timeout: Optional[float] = None) -> tuple[str, None]:
        self.wait(timeout)  # subprocess.TimeoutExpired, as Popen.communicate raises it
        self._reader.join(timeout=10)
        return "".join(self.lines), None


def start_worker(url: str, model: str, *args: str, name: str = "w", env: Optional[dict[str, str]] = None
                 ) -> LoggedProcess:
    return LoggedProcess([sys.executable, "-m", "mlxq", "worker", "--url", url, "--model", model, "--name", name, *args],
                         env={**os.environ, **(env or {})})


def stop(proc: subprocess.Popen, timeout: float = 30) -> str:  # type: ignore[type-arg]
    """SIGTERM (warm shutdown), then wait; returns the worker's output."""
    if proc.poll() is None:
        proc.terminate()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # the worker prints every thread's stack: why it did not stop
        time.sleep(1)
        proc.kill()
        out, _ = proc.communicate()
    return out or ""


def run_rq_worker(url: str, worker_class: str, queues: list[str], env: dict[str, str], timeout: float = 180
                  ) -> subprocess.CompletedProcess[str]:
    """The contract's plain `rq worker` command line, in burst mode."""
    return subprocess.run(
        [str(BIN / "rq"), "worker", "-w", worker_class, "-S", "rq.serializers.JSONSerializer", "-u", url,
         "--burst", *queues],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )


def start_fake_worker(url: str, *args: str, name: str = "fake", env: Optional[dict[str, str]] = None,
                      step_delay_s: float = 0.02) -> LoggedProcess:
    """A real worker process on the deterministic model-free engine (fault injection by prompt)."""
    return LoggedProcess(
        [sys.executable, "-m", "mlxq", "worker", "--url", url, "--name", name, *args],
        env={**os.environ, "MLXQ_ENGINE": "fake", "MLXQ_FAKE_STEP_DELAY_S": str(step_delay_s),
             "MLXQ_HEARTBEAT_INTERVAL_S": "1", "MLXQ_SWEEP_INTERVAL_S": "2", **(env or {})},
    )


def wait_for(predicate: Callable[[], bool], timeout: float = 60, interval: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def rq_status(url: str, job_id: str) -> JobStatus:

    return Job.fetch(job_id, connection=redis.Redis.from_url(url), serializer=JSONSerializer).get_status()


def started_registry_empty(url: str) -> bool:

    registry = StartedJobRegistry("mlxq", connection=redis.Redis.from_url(url), serializer=JSONSerializer)
    wait_for(lambda: registry.get_job_ids() == [], timeout=15, what="an empty started registry")
    return True


def rq_ends_as(url: str, job_id: str, status: JobStatus) -> bool:
    """The result key is written before RQ marks the job ended: give RQ's write a moment."""
    wait_for(lambda: rq_status(url, job_id) == status, timeout=15, what=f"RQ status {status}")
    return True




class ScriptFlusher(threading.Thread):
    """`SCRIPT FLUSH` about once a millisecond while the block runs (a fault any client allowed to send
    it can cause); `flushes` counts them."""

    def __init__(self, connection: redis.Redis) -> None:
        super().__init__(name="script-flusher", daemon=True)
        self.connection = connection
        self.stopping = threading.Event()
        self.flushes = 0

    def run(self) -> None:
        while not self.stopping.is_set():
            self.connection.script_flush()
            self.flushes += 1
            time.sleep(0.001)

    def __enter__(self) -> "ScriptFlusher":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.join(timeout=10)


def workers_live(conn: redis.Redis, count: int, timeout: float = 60) -> None:
    """Until `count` workers have a heartbeat entry (the names in mlxq:workers stay an hour after a worker
    is gone, so their count includes earlier tests' workers)."""
    def live() -> int:
        return sum(bool(conn.exists(keys.worker_key(name.decode()))) for name in conn.zrange(keys.WORKERS_KEY, 0, -1))

    wait_for(lambda: live() >= count, timeout=timeout, what=f"{count} live workers")
