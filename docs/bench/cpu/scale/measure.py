"""What one Redis primary carries for a fleet: fake-engine workers (mlxq.bench.fake_worker: real
BatchWorkers, zero-cost engine) against a private redis-server.

1. Throughput: 1, 2, 4 and 8 worker processes, N short jobs submitted at once (submit_many) and waited on
   (wait_many); jobs/s, and per job the Redis main thread's CPU, commands (INFO commandstats), bytes in and
   out, and memory held while results live.
2. Upkeep: workers whose 32 slots stay full with long jobs (a 30 ms step, as a small model on a Mac) and
   idle workers; Redis CPU and commands per worker-second, with no job ending.

Run: PYTHONPATH=. python docs/bench/cpu/scale/measure.py [N]   (one JSON object on stdout)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import redis

from mlxq.redis_server import RedisServer
from producer import Client

N = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
REQUEST = {"prompt_token_ids": [1, 2, 3], "max_tokens": 4}
LONG = {"prompt_token_ids": [4, 5, 6], "max_tokens": 4000, "ignore_eos": True}  # 120 s at 30 ms a step


def stats(conn: redis.Redis) -> dict[str, Any]:
    info = conn.info("everything")
    return {"cpu": info["used_cpu_user_main_thread"] + info["used_cpu_sys_main_thread"],
            "in": info["total_net_input_bytes"], "out": info["total_net_output_bytes"], "mem": info["used_memory"],
            "calls": {k.removeprefix("cmdstat_"): v["calls"] for k, v in conn.info("commandstats").items()},
            "t": time.perf_counter()}


def delta(before: dict[str, Any], after: dict[str, Any], per: float) -> dict[str, Any]:
    calls = {k: (v - before["calls"].get(k, 0)) / per for k, v in after["calls"].items()}
    calls = {k: round(v, 2) for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v >= 0.01}
    return {"redis_cpu_ms": round((after["cpu"] - before["cpu"]) / per * 1000, 4),
            "commands": round(sum(calls.values()), 1), "bytes_in": round((after["in"] - before["in"]) / per),
            "bytes_out": round((after["out"] - before["out"]) / per), "by_command": calls}


def workers(url: str, count: int, step_ms: float, seqs: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-m", "mlxq.bench.fake_worker", "--url", url, "--name", f"s{i}",
                              "--max-num-seqs", str(seqs), "--step-ms", str(step_ms), "mlxq"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(count)]


def stop(procs: list[subprocess.Popen[bytes]], kill: bool = False) -> None:
    for proc in procs:
        proc.kill() if kill else proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def live(conn: redis.Redis, count: int) -> None:
    deadline = time.monotonic() + 60
    while conn.zcard("mlxq:workers") < count:
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.1)


def throughput(url: str, conn: redis.Redis, count: int) -> dict[str, Any]:
    conn.flushall()
    procs = workers(url, count, 0.0, 256)
    client = Client(url)
    try:
        live(conn, count)
        time.sleep(1)
        before = stats(conn)
        ids = []
        for start in range(0, N, 500):
            ids += client.submit_many([REQUEST] * min(500, N - start))
        client.wait_many(ids, timeout=600)
        after = stats(conn)
        wall = after["t"] - before["t"]
        return {"workers": count, "jobs": N, "wall_s": round(wall, 2), "jobs_per_s": round(N / wall, 1),
                "redis_busy": round((after["cpu"] - before["cpu"]) / wall, 3),
                "memory_per_job_bytes": round((after["mem"] - before["mem"]) / N), **delta(before, after, N)}
    finally:
        client.close()
        stop(procs)


def upkeep(url: str, conn: redis.Redis, count: int, busy: bool, window_s: float = 10.0) -> dict[str, Any]:
    conn.flushall()
    procs = workers(url, count, 30.0, 32)
    client = Client(url)
    try:
        live(conn, count)
        if busy:
            client.submit_many([LONG] * (32 * count))
            deadline = time.monotonic() + 60
            while conn.zcard("rq:wip:mlxq") < 32 * count:
                assert time.monotonic() < deadline, "the long jobs did not all start"
                time.sleep(0.1)
        time.sleep(2)
        before = stats(conn)
        time.sleep(window_s)
        after = stats(conn)
        wall = after["t"] - before["t"]
        return {"workers": count, "busy": busy, "running_per_worker": 32 if busy else 0,
                **delta(before, after, count * wall)}
    finally:
        client.close()
        stop(procs, kill=True)  # a warm stop would wait for the endless jobs


def main() -> None:
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        result: dict[str, Any] = {"jobs": N, "redis": conn.info("server").get("redis_version"),
                                  "throughput": [], "upkeep_per_worker_second": []}
        for count in (1, 2, 4, 8):
            result["throughput"].append(throughput(server.url, conn, count))
            print(json.dumps(result["throughput"][-1]), file=sys.stderr)
        for busy in (True, False):
            result["upkeep_per_worker_second"].append(upkeep(server.url, conn, 4, busy=busy))
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
