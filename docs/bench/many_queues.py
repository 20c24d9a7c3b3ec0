"""The fleet views with many queues nobody serves registered in RQ's `rq:queues` (docs/operations.md).

A private redis-server with `--junk` empty queues registered (as batch lines for made-up models left them),
one fake-engine worker, and a real `mlxq api` process. Measured: a snapshot read in this process (what
`mlxq stats` does), `GET /metrics` and `GET /dashboard/data` through the gateway (median of `--reads`), the
gateway's CPU while idle over `--idle-s` seconds, and how many names are still registered at the end
(a gateway ages empty queues nobody serves out; the first reads come before it has).

    PYTHONPATH=. python docs/bench/many_queues.py --junk 50000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil
import redis

from mlxq.redis_server import RedisServer, free_port
from producer.fleet_stats import read_snapshot


def timed(action: Callable[[], Any], reads: int) -> float:
    """The median seconds of `reads` calls."""
    times = []
    for _ in range(reads):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times), 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junk", type=int, default=50_000)
    parser.add_argument("--reads", type=int, default=5)
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="mlxq-many-queues-"))
    report: dict[str, Any] = {"junk_queues": args.junk}
    procs: list[subprocess.Popen[bytes]] = []
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        names = [f"rq:queue:mlxq:made-up-{i}" for i in range(args.junk)]
        for start in range(0, len(names), 10_000):
            conn.sadd("rq:queues", *names[start:start + 10_000])
        env = {**os.environ, "MLXQ_ENGINE": "fake"}
        report["snapshot_s_before_any_gateway"] = timed(lambda: read_snapshot(conn), args.reads)
        try:
            port = free_port()
            for name, argv in (("worker", ["worker", "--name", "fake", "--model", "fake"]),
                               ("gateway", ["api", "--port", str(port), "--log-level", "warning"])):
                with open(logs / f"{name}.log", "wb") as log:
                    procs.append(subprocess.Popen([sys.executable, "-m", "mlxq", *argv, "--url", server.url],
                                                  stdout=log, stderr=subprocess.STDOUT, env=env))
            http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
            deadline = time.monotonic() + 120
            while True:
                try:
                    if http.get("/v1/models").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and procs[1].poll() is None, "the gateway did not start"
                time.sleep(0.2)
            report["registered_when_gateway_up"] = conn.scard("rq:queues")
            report["metrics_s"] = timed(lambda: http.get("/metrics").raise_for_status(), args.reads)
            report["dashboard_data_s"] = timed(lambda: http.get("/dashboard/data").raise_for_status(), args.reads)
            gateway = psutil.Process(procs[1].pid)
            before = gateway.cpu_times()
            time.sleep(args.idle_s)
            after = gateway.cpu_times()
            report["idle_gateway_cores"] = round((after.user - before.user + after.system - before.system)
                                                 / args.idle_s, 3)
            report["registered_at_end"] = conn.scard("rq:queues")
            report["snapshot_s_at_end"] = timed(lambda: read_snapshot(conn), args.reads)
            report["metrics_s_at_end"] = timed(lambda: http.get("/metrics").raise_for_status(), args.reads)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
