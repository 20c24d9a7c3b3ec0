"""Start real worker processes for tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

BIN = Path(sys.executable).parent


def start_worker(url: str, model: str, *args: str, name: str = "w", env: Optional[dict[str, str]] = None
                 ) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "mlxq", "worker", "--url", url, "--model", model, "--name", name, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


def stop(proc: subprocess.Popen[str], timeout: float = 30) -> str:
    """SIGTERM (warm shutdown), then wait; returns the worker's output."""
    if proc.poll() is None:
        proc.terminate()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
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
